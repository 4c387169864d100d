"""Checks the ring against one device computing the whole sequence, for the whole test matrix.

    torchrun --nproc_per_node=2 -m tools.check_ring --device cuda --backend cudnn   # GPUs, NCCL
                                          # (fewer GPUs than ranks: they share them, tools/ranks.py)
    torchrun --nproc_per_node=3 -m tools.check_ring --device cpu --local-len 16     # CPU, gloo
    torchrun --nproc_per_node=2 -m tools.check_ring --lse-grad    # a loss that reads the LSE too
    torchrun --nproc_per_node=4 -m tools.check_ring --mesh 2x2    # a heads x ring mesh
    torchrun --nproc_per_node=2 -m tools.check_ring --layouts by-mask default   # shard_by_mask's; none given

(from the repository root: the cases and the fp64 oracle come from ``tests/support``)

Each rank compares its shard of the output and of dq/dk/dv with the reference kernel run
in fp32 on the unsharded sequence; rank 0 prints one line per case and layout (with the
most query rows a rank lent, ``ringflex.plan.lending``), and the script exits non-zero if any
error exceeds the tolerance.
"""
import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ringflex
from ringflex.kernels.base import Mods
from ringflex.kernels.reference import ReferenceKernel
from ringflex.parallel import peer
from ringflex.plan.layout import Segment

from tests.support.calls import agreed_calls
from tests.support.cases import cases, make_inputs
from tests.support.harness import weigh_cudnn_calls_as_free
from tests.support.oracle import attention
from tools import ranks


def reference(q, k, v, dout, case):
    """Output and input gradients of the whole sequence, fp32, one device."""
    whole_q, whole_kv = Segment(0, 1, q.shape[2]), Segment(0, 1, k.shape[2])
    mods, scale, kernel = Mods(case.score_mod, case.mask_mod), q.shape[-1] ** -0.5, ReferenceKernel()
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    out, lse, _ = kernel.forward(q, k, v, whole_q, whole_kv, mods, scale, masked=True)
    grads = kernel.backward(q, k, v, out, lse, dout, whole_q, whole_kv, mods, scale, masked=True)
    return [out, *grads]


def reference_through_lse(q, k, v, dout, dlse, case):
    """Output and input gradients of a loss that reads the output and the LSE: autograd through
    the definition (tests/oracle.py), fp64 on the CPU (``case`` with its tensors there)."""
    full = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*full, case.score_mod, case.mask_mod, return_lse=True)
    torch.autograd.backward([out, lse], [dout.cpu().double(), dlse.cpu().double()])
    return [t.to(q.device) for t in (out, *(f.grad for f in full))]


def _lent_rows(calls) -> int:
    """How many of this rank's query rows the previous rank computed, over ``calls`` (``RingCall``s agreed)."""
    return sum(0 if call.loan is None else call.loan.lent[1] - call.loan.lent[0] for call in calls)


def relative_error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--local-len", type=int, default=1024, help="query tokens per rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", nargs="+", default=list(ringflex.LAYOUTS),
                   choices=(*ringflex.LAYOUTS, "default", "by-mask"),
                   help="default: no layout given to shard or the call (which may re-shard inside); by-mask: the "
                        "sharding ringflex.shard_by_mask chooses for the case's mask (1-D ring only)")
    p.add_argument("--cases", nargs="+", help="only these cases of the matrix (default: all)")
    p.add_argument("--tolerance", type=float, default=None, help="max relative error (default: 3e-2 bf16, 1e-4 fp32)")
    p.add_argument("--lse-grad", action="store_true", help="the loss reads the LSE too (its gradient flows back)")
    p.add_argument("--mesh", help="a heads x ring mesh 'axr' of every rank (a * r ranks) instead of the 1-D ring")
    args = p.parse_args()
    if args.mesh and "by-mask" in args.layouts:
        p.error("--layouts by-mask needs a 1-D ring (no --mesh)")
    ranks.init(args.device)
    group = None
    if args.mesh:
        group = init_device_mesh(args.device, tuple(map(int, args.mesh.split("x"))), mesh_dim_names=("heads", "ring"))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tolerance = args.tolerance or (3e-2 if dtype == torch.bfloat16 else 1e-4)
    seq_len = args.local_len * world_size
    failed = 0
    on_cpu = cases(seq_len, image_width=32) if args.lse_grad else None
    weigh_cudnn_calls_as_free()  # every call lends wherever the ranks' pairs are uneven
    calls = agreed_calls()
    for name, case in cases(seq_len, image_width=32, device=args.device).items():
        if args.cases and name not in args.cases:
            continue
        q, k, v, dout = (t.to(args.device) for t in make_inputs(case, seq_len, batch=1, head_dim=args.head_dim, dtype=dtype))
        if args.lse_grad:
            dlse = torch.randn(dout.shape[:3], generator=torch.Generator().manual_seed(1)).to(args.device)
            want = reference_through_lse(q, k, v, dout, dlse, on_cpu[name])
        else:
            want = reference(q, k, v, dout, case)
        for name_of_layout in args.layouts:
            if name_of_layout == "by-mask" and k.shape[2] != q.shape[2]:
                continue  # a Sharding is of one length: cross-attention's keys have another
            if name_of_layout == "by-mask":
                layout = ringflex.shard_by_mask(case.mask_mod, seq_len, world_size, heads=q.shape[1])
            else:
                layout = None if name_of_layout == "default" else name_of_layout
            local = [ringflex.shard(t, 2, group=group, layout=layout).requires_grad_() for t in (q, k, v)]
            calls.clear()
            try:
                out, lse = ringflex.ring_flex_attention(*local, score_mod=case.score_mod, mask_mod=case.mask_mod,
                                                        group=group, layout=layout, enable_gqa=True,
                                                        backend=args.backend, return_lse=True)
                grads = [ringflex.shard(dout, 2, group=group, layout=layout)]
                if args.lse_grad:
                    grads.append(ringflex.shard(dlse, 2, group=group, layout=layout))
                torch.autograd.backward([out, lse][:len(grads)], grads)
            except Exception as e:  # report and go on: one unsupported case must not hide the rest
                failed += 1
                if rank == 0:
                    print(f"{name:>18} {name_of_layout:>10}: ERROR {type(e).__name__}: {e}", flush=True)
                continue
            got = [out] + [t.grad for t in local]
            *errs, lent = ranks.max_over_ranks([relative_error(g, ringflex.shard(w, 2, group=group, layout=layout))
                                                for g, w in zip(got, want)] + [float(_lent_rows(calls))], q.device)
            ok = max(errs) <= tolerance and not any(torch.isnan(g).any() for g in got)
            failed += not ok
            if rank == 0:
                print(f"{name:>18} {name_of_layout:>10}: out {errs[0]:.2e} dq {errs[1]:.2e} dk {errs[2]:.2e} dv {errs[3]:.2e}"
                      f" lent {int(lent):>4} {'ok' if ok else 'FAIL'}", flush=True)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    transport = peer.in_use(dist.group.WORLD, device)
    if rank == 0:
        print(f"world size {world_size}{f' (mesh {args.mesh})' if args.mesh else ''}, {seq_len} tokens, backend {args.backend}, transfers {transport}: "
              f"{'all cases within' if not failed else f'{failed} case(s) beyond'} tolerance {tolerance}")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
