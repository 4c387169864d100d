"""Host time of planning a new packed batch: ``plan_hops`` with the cuDNN kernel's exact
plans for both ranks' blocks of a 2-rank ring, as the first layer of a training step on new
documents pays it (the medians of 10 new masks, after 3).

    python scripts/plan_cost.py            # on a GPU
"""
from __future__ import annotations

import argparse
import time

import torch

from bench import make_mods  # scripts/ is on sys.path when this runs as a script
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.parallel import layout as layouts
from ringflex.plan import plan_hops

WORLD = 2


def planning_ms(seq_len: int, layout: str, doc_len: int, seed: int, device) -> float:
    mask_mod = make_mods("documents", seq_len, device, 0, doc_len, seed=seed)[1]
    kernel = CudnnKernel()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for rank in range(WORLD):
        kv_segs = [layouts.segments(layout, seq_len, WORLD, (rank - step) % WORLD) for step in range(WORLD)]
        plan_hops(mask_mod, False, 1, 32, layouts.segments(layout, seq_len, WORLD, rank), kv_segs, device, 1024, kernel)
    return 1e3 * (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--doc-lens", type=int, nargs="+", default=[4096, 1024])
    args = p.parse_args()
    device = torch.device("cuda")
    for seq_len in args.seq_lens:
        for layout in ("contiguous", "zigzag"):
            for doc_len in args.doc_lens:
                for seed in range(3):
                    planning_ms(seq_len, layout, doc_len, seed, device)
                times = sorted(planning_ms(seq_len, layout, doc_len, 100 + seed, device) for seed in range(10))
                print(f"{seq_len} tokens, {layout}, documents of ~{doc_len}: planning both ranks {times[5]:.2f} ms",
                      flush=True)


if __name__ == "__main__":
    main()
