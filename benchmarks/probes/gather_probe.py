"""Is one cuDNN call over the keys of several ring steps faster than a call per step? (one GPU)

The slowest rank of a causal zigzag ring over 4 GPUs at 8k tokens per GPU runs three hops of
all its 8k query rows against half a block each. Joined, they would be one call against 12k
keys, with one merge instead of three. Times both (forward, then backward) with the merges.

    python3 -m benchmarks.probes.gather_probe
"""
from __future__ import annotations

import argparse

import torch

from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.kernels.merge import RowMerge, RowSum


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--keys", type=int, default=4096, help="key rows of each step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    torch.manual_seed(0)
    dev, kernel, mods, scale = torch.device("cuda"), CudnnKernel(), Mods(), 128 ** -0.5
    shape = lambda n: (1, 32, n, 128)  # noqa: E731
    q = torch.randn(shape(args.rows), device=dev, dtype=torch.bfloat16)
    ks = [torch.randn(shape(args.keys), device=dev, dtype=torch.bfloat16) for _ in range(2 * args.steps)]
    kv = list(zip(ks[::2], ks[1::2]))
    joined = torch.cat([k for k, _ in kv], 2), torch.cat([v for _, v in kv], 2)
    dout = torch.randn_like(q)
    rows = (0, args.rows)

    def run(blocks):
        merged = RowMerge(q.shape, q.dtype, torch.float32, dev, [rows] * len(blocks))
        for k, v in blocks:
            merged.add(rows, *kernel.forward(q, k, v, None, None, mods, scale, False))
        out, lse, res = merged.result()
        dq = RowSum([q.shape], q.dtype, torch.float32, dev, [rows] * len(blocks))
        for k, v in blocks:
            hq, hk, hv = kernel.backward(q, k, v, out, lse, dout, None, None, mods, scale, False, res=res)[:3]
            dq.add(rows, hq)
        return dq.result()

    for name, blocks in (("a call per step", kv), ("one joined call", [joined])) * 2:
        for _ in range(3):
            run(blocks)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            run(blocks)
        end.record()
        torch.cuda.synchronize()
        print(f"{name:16s} {args.steps} x {args.keys} keys, {args.rows} rows: "
              f"{start.elapsed_time(end) / args.iters:.3f} ms fwd+bwd", flush=True)


if __name__ == "__main__":
    main()
