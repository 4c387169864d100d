"""What the benchmarks and probes share: the named workloads and the timers.

Joining the ranks is the tools' (``tools.ranks``). The benchmarks and the probes run as modules from the repository root
(``torchrun --nproc_per_node=2 -m benchmarks.bench``, ``python -m benchmarks.probes.band_probe``)
and import it as ``benchmarks.common``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringflex import mods
from ringflex.kernels import cudnn as cudnn_kernel
from ringflex.kernels.base import Mods
from ringflex.plan.layout import Segment

# ----------------------------------------------------------------------------- workloads

MASKS = ("none", "causal", "window", "documents", "prefix_lm", "causal_softcap")


def make_mods(mask: str, seq_len: int, device, window: int, doc_len: int, seed: int = 0):
    """(score_mod, mask_mod) of a named workload over ``seq_len`` global tokens (``seed``: of
    the document lengths)."""
    if mask == "none":
        return None, None
    if mask == "causal":
        return None, mods.causal
    if mask == "window":
        return None, mods.sliding_window(window)
    if mask == "documents":  # documents of random lengths around doc_len
        g = torch.Generator().manual_seed(seed)
        lengths, total = [], 0
        while total < seq_len:
            n = min(seq_len - total, int(torch.randint(doc_len // 2, 3 * doc_len // 2, (), generator=g)))
            lengths.append(n)
            total += n
        return None, mods.document(mods.document_ids(lengths, device=device))
    if mask == "prefix_lm":  # bidirectional over the first quarter of the sequence, causal after it
        return None, mods.prefix_lm(seq_len // 4)
    if mask == "causal_softcap":
        return mods.softcap(30.0), mods.causal
    raise ValueError(f"unknown mask {mask!r}; choose from {MASKS}")


# ----------------------------------------------------------------------------- the record


def report(args: argparse.Namespace, rows: list, text: str, **about) -> None:
    """On the first rank: ``text`` (the rows as a table) printed, and the rows as JSON at
    ``args.json`` where given, with the arguments and ``about`` (the transport, ...)."""
    if dist.get_rank() != 0:
        return
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **about, "rows": rows}, f, indent=1)


# ----------------------------------------------------------------------------- a benchmark's run


def device_and_dtype(device_name: str):
    """(this rank's device, the dtype the benchmarks time): bf16 on a GPU, fp32 on a CPU."""
    if device_name == "cuda":
        return torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    return torch.device("cpu"), torch.float32


def timers_group(device: torch.device):
    """A gloo group of every rank, for the timers: their barrier (``timed``) and the slowest
    rank's time (``max_over_ranks``); the world's own where it is gloo (on CPUs)."""
    return dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD


# ----------------------------------------------------------------------------- timing a call


def timed(fn, iters: int, warmup: int, device, group=None) -> float:
    """Mean seconds per call of ``fn`` after ``warmup`` calls. With ``group`` (a gloo group of
    every rank) the ranks start the timed calls together: a rank still finishing earlier work
    would otherwise hold up the other's first ring call, and that wait would count as ring time."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if group is not None:
        dist.barrier(group=group)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def replayed_ms(fn, iters: int = 20) -> float:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph: the GPU's time, not the
    host's (which packed documents' planning or a Triton launch from Python can exceed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def hop_timed(fn, warmup=3, iters=20):
    """(GPU ms per call, host us per call) of ``fn`` run back to back, the way a ring enqueues
    its hops: the host runs ahead, so its overhead is hidden unless it exceeds the kernel time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = time.perf_counter() - host
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, 1e6 * host / iters


def interleaved(calls: dict, rounds: int) -> dict:
    """name -> (median GPU ms, median host us) of each call, measured in ``rounds`` rounds that
    take every call in turn, so clock and temperature drift falls on all of them alike."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(hop_timed(fn))
    return {name: tuple(statistics.median(t[i] for t in ts) for i in range(2)) for name, ts in times.items()}


def kernel_times(fn, calls: int = 5) -> dict:
    """Kernel name -> GPU us per call of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key[:90]: round(e.self_device_time_total / calls, 1)
            for e in prof.key_averages() if e.self_device_time_total > 0}


# ----------------------------------------------------------------------------- one hop, one GPU


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The attention shape a per-hop benchmark times: B=1 H=32 D=128 S=8192 by default."""
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)


def ringflex_calls(q, k, v, dout, score_mod, mask_mod, depth):
    """(forward, backward, seconds of the first forward + backward) of ringflex's cuDNN hop:
    the whole sequence as one hop (segments start at 0)."""
    kernel = cudnn_kernel.CudnnKernel(split_depth=depth)
    seg = Segment(0, 1, q.shape[2])
    m = Mods(score_mod, mask_mod)
    masked = mask_mod is not None
    segs = (seg, seg) if (masked or score_mod is not None) else (None, None)
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    out, lse, _ = kernel.forward(q, k, v, *segs, m, scale, masked)
    kernel.backward(q, k, v, out, lse, dout, *segs, m, scale, masked)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    return (lambda: kernel.forward(q, k, v, *segs, m, scale, masked),
            lambda: kernel.backward(q, k, v, out, lse, dout, *segs, m, scale, masked), first)


def autograd_calls(run, inputs, dout):
    """(forward, backward) of an autograd function ``run`` of ``inputs``: the backward alone,
    ``torch.autograd.grad`` of one forward's output with ``retain_graph``."""
    out = run()
    return run, lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def sdpa_calls(q, k, v, dout, causal):
    """(forward, backward) of torch's cuDNN SDPA, no mask or causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=gqa)

    return autograd_calls(run, inputs, dout)
