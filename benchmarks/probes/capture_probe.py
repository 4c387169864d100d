"""What CUDA-graph capture gives: the copy-engine transport's stream memory operations, a
cuDNN hop's forward and backward, and a ``ring_flex_attention`` fwd+bwd (causal, then packed
documents, 8192 tokens in all), each replayed, compared with eager calls and timed.

    python -m benchmarks.probes.capture_probe                             # one GPU, one rank
    torchrun --nproc_per_node=2 -m benchmarks.probes.capture_probe        # a ring of two ranks (they share
                                                                # GPU 0 where there is only one)
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from benchmarks.common import make_mods

from tools.ranks import init, max_over_ranks
import ringflex
from ringflex import mods
from ringflex.kernels import cudnn
from ringflex.kernels.base import Mods
from ringflex.parallel.driver import Driver
from ringflex.plan.layout import Segment


def max_diffs(got, want) -> str:
    return ", ".join(f"{(a.float() - b.float()).abs().max().item():.1e}" for a, b in zip(got, want))


def stream_memops(dev) -> str:
    """A flag written and awaited on a capturing stream, then replayed."""
    driver, flags = Driver(), torch.zeros(2, dtype=torch.int32, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream().cuda_stream
        driver.write(stream, flags.data_ptr(), 1)
        driver.wait(stream, flags.data_ptr(), 1)
        driver.write(stream, flags.data_ptr() + 4, 7)
    flags.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return f"flags after a replay {flags.tolist()} (want [1, 7])"


def hop(mask_mod, seq_len: int, dev) -> str:
    """One cuDNN hop, forward and backward, captured after two eager calls."""
    kernel, seg, m = cudnn.CudnnKernel(), Segment(0, 1, seq_len), Mods(None, mask_mod)
    q, k, v, dout = (torch.randn(1, 8, seq_len, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))

    def run():
        out, lse, _ = kernel.forward(q, k, v, seg, seg, m, 128 ** -0.5, True)
        return [out, lse, *kernel.backward(q, k, v, out, lse, dout, seg, seg, m, 128 ** -0.5, True)]

    want = run()
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    graph.replay()
    torch.cuda.synchronize()
    return f"max diff out, lse, dq, dk, dv {max_diffs(got, want)}"


def capture_ring_call(mask_mod, seq_len: int, heads: int, dev, group=None, layout=None):
    """A ring call, fwd+bwd, over ``group`` (None: one rank) with ``seq_len`` tokens per
    rank in ``layout``, captured with torch's recipe (leaves made and warm-up calls run on a
    side stream, gradients set to None before capture): (the graph, what it writes [out, dq,
    dk, dv], the eager call, the eager call's values)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, k, v = (torch.randn(1, heads, seq_len, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)

        def run(backward: bool = True):
            q.grad = k.grad = v.grad = None
            out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask_mod, group=group, layout=layout)
            if not backward:
                return [out.detach()]
            out.backward(dout)
            return [out.detach(), q.grad, k.grad, v.grad]

        for _ in range(3):
            want = [t.clone() for t in run()]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask_mod, group=group, layout=layout)
        out.backward(dout)
    return graph, [out, q.grad, k.grad, v.grad], run, want


def ring_call(mask_mod, seq_len: int, dev, group=None) -> str:
    """The captured call against eager calls; 20 calls each way (the slowest rank's times)."""
    world_size = dist.get_world_size(group) if group is not None else 1
    graph, got, run, want = capture_ring_call(mask_mod, seq_len // world_size, 8, dev, group)
    graph.replay()
    torch.cuda.synchronize()
    diffs = max_diffs(got, want)
    times = []
    for fn in (run, graph.replay):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start) / 20)
    if group is not None:
        times = max_over_ranks(times, dev, group)
    return f"max diff out, dq, dk, dv {diffs}; eager {times[0]:.2f} ms, replay {times[1]:.2f} ms"


def main():
    group = None
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        init()
        group = dist.group.WORLD
    dev = torch.device("cuda", torch.cuda.current_device())
    documents = make_mods("documents", 8192, dev, 0, 1024, seed=1)[1]
    world = f"{dist.get_world_size(group)}-rank" if group is not None else "one-rank"
    probes = {f"{world} ring call, causal, 8192 tokens": lambda: ring_call(mods.causal, 8192, dev, group),
              f"{world} ring call, packed documents, 8192 tokens": lambda: ring_call(documents, 8192, dev, group)}
    if group is None:
        probes = {"stream memory operations": lambda: stream_memops(dev),
                  "cuDNN hop, causal, 4096 tokens": lambda: hop(mods.causal, 4096, dev),
                  "cuDNN hop, packed documents, 8192 tokens": lambda: hop(documents, 8192, dev), **probes}
    for name, probe in probes.items():
        try:
            result = probe()
        except Exception as e:  # report and go on: what fails to capture is what this probe is for
            result = f"FAILED {type(e).__name__}: {e}"
        if group is None or dist.get_rank(group) == 0:
            print(f"{name}: {result}", flush=True)
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
