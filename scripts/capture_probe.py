"""What CUDA-graph capture accepts today, on one GPU (capture is not supported by ringflex):
the copy-engine transport's stream memory operations, a cuDNN hop's forward and backward, and
a one-rank ``ring_flex_attention`` fwd+bwd (causal, then packed documents), each replayed and
compared with eager calls.

    python scripts/capture_probe.py
"""
from __future__ import annotations

import time

import torch

import ringflex
from bench import make_mods  # scripts/ is on sys.path
from ringflex import mods
from ringflex.kernels import cudnn
from ringflex.kernels.base import Mods
from ringflex.parallel import peer
from ringflex.plan import Segment


def max_diffs(got, want) -> str:
    return ", ".join(f"{(a.float() - b.float()).abs().max().item():.1e}" for a, b in zip(got, want))


def stream_memops(dev) -> str:
    """A flag written and awaited on a capturing stream, then replayed."""
    driver, flags = peer._Driver(), torch.zeros(2, dtype=torch.int32, device=dev)
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
        out, lse = kernel.forward(q, k, v, seg, seg, m, 128 ** -0.5, True)
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


def capture_ring_call(mask_mod, seq_len: int, heads: int, dev):
    """A one-rank ring call, fwd+bwd, captured with torch's recipe (leaves made and warm-up
    calls run on a side stream, gradients set to None before capture): (the graph, what it
    writes [out, dq, dk, dv], the eager call, the eager call's values)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, k, v = (torch.randn(1, heads, seq_len, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)

        def run():
            q.grad = k.grad = v.grad = None
            out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask_mod)
            out.backward(dout)
            return [out.detach(), q.grad, k.grad, v.grad]

        for _ in range(3):
            want = [t.clone() for t in run()]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask_mod)
        out.backward(dout)
    return graph, [out, q.grad, k.grad, v.grad], run, want


def ring_call(mask_mod, seq_len: int, dev) -> str:
    """The captured one-rank call against eager calls; 20 calls each way."""
    graph, got, run, want = capture_ring_call(mask_mod, seq_len, 8, dev)
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
    return f"max diff out, dq, dk, dv {diffs}; eager {times[0]:.2f} ms, replay {times[1]:.2f} ms"


def main():
    dev = torch.device("cuda", torch.cuda.current_device())
    documents = make_mods("documents", 8192, dev, 0, 1024, seed=1)[1]
    probes = {"stream memory operations": lambda: stream_memops(dev),
              "cuDNN hop, causal, 4096 tokens": lambda: hop(mods.causal, 4096, dev),
              "cuDNN hop, packed documents, 8192 tokens": lambda: hop(documents, 8192, dev),
              "one-rank ring call, causal, 8192 tokens": lambda: ring_call(mods.causal, 8192, dev),
              "one-rank ring call, packed documents, 8192 tokens": lambda: ring_call(documents, 8192, dev)}
    for name, probe in probes.items():
        try:
            print(f"{name}: {probe()}", flush=True)
        except Exception as e:  # report and go on: what fails to capture is what this probe is for
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
