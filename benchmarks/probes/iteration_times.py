"""Whether calls issued back to back run at one steady pace or stall now and then: the GPU
time of each of many fwd+bwd calls (an event recorded before each), per rank, and the host
time spent issuing each call. A mean over a few calls (the benchmark's) cannot tell a ring
that is uniformly slower from one that waits for its host now and then.

    torchrun --nproc_per_node=2 -m benchmarks.probes.iteration_times --seq-len 16384 --masks causal

Prints, for rank 0 and each workload: the median, 10th and 90th percentile and the largest
call time (GPU ms, the slowest rank's call as the ring's pace), the host ms per call, and
each call's time in order.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist

import ringflex
from benchmarks.common import make_mods
from tools.ranks import init, max_over_ranks


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--masks", nargs="+", default=["causal", "none"])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--gc-off", action="store_true", help="Python's cyclic garbage collector off during the calls")
    p.add_argument("--lag", type=int, default=0, metavar="N",
                   help="the host issues a call only once the call N before it has run (0: no limit)")
    args = p.parse_args()
    device = init()
    world = dist.get_world_size()
    for mask in args.masks:
        score_mod, mask_mod = make_mods(mask, args.seq_len, device, 4096, 4096)
        shape = (1, 32, args.seq_len, 128)
        q, k, v = (ringflex.shard(torch.randn(shape, device=device, dtype=torch.bfloat16), 2, layout="zigzag")
                   .requires_grad_() for _ in range(3))
        grad = torch.randn_like(q)

        def call():
            ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                         layout="zigzag").backward(grad)

        for _ in range(args.warmup):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        if args.gc_off:
            gc.disable()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.calls + 1)]
        host = []
        events[0].record()
        for i in range(args.calls):
            if args.lag and i >= args.lag:
                events[i - args.lag + 1].synchronize()
            t0 = time.perf_counter()
            call()
            host.append(time.perf_counter() - t0)
            events[i + 1].record()
        torch.cuda.synchronize()
        gc.enable()
        mine = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
        pace = max_over_ranks(mine, device)  # a call's time on the slowest rank
        ordered = sorted(pace)
        if dist.get_rank() == 0:
            print(f"== {args.seq_len} tokens ({args.seq_len // world}/GPU), {mask}, {args.calls} calls"
                  f"{', gc off' if args.gc_off else ''}{f', host at most {args.lag} ahead' if args.lag else ''}: GPU ms median {statistics.median(pace):.3f}, "
                  f"p10 {ordered[len(ordered) // 10]:.3f}, p90 {ordered[9 * len(ordered) // 10]:.3f}, "
                  f"max {ordered[-1]:.3f}, mean {statistics.mean(pace):.3f}; host ms per call "
                  f"{statistics.median(host) * 1e3:.3f} (max {max(host) * 1e3:.3f})", flush=True)
            print("   " + " ".join(f"{x:.2f}" for x in pace), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
