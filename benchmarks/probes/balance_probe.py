"""Each rank's attention work, timed alone on one GPU: what lending does to the busiest rank.

    python -m benchmarks.probes.balance_probe --seq-len 16384 --world-size 2 --layout contiguous --masks window documents

A ring runs as fast as its busiest rank. Without a GPU per rank, this plans every rank's
hops as a ring call would (the planner, the ranks' shared counts, ``ringflex.plan.lending``),
then times each rank's hops alone on one GPU with the cuDNN kernel, forward and backward:
its own schedule, the rows it keeps of its step-1 hops, and the rows it borrows, replayed
from a CUDA graph so that only the GPU's time counts. It prints each rank's milliseconds with
lending off and on (on at any size, as ``RINGFLEX_LENDING=1``: by default a ring lends only
from ``lending.MIN_CALLS`` calls' worth), the one-GPU kernel on the whole sequence, and the
bound the busiest rank puts on the ring's efficiency, t_one_gpu / (W x t_busiest)
(transfers and merges left out).
"""
import argparse
import functools

import torch

from benchmarks.common import make_mods, replayed_ms
from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.kernels.merge import rows
from ringflex.plan import layout as layouts
from ringflex.plan import lending
from ringflex.plan.blocks import distances_needed, keys_read, part_planner, plan_hops
from ringflex.plan.layout import Segment


def rank_hops(mask_mod, seq_len: int, world: int, layout: str, lend: bool, device, call: int = 0):
    """Per rank, the (hop, block owner) pairs it computes: a ring call's plan, cut to the
    steps some rank needs, with the ranks' loans where ``lend`` (a call weighed as ``call`` pairs)."""
    kernel = CudnnKernel()
    segs = [layouts.segments(layout, seq_len, world, r) for r in range(world)]
    plans = [plan_hops(mask_mod, False, 1, 1, segs[r], [segs[(r - s) % world] for s in range(world)], device,
                       kernel=kernel) for r in range(world)]
    distances = distances_needed([keys_read(plan, world) for plan in plans])
    plans = [[plan[d] for d in distances] for plan in plans]
    lends = distances[1:2] == [1]  # the next rank's rows, against this rank's block
    offers = [lending.Offer.of(mask_mod, plans[r], plans[(r + 1) % world][1] if lends else (), call, device)
              for r in range(world)]
    shared = [offer.shares if lend else lending.NO_OFFER for offer in offers]
    planned_part = part_planner(kernel, mask_mod, False, device)
    work = []
    for r, (plan, offer) in enumerate(zip(plans, offers)):
        loan = offer.agree(shared, r, planned_part) if lends else None
        if loan is not None:
            plan = [plan[0], list(loan.kept), *plan[2:]]
        hops = [(hop, (r - d) % world) for d, step in zip(distances, plan) for hop in step]
        hops += [(hop, r) for hop in (loan.borrowed_hops if loan is not None else ())]
        work.append(hops)
    return work


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--masks", nargs="+", default=["window", "documents"])
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--doc-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    dev, kernel = torch.device("cuda"), CudnnKernel()
    local = args.seq_len // args.world_size
    blocks = [tuple(torch.randn(1, args.heads, local, args.head_dim, device=dev, dtype=torch.bfloat16)
                    for _ in range(4)) for _ in range(args.world_size)]  # q, k, v, dout per rank
    for name in args.masks:
        _, mask_mod = make_mods(name, args.seq_len, dev, args.window, args.doc_len)
        mods = Mods(None, mask_mod)

        def run(pairs, queries):
            for hop, owner in pairs:
                q, dout = (rows(t, hop.q_rows) for t in (queries[0], queries[3]))
                k, v = (rows(t, hop.kv_rows) for t in blocks[owner][1:3])
                scale = args.head_dim ** -0.5
                out, lse, _ = kernel.forward(q, k, v, hop.q_seg, hop.kv_seg, mods, scale, True)
                kernel.backward(q, k, v, out, lse, dout, hop.q_seg, hop.kv_seg, mods, scale, True)

        whole = Segment(0, 1, args.seq_len)
        q, k, v, dout = (torch.randn(1, args.heads, args.seq_len, args.head_dim, device=dev, dtype=torch.bfloat16)
                         for _ in range(4))

        def single():
            out, lse, _ = kernel.forward(q, k, v, whole, whole, mods, args.head_dim ** -0.5, True)
            kernel.backward(q, k, v, out, lse, dout, whole, whole, mods, args.head_dim ** -0.5, True)

        one_gpu = replayed_ms(single)
        print(f"{args.seq_len} tokens, {name}, {args.layout} over {args.world_size} ranks: one GPU {one_gpu:.2f} ms "
              f"fwd+bwd", flush=True)
        unlent = rank_hops(mask_mod, args.seq_len, args.world_size, args.layout, False, dev)
        lent = rank_hops(mask_mod, args.seq_len, args.world_size, args.layout, True, dev,
                         kernel.call_pairs(1, args.heads, args.head_dim))
        for label, work in (("off", unlent), ("on ", lent)):
            if work is lent and lent == unlent:
                print("  lending on : no loan", flush=True)
                continue
            ms = [replayed_ms(functools.partial(run, pairs, blocks[r])) for r, pairs in enumerate(work)]
            print(f"  lending {label}: per rank {', '.join(f'{t:.2f}' for t in ms)} ms; "
                  f"bound t_one_gpu / (W x t_busiest) {one_gpu / (args.world_size * max(ms)):.3f}", flush=True)


if __name__ == "__main__":
    main()
