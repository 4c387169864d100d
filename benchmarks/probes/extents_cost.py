"""What planning one block exactly costs on a GPU: the mask evaluated on every pair, against
tiles of keys ranged by the mask's formula with only the open tiles evaluated (``ringflex.extents``).

    python -m benchmarks.probes.extents_cost
"""
from __future__ import annotations

import time

import torch

from benchmarks.common import make_mods
from ringflex import mods
from ringflex.mod.trace import trace_mask_mod
from ringflex.plan import extents
from ringflex.plan.blocks import evaluate_mask
from ringflex.plan.layout import Segment

SHAPES = [(4096, 4096), (8192, 8192), (8192, 16384), (16384, 16384), (16384, 32768)]


def _ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    device, seq_len = torch.device("cuda"), 65536
    masks = {"documents": make_mods("documents", seq_len, device, 0, 4096, seed=3)[1],
             "window 4096": mods.sliding_window(4096), "causal": mods.causal}
    print("| mask | block | every pair ms | tiles ms |\n| --- | --- | ---: | ---: |")
    for name, mask_mod in masks.items():
        mask = trace_mask_mod(mask_mod, device)
        for rows, cols in SHAPES:  # the last rows of the sequence, against keys half of them before those rows
            q_seg, kv_seg = Segment(seq_len - rows, 1, rows), Segment(seq_len - rows - cols // 2, 1, cols)
            q, kv = q_seg.positions(device), kv_seg.positions(device)
            whole = _ms(lambda: extents.dense_row_extents(evaluate_mask(mask_mod, 1, 1, q, kv)[0, 0]))
            tiles = _ms(lambda: extents._tiled(mask_mod, mask, q, kv_seg))
            print(f"| {name} | {rows} x {cols} | {whole:.2f} | {tiles:.2f} |", flush=True)


if __name__ == "__main__":
    main()
