"""Host time of one launch of the fused merge's Triton kernels: launched directly
(``kernels.launch``) and through Triton's JIT, the parts of a direct launch (its arguments,
its key, the compiled kernel's launcher), and torch's own ops beside them (one GPU).

    python3 -m benchmarks.probes.launch_cost
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch

from ringflex.kernels import fused_merge


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def main():
    import triton
    print("triton", triton.__version__, "torch", torch.__version__)
    dev = torch.device("cuda")
    shape = (1, 32, 1024, 128)
    a, b, d = (torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(3))
    lse = [torch.randn(shape[:3], device=dev) for _ in range(3)]
    view = torch.randn((1, 32, 2048, 128), device=dev, dtype=torch.bfloat16)[:, :, :1024]
    adder = fused_merge._kernels()[1]
    grid, args, constants = fused_merge._add_arguments((a, b, a, a, d), 2)
    fused_merge.add(d, [a, b])
    compiled = adder.compiled[adder._key(args, tuple(constants.values()))]
    stream = torch.cuda.current_stream().cuda_stream
    rows = {
        "fused add, one part (a copy)": lambda: fused_merge.add(d, [a]),
        "fused add, two parts": lambda: fused_merge.add(d, [a, b]),
        "  its arguments alone": lambda: fused_merge._add_arguments((a, b, a, a, d), 2),
        "  its launch, arguments ready": lambda: adder.launch(grid, args, constants),
        "  its key alone": lambda: adder._key(args, tuple(constants.values())),
        "  the compiled kernel's launcher alone": lambda: compiled.run(
            grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *args, *constants.values()),
        "  through Triton's JIT, arguments ready": lambda: adder.kernel[grid](*args, **constants, num_warps=4),
        "fused merge, two parts": lambda: fused_merge.merge(d, [(a, lse[0], None), (b, lse[1], None)], lse[2]),
        "torch copy_ of rows (a view)": lambda: d.copy_(view),
        "torch add, out=": lambda: torch.add(a, b, out=d),
    }
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_us(fn):7.1f} us host per call")
    profiler = cProfile.Profile()  # where a direct launch's host time goes, Triton's launcher included
    profiler.enable()
    per_call_us(rows["fused add, two parts"], 500)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
