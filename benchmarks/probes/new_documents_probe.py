"""Packed documents that change every call, one rank's hops on ONE GPU (no second GPU needed).

Rank 1 of a 2-rank ring over the contiguous layout runs two steps: its own block, and the rows
of rank 0's block that the document straddling the two ranks reads, received as the ring
receives them (``ring.widened`` rows, contiguous). This runs those hops with the cuDNN kernel,
forward and backward, for a new packed batch at every call, and prints the cuDNN graphs built
so far after so many calls, and the GPU time per call once they are built, beside one mask
used every call.

    python -m benchmarks.probes.new_documents_probe --seq-len 16384 --calls 150
    python -m benchmarks.probes.new_documents_probe --seq-len 65536 --heads 1 --check   # numerics of those hops
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import make_mods
from ringflex.kernels import cudnn
from ringflex.kernels.base import Mods
from ringflex.plan import layout as layouts
from ringflex.kernels.merge import rows
from ringflex.plan.blocks import widened
from ringflex.plan.blocks import keys_read, plan_hops


def rank_one_plan(mask_mod, seq_len: int, heads: int, kernel, device):
    """Rank 1's hops under ``mask_mod``, planned as the ring plans them (the kernel's exact plans included)."""
    q_segs = layouts.segments("contiguous", seq_len, 2, 1)
    kv_segs = [layouts.segments("contiguous", seq_len, 2, rank) for rank in (1, 0)]
    return plan_hops(mask_mod, False, 1, heads, q_segs, kv_segs, device, 1024, kernel)


def rank_one_calls(schedule, local: int, own, previous):
    """Each hop of ``schedule`` with the keys and values it reads, held as the ring holds them
    (rank 0's rows that rank 1 reads, ``ring.widened``, received contiguous)."""
    lo, hi = widened(keys_read(schedule, 2)[1], local)
    held = [own, [t[:, :, lo:hi].contiguous() for t in previous]]
    offsets = [0, lo]
    return [(hop, [rows(t, (hop.kv_rows[0] - offsets[step], hop.kv_rows[1] - offsets[step])) for t in held[step]])
            for step, hops in enumerate(schedule) for hop in hops]


def rank_one_hops(mask_mod, seq_len: int, heads: int, kernel, q, dout, own, previous, schedule=None):
    """Forward and backward of rank 1's hops under ``mask_mod``."""
    schedule = schedule or rank_one_plan(mask_mod, seq_len, heads, kernel, q.device)
    m, scale = Mods(None, mask_mod), q.shape[-1] ** -0.5
    out, lse = torch.zeros_like(q), torch.full(q.shape[:3], -float("inf"), device=q.device)
    calls = rank_one_calls(schedule, seq_len // 2, own, previous)
    for hop, (k, v) in calls:
        o, l, _ = kernel.forward(rows(q, hop.q_rows), k, v, hop.q_seg, hop.kv_seg, m, scale, True)
        rows(out, hop.q_rows).copy_(o)  # the hops' rows do not overlap here: no merge needed for timing
        rows(lse, hop.q_rows).copy_(l)
    for hop, (k, v) in calls:
        kernel.backward(rows(q, hop.q_rows), k, v, rows(out, hop.q_rows), rows(lse, hop.q_rows),
                        rows(dout, hop.q_rows), hop.q_seg, hop.kv_seg, m, scale, True)


def profile_new_batches(args, kernel, q, dout, own, previous) -> None:
    """Planning (synchronised) and the hops apart over new batches, then a cProfile of both."""
    import cProfile
    import pstats
    masks = [make_mods("documents", args.seq_len, q.device, 0, args.doc_len, seed=10_000 + i)[1]
             for i in range(2 * args.profile)]
    planning = hops = 0.0
    for mask in masks[:args.profile]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        schedule = rank_one_plan(mask, args.seq_len, args.heads, kernel, q.device)
        torch.cuda.synchronize()
        middle = time.perf_counter()
        rank_one_hops(mask, args.seq_len, args.heads, kernel, q, dout, own, previous, schedule)
        torch.cuda.synchronize()
        planning, hops = planning + middle - start, hops + time.perf_counter() - middle
    print(f"new batches: planning {1e3 * planning / args.profile:.1f} ms, hops {1e3 * hops / args.profile:.1f} ms "
          f"per fwd+bwd", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for mask in masks[args.profile:]:
        rank_one_hops(mask, args.seq_len, args.heads, kernel, q, dout, own, previous)
        torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def check_hops(args) -> None:
    """Each of rank 1's hops for one packed batch, on cuDNN in bf16 against the reference kernel
    in fp32: forward output and LSE, and the gradients from the reference's own forward."""
    from check_ring import relative_error
    from ringflex.kernels.reference import ReferenceKernel

    dev, local = torch.device("cuda"), args.seq_len // 2
    exact = [torch.randn(1, args.heads, local, 128, device=dev) for _ in range(6)]
    q, dout, own, previous = exact[0], exact[1], exact[2:4], exact[4:6]
    mask_mod = make_mods("documents", args.seq_len, dev, 0, args.doc_len, seed=1)[1]
    kernel, reference, m, scale = cudnn.CudnnKernel(), ReferenceKernel(), Mods(None, mask_mod), 128 ** -0.5
    schedule = rank_one_plan(mask_mod, args.seq_len, args.heads, kernel, dev)
    worst = 0.0
    for hop, (k, v) in rank_one_calls(schedule, local, own, previous):
        ours = [rows(t, hop.q_rows) for t in (q, dout)] + [k, v]
        low = [t.bfloat16() for t in ours]
        out, lse, _ = reference.forward(ours[0], k, v, hop.q_seg, hop.kv_seg, m, scale, True)
        got_out, got_lse, _ = kernel.forward(low[0], low[2], low[3], hop.q_seg, hop.kv_seg, m, scale, True)
        want = reference.backward(ours[0], k, v, out, lse, ours[1], hop.q_seg, hop.kv_seg, m, scale, True)
        got = kernel.backward(low[0], low[2], low[3], out.bfloat16(), lse, low[1], hop.q_seg, hop.kv_seg, m, scale,
                              True)
        errors = [relative_error(got_out.float(), out), relative_error(torch.where(lse.isinf(), 0, got_lse),
                                                                       torch.where(lse.isinf(), 0, lse))]
        errors += [relative_error(g.float(), w) for g, w in zip(got, want)]
        worst = max(worst, *errors)
        print(f"hop rows {hop.q_rows} keys {hop.kv_rows}: out, lse, dq, dk, dv relative errors "
              + ", ".join(f"{e:.1e}" for e in errors), flush=True)
    print(f"{'within' if worst < 3e-2 else 'NOT within'} 3e-2: worst {worst:.1e}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--doc-len", type=int, default=4096)
    p.add_argument("--calls", type=int, default=150)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--profile", type=int, default=0, help="then so many more new batches: planning apart, and a cProfile")
    p.add_argument("--check", action="store_true", help="instead: each hop of one batch against the reference kernel "
                   "in fp32 (use few --heads: it holds a hop's scores)")
    args = p.parse_args()
    if args.check:
        return check_hops(args)
    dev = torch.device("cuda")
    local = args.seq_len // 2
    q, dout, k, v, k0, v0 = (torch.randn(1, args.heads, local, 128, device=dev, dtype=torch.bfloat16) for _ in range(6))
    kernel, built = cudnn.CudnnKernel(), []
    build = cudnn.graphs._build
    cudnn.graphs._build = lambda *a: built.append(1) or build(*a)
    masks = [make_mods("documents", args.seq_len, dev, 0, args.doc_len, seed=i)[1] for i in range(args.calls)]
    times, marks = [], {10, 25, 50, 100, 150, 200, 300}
    for i, mask in enumerate(masks, 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rank_one_hops(mask, args.seq_len, args.heads, kernel, q, dout, (k, v), (k0, v0))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if i in marks:
            print(f"after {i} new batches: {len(built)} cuDNN graphs built; last 10 calls {1e3 * sum(times[-10:]) / 10:.1f} ms "
                  f"per fwd+bwd (planning included)", flush=True)
    if args.profile:
        profile_new_batches(args, kernel, q, dout, (k, v), (k0, v0))
    fixed = masks[-1]
    for _ in range(3):
        rank_one_hops(fixed, args.seq_len, args.heads, kernel, q, dout, (k, v), (k0, v0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        rank_one_hops(fixed, args.seq_len, args.heads, kernel, q, dout, (k, v), (k0, v0))
    torch.cuda.synchronize()
    print(f"one mask every call: {1e3 * (time.perf_counter() - start) / 10:.1f} ms per fwd+bwd (planned anew too, "
          f"from its cached trace and exact plans)")


if __name__ == "__main__":
    main()
