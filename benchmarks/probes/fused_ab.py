"""Does a Triton launch cost a host-bound call more host time than its one pass saves GPU time?
The ring's merges, sums and copies with the fused Triton kernels and with torch's operations,
in turn in one process for many rounds, fwd+bwd ms of the slowest rank.

    torchrun --nproc_per_node=4 -m benchmarks.probes.fused_ab --seq-len 32768
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import ringflex
from benchmarks.common import make_mods, timed
from ringflex.kernels import fused_merge
from tools.ranks import init


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--cases", nargs="+", default=["documents:contiguous", "window:contiguous", "causal:zigzag"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    device = init()
    control = dist.new_group(backend="gloo")
    fused = fused_merge.available
    for case in args.cases:
        mask, layout = case.split(":")
        score_mod, mask_mod = make_mods(mask, args.seq_len, device, 4096, 4096)
        local = [ringflex.shard(torch.randn(1, 32, args.seq_len, 128, device=device, dtype=torch.bfloat16), 2,
                                layout=layout).requires_grad_() for _ in range(3)]
        grad = torch.randn_like(local[0])

        def call(available):
            def run():
                fused_merge.available = available
                ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod,
                                             layout=layout).backward(grad)
            return run

        variants = {"Triton": call(fused), "torch": call(lambda: False)}
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(timed(fn, args.iters, 2, device, control) * 1e3)
        fused_merge.available = fused
        for name, ts in times.items():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, statistics.median(ts), group=control)
            if dist.get_rank() == 0:
                print(f"{case:22s} {name:7s} median {max(gathered):7.2f} ms  (per rank "
                      f"{' '.join(f'{m:.2f}' for m in gathered)})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
