"""Are one rank's cuDNN calls in a 2-GPU zigzag ring as fast per pair as the one single-GPU call?

For no mask and causal at 16k and 32k tokens it times, on one GPU, the single-GPU call over
the whole sequence and the calls one rank makes (no mask: two squares of half the length;
causal over zigzag: a causal square of half the length and a full block of a quarter by a
half), fwd+bwd, and prints the ceiling this puts on the ring's efficiency, transfers aside.

    python scripts/shape_probe.py
"""
from __future__ import annotations

import statistics

import torch

from bench_hop import timed  # scripts/ is on sys.path
from ringflex import mods
from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.plan import Segment

HEADS, HEAD_DIM = 32, 128


def calls(kernel: CudnnKernel, rows: int, cols: int, causal: bool):
    """(forward, backward) of one call of ``rows`` queries against ``cols`` keys."""
    q, dout = (torch.randn(1, HEADS, rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, HEADS, cols, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    m = Mods(None, mods.causal if causal else None)
    segs = (Segment(0, 1, rows), Segment(0, 1, cols)) if causal else (None, None)
    scale = HEAD_DIM ** -0.5
    out, lse, _ = kernel.forward(q, k, v, *segs, m, scale, causal)
    return (lambda: kernel.forward(q, k, v, *segs, m, scale, causal),
            lambda: kernel.backward(q, k, v, out, lse, dout, *segs, m, scale, causal))


def main():
    kernel = CudnnKernel()
    for n in (16384, 32768):
        h = n // 2
        shapes = {"single none": [(n, n, False)], "rank none": [(h, h, False), (h, h, False)],
                  "single causal": [(n, n, True)], "rank causal": [(h, h, True), (h // 2, h, False)]}
        fns = {name: [fn for shape in group for fn in calls(kernel, *shape)] for name, group in shapes.items()}
        times = {name: [] for name in shapes}
        for _ in range(5):  # interleaved rounds, medians
            for name, group in fns.items():
                times[name].append(sum(timed(fn)[0] for fn in group))
        median = {name: statistics.median(t) for name, t in times.items()}
        for kind in ("none", "causal"):
            single, rank = median[f"single {kind}"], median[f"rank {kind}"]
            print(f"{n} tokens {kind}: single fwd+bwd {single:.3f} ms, one rank's calls {rank:.3f} ms, "
                  f"ceiling efficiency {single / (2 * rank):.3f}")
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
