"""Two questions about a backward hop's passes outside cuDNN's attention kernel (one GPU).

1. One cuDNN call over the keys of several ring steps against a call per step, forward and
   backward apart, with the merges and sums the ring adds per call.
2. cuDNN's backward writing dQ in fp32 against bf16 (its own dQ pass converts an fp32
   accumulator; the ring sums a hop's dQ in fp32 afterwards anyway).

Every variant runs a few calls in turn with the others, for many rounds, so the GPU's drift in
clock falls on all of them alike; each reports its median round.

    python3 -m benchmarks.probes.join_probe
"""
from __future__ import annotations

import argparse
import statistics

import torch

from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel, graphs
from ringflex.kernels.merge import RowMerge, RowSum


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["8192x4096x3", "4096x8192x3"], help="rows x keys x steps")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    dev, kernel, mods, scale = torch.device("cuda"), CudnnKernel(), Mods(), 128 ** -0.5
    shape = lambda n: (1, 32, n, 128)  # noqa: E731
    variants = {}
    for spec in args.shapes:
        n_rows, n_keys, steps = map(int, spec.split("x"))
        q = torch.randn(shape(n_rows), device=dev, dtype=torch.bfloat16)
        kv = [(torch.randn(shape(n_keys), device=dev, dtype=torch.bfloat16),
               torch.randn(shape(n_keys), device=dev, dtype=torch.bfloat16)) for _ in range(steps)]
        joined = [tuple(torch.cat(t, 2) for t in zip(*kv))]
        dout = torch.randn_like(q)
        rows = (0, n_rows)
        out, lse, res = kernel.forward(q, *joined[0], None, None, mods, scale, False)

        def fwd(blocks, q=q, rows=rows):
            merged = RowMerge(q.shape, q.dtype, torch.float32, dev, [rows] * len(blocks))
            for k, v in blocks:
                merged.add(rows, *kernel.forward(q, k, v, None, None, mods, scale, False))
            return merged.result()

        def bwd(blocks, q=q, rows=rows, out=out, lse=lse, dout=dout):
            dq = RowSum([q.shape], q.dtype, torch.float32, dev, [rows] * len(blocks))
            for k, v in blocks:
                dq.add(rows, kernel.backward(q, k, v, out, lse, dout, None, None, mods, scale, False)[0])
            return dq.result()

        for name, blocks in (("per step", kv), ("joined", joined)):
            variants[f"{spec} fwd {name}"] = lambda f=fwd, b=blocks: f(b)
            variants[f"{spec} bwd {name}"] = lambda f=bwd, b=blocks: f(b)
        k, v = kv[0]
        stats = lse.float().unsqueeze(-1).contiguous()
        for dtype in (torch.bfloat16, torch.float32):
            tensors = dict(q=q, k=k, v=v, out=out, dout=dout, lse=stats, dq=torch.empty(q.shape, dtype=dtype, device=dev),
                           dk=torch.empty_like(k), dv=torch.empty_like(v))
            try:
                g = graphs.graph(True, tensors, scale, None, None, {"q_idx": False, "kv_idx": False})
            except Exception as e:  # noqa: BLE001 -- the question is whether cuDNN takes it
                print(f"{spec}: cuDNN backward with dQ in {dtype} not built: {type(e).__name__}: {e}", flush=True)
                continue
            variants[f"{spec} one bwd call, dQ {dtype}"] = lambda g=g, t=tensors: g.execute(t, None, None, None)
    for fn in variants.values():
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.calls):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / args.calls)
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"{name:40s} median {statistics.median(ts):7.3f} ms  p10 {ts[len(ts) // 10]:7.3f}  "
              f"p90 {ts[9 * len(ts) // 10]:7.3f}", flush=True)
    from torch.profiler import ProfilerActivity, profile
    for name, fn in variants.items():
        if "one bwd call" not in name:
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [(e.key[:70], round(e.self_device_time_total, 1)) for e in prof.key_averages()
                   if e.self_device_time_total > 0]
        print(f"{name}: {kernels}", flush=True)


if __name__ == "__main__":
    main()
