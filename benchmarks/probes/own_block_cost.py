"""A zigzag rank's own block of a window (its two diagonal blocks, one shape, evenly spaced):
host and GPU time per call, forward and backward, as the cuDNN kernel runs it (one plain call
over batch-2 views, ``batches.Strided``), as one ragged batch (where the band is causal, the
form ragged batches take) and as a call per diagonal block; one process on one GPU.

    python3 -m benchmarks.probes.own_block_cost --rows 8192 --windows 4096 512

Calls are issued 20 at a time on a drained GPU, so that the host never waits for the GPU's
queue: host time is the host's alone.
"""
from __future__ import annotations

import argparse
import time

import torch

from ringflex import mods
from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel, batches
from ringflex.mod import captured
from ringflex.plan.blocks import BlockKind, Hop
from ringflex.plan.layout import Segment


def timed(name: str, fn, calls: int = 20, rounds: int = 15) -> None:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - start) / calls * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpu.append(begin.elapsed_time(end) / calls * 1e3)
    host.sort(), gpu.sort()
    print(f"{name:58s} host min {host[0]:7.1f} median {host[rounds // 2]:7.1f} us   GPU median {gpu[rounds // 2]:8.1f} us",
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192, help="the rank's rows (B=1, H=32, D=128, bf16)")
    p.add_argument("--windows", type=int, nargs="+", default=[4096, 512])
    args = p.parse_args()
    device, n, scale = torch.device("cuda"), args.rows, 128 ** -0.5
    half = n // 2
    q, k, v, dout = (torch.randn(1, 32, n, 128, device=device, dtype=torch.bfloat16) for _ in range(4))
    kernel = CudnnKernel()
    # rank 0 of 2 over zigzag: chunks 0 and 3 of the sequence
    hops = [Hop((i * half, (i + 1) * half), (i * half, (i + 1) * half), Segment(start, 1, half),
                Segment(start, 1, half), BlockKind.PARTIAL) for i, start in enumerate((0, 3 * half))]
    for window in args.windows:
        m = Mods(None, mods.sliding_window(window))
        print(f"window {window}, {n} rows, chunks of {half}", flush=True)
        with captured.one_walk():
            joined = kernel._joined(hops, m, q, k, v, q, dout)
            print("  the kernel's call:", type(joined).__name__, flush=True)
            out, lse, _ = kernel.forward_hops(q, k, v, hops, m, scale)
            timed("  forward, as the kernel runs it", lambda: kernel.forward_hops(q, k, v, hops, m, scale))
            timed("  backward, as the kernel runs it",
                  lambda: kernel.backward_hops(q, k, v, out, lse, dout, hops, m, scale))
            if joined is not None and joined.band in ((None, 0), None):
                ragged = batches.Batch(joined.runs)
                stats = lse.float().unsqueeze(-1)
                timed("  forward, one ragged batch", lambda: kernel._forward_one(ragged, None, q, k, v, scale, None, None))
                timed("  backward, one ragged batch", lambda: kernel._backward_one(
                    ragged, None, m, q, k, v, out, lse, stats, dout, scale, None, None))

            def per_block(backward):
                for hop in hops:
                    part = [t[:, :, hop.q_rows[0]:hop.q_rows[1]] for t in (q, k, v, out, lse, dout)]
                    if backward:
                        kernel.backward(*part, hop.q_seg, hop.kv_seg, m, scale, True)
                    else:
                        kernel.forward(*part[:3], hop.q_seg, hop.kv_seg, m, scale, True)
            timed("  forward, a call per diagonal block", lambda: per_block(False))
            timed("  backward, a call per diagonal block", lambda: per_block(True))


if __name__ == "__main__":
    main()
