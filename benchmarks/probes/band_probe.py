"""How cuDNN's band masks cost against their causal counterparts, forward and backward.

    python -m benchmarks.probes.band_probe

One GPU, B=1, H=32, D=128, bf16. For blocks a ring hands the kernel under a sliding window
(the window's diagonal block, the block before it, a two-sided band over two blocks, the
whole sequence of one GPU) it times ringflex's cuDNN kernel, and, for the block before the
diagonal, the same block computed as a causal block on reversed rows and keys (flips
included), next to causal blocks of the same sizes. Pairs computed = work; time per
million pairs compares the kernels' efficiency. A window over two blocks of keys is the
band whose backward cost cuDNN 1.9x per pair; the kernel now splits it (``band_runs``).
"""
from __future__ import annotations

import torch

from benchmarks import common
from ringflex import mods
from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.kernels.cudnn.blocks import Run
from ringflex.plan.blocks import evaluate_mask
from ringflex.plan.layout import Segment


def timed(fn) -> float:
    """Milliseconds per call of ``fn``, 20 calls back to back after 3 warm-up calls."""
    return common.timed(fn, iters=20, warmup=3, device=torch.device("cuda")) * 1e3


def tensors(n_q: int, n_k: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda n: torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return make(n_q), make(n_k), make(n_k), make(n_q)


def probe(name: str, mask_mod, q_seg: Segment, kv_seg: Segment, runs=None) -> None:
    """``runs``: the calls to make instead of the kernel's own plan."""
    kernel, m, scale = CudnnKernel(), Mods(None, mask_mod), 128 ** -0.5
    if runs is not None:
        kernel._runs = lambda *args: runs
    q, k, v, dout = tensors(q_seg.length, kv_seg.length)
    out, lse, _ = kernel.forward(q, k, v, q_seg, kv_seg, m, scale, True)
    fwd = timed(lambda: kernel.forward(q, k, v, q_seg, kv_seg, m, scale, True))
    bwd = timed(lambda: kernel.backward(q, k, v, out, lse, dout, q_seg, kv_seg, m, scale, True))
    report(name, mask_mod, q_seg, kv_seg, fwd, bwd)


def probe_reversed(name: str, mask_mod, q_seg: Segment, kv_seg: Segment) -> None:
    """The block as a causal one over reversed rows and keys (j >= i becomes j' <= i')."""
    kernel, m, scale = CudnnKernel(), Mods(None, mods.causal), 128 ** -0.5
    q, k, v, dout = tensors(q_seg.length, kv_seg.length)
    local = Segment(0, 1, q_seg.length)
    flip = lambda *ts: [t.flip(2) for t in ts]  # noqa: E731

    def forward():
        o, lse, _ = kernel.forward(*flip(q, k, v), local, local, m, scale, True)
        return o.flip(2), lse.flip(2)

    out, lse = forward()

    def backward():
        grads = kernel.backward(*flip(q, k, v, out), lse.flip(2), dout.flip(2), local, local, m, scale, True)
        return flip(*grads)

    report(name, mask_mod, q_seg, kv_seg, timed(forward), timed(backward))


def report(name, mask_mod, q_seg, kv_seg, fwd, bwd) -> None:
    pairs = int(evaluate_mask(mask_mod, 1, 1, q_seg.positions("cuda"), kv_seg.positions("cuda")).sum()) / 1e6
    print(f"{name:>34}: {q_seg.length:>5} x {kv_seg.length:>5}, {pairs:7.1f} M pairs | fwd {fwd:6.3f} ms "
          f"({fwd / pairs * 1e3:5.2f} us/M) | bwd {bwd:6.3f} ms ({bwd / pairs * 1e3:5.2f} us/M)", flush=True)


def main() -> None:
    window = mods.sliding_window(4096)
    n = 4096
    probe("causal diagonal 4k", mods.causal, Segment(0, 1, n), Segment(0, 1, n))
    probe("window diagonal 4k", window, Segment(0, 1, n), Segment(0, 1, n))
    probe("window block before (j >= i)", window, Segment(n, 1, n), Segment(0, 1, n))
    probe_reversed("same, reversed causal", window, Segment(n, 1, n), Segment(0, 1, n))
    probe("window over two blocks 4k x 8k", window, Segment(2 * n, 1, n), Segment(n, 1, 2 * n))
    probe("window over two blocks 8k x 16k", window, Segment(4 * n, 1, 2 * n), Segment(2 * n, 1, 4 * n))
    late = lambda b, h, q, kv: (kv >= 5000) & (kv <= q)  # noqa: E731  (a document that began at 5000)
    q_seg, kv_seg = Segment(2 * n, 1, n), Segment(n, 1, 2 * n)
    probe("document begun earlier, one band", late, q_seg, kv_seg)
    probe("same, full keys + causal band", late, q_seg, kv_seg,
          [Run((0, n), (904, n)), Run((0, n), (n, 2 * n), band=(None, 0))])
    probe("causal 16k", mods.causal, Segment(0, 1, 4 * n), Segment(0, 1, 4 * n))
    probe("window 16k", window, Segment(0, 1, 4 * n), Segment(0, 1, 4 * n))


if __name__ == "__main__":
    main()
