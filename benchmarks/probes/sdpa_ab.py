"""ringflex's cuDNN hop against torch's cuDNN SDPA, no mask and causal: are they the same
kernels, and how far apart are their times?

    python -m benchmarks.probes.sdpa_ab --rounds 15

Times forward and backward of both in ``--rounds`` interleaved rounds of 20 calls (medians,
as ``benchmarks/bench_hop.py``), then lists the GPU kernels each call launches with their time per
call (torch.profiler), so that a gap can be told apart from GPU clock drift.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import add_shape_arguments, interleaved, kernel_times, ringflex_calls, sdpa_calls
from ringflex import mods


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(args.batch, args.heads, args.seq, args.dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    for name, mask_mod in (("no_mask", None), ("causal", mods.causal)):
        rf_fwd, rf_bwd, _ = ringflex_calls(q, k, v, dout, None, mask_mod, 0)
        sdpa_fwd, sdpa_bwd = sdpa_calls(q, k, v, dout, mask_mod is not None)
        calls = {"ringflex fwd": rf_fwd, "torch fwd": sdpa_fwd, "ringflex bwd": rf_bwd, "torch bwd": sdpa_bwd}
        times = {n: t[0] for n, t in interleaved(calls, args.rounds).items()}
        print(f"{name}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()))
        for phase in ("fwd", "bwd"):
            print(f"  {phase}: ringflex / torch = {times[f'ringflex {phase}'] / times[f'torch {phase}']:.3f}")
        for n, fn in calls.items():
            print(f"  {n} kernels (us per call): {kernel_times(fn)}")


if __name__ == "__main__":
    main()
