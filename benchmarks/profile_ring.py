"""Where a ring call's time goes: host time, GPU time, and the GPU time by kernel family.

    torchrun --nproc_per_node=2 -m benchmarks.profile_ring --seq-lens 16384 --masks none causal \
        --trace out/ring_causal.json.gz

For every total sequence length and mask it prints, for forward and forward+backward:
the host time of one call (returning from Python, GPU work still queued), its wall time
with the GPU drained, and the mean time of calls issued back to back (the benchmark's
measure); the host time of the argument checks and the agreement alone; and, from torch.profiler,
the GPU time per call spent in attention kernels, NCCL transfers and everything else
(LSE merges, casts, zero-fills); and for every rank the time its GPU is idle and the longest
idle gaps with the kernels around them. Compute time close to the back-to-back time means the
ring is bound by its kernels; a large gap means idle GPU (host- or link-bound). A sustained load
holds the GPUs at their power limit, well below their top clock, while the profiler's start-up
pause lets them speed up again: ``--hot N`` runs N calls inside the profiler before the profiled
ones, so that these run at the clock the timed calls run at.
With ``--host-profile N`` it also prints a rank's (``--host-profile-rank``) Python functions that take the most host
time over N fwd+bwd calls (cProfile), for host-bound workloads. ``--timelines`` reads the traces of
every rank that ``--trace`` wrote and prints them side by side (``rank_timelines``), without a GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import pstats
import json
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from benchmarks.common import make_mods, timed

from tools.ranks import init
import ringflex
from ringflex import checks
from ringflex.parallel import agreement
from ringflex.parallel.groups import gather_objects


def _family(name: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered:
        return "nccl"
    if any(s in lowered for s in ("sdpa", "fmha", "flash", "cudnn", "attn", "attention")):
        return "attention"
    if lowered.startswith("memcpy"):
        return "copy engines"  # beside the kernels, on no SM (the copy-engine transport's transfers)
    return "other"


def host_profile(fn, calls: int, top: int = 30) -> str:
    """cProfile of ``calls`` calls of ``fn``: the functions with the most host time of their own,
    then those with the most host time under them. Each call is issued on a drained GPU after a
    barrier, outside the profile: calls back to back fill the GPU's queues (all the more where
    ranks share a GPU), and a launch waiting there would show as that launch's own time."""
    profiler = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        dist.barrier()
        profiler.enable()
        fn()
        profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(2 * top)  # which of ringflex's steps the time is spent under
    return out.getvalue()


def gpu_time_by_family(prof, calls: int) -> dict:
    """Milliseconds of GPU time per call, by family, and the five largest 'other' kernels (with
    how many of each run per call)."""
    totals, others = {"attention": 0.0, "nccl": 0.0, "copy engines": 0.0, "other": 0.0}, {}
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        family = _family(event.key)
        totals[family] += us / 1e3 / calls
        if family == "other":
            others[event.key[:70]] = (us / 1e3 / calls, event.count / calls)
    top = sorted(others.items(), key=lambda kv: -kv[1][0])[:5]
    return {**{k: round(v, 3) for k, v in totals.items()},
            "top_other": {k: f"{ms:.3f} ms in {count:g} calls" for k, (ms, count) in top}}


def _idle_gaps(trace: dict) -> list:
    """(microseconds, the kernel before, the kernel after) of every stretch in which this GPU's
    SMs compute nothing: no kernel or memset on any stream but NCCL's, whose kernels spin while
    they wait (copies run on copy engines, beside the SMs), between the first start and the last end."""
    spans = sorted((e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and
                    e.get("cat") in ("kernel", "gpu_memset") and "nccl" not in e["name"].lower()),
                   key=lambda e: (e["ts"], e["ts"] + e["dur"], e["name"]))
    gaps, end, before = [], None, None
    for e in spans:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is not None and start > end:
            gaps.append((start - end, before, e))
        if end is None or stop > end:
            end, before = stop, e
    return gaps


def gpu_idle(trace: dict, calls: int, top: int = 3) -> dict:
    """From a chrome trace: milliseconds per call in which this GPU's SMs compute nothing
    (``_idle_gaps``), and the ``top`` longest such gaps with the work before and after them:
    where a ring waits for a transfer or for its host."""
    gaps = [(g, before["name"], after["name"]) for g, before, after in _idle_gaps(trace)]
    longest = sorted(gaps, reverse=True)[:top]
    return {"idle_ms": round(sum(g for g, _, _ in gaps) / 1e3 / calls, 3),
            "longest": [(round(g / 1e3, 3), a[:40], b[:40]) for g, a, b in longest]}


def host_behind_gaps(trace: dict, top: int = 3, functions: int = 12) -> list:
    """For the ``top`` longest gaps in which the SMs compute nothing: the host's Python
    functions (with ``--with-stack``), by their own time, between the launch of the kernel
    before the gap and the launch of the kernel after it: what the host did while the GPU
    waited for it (a gap the host launched ahead of is a wait for a transfer instead)."""
    events = [e for e in trace.get("traceEvents", ()) if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    launched = [(gap, before.get("args", {}).get("correlation"), after.get("args", {}).get("correlation"))
                for gap, before, after in _idle_gaps(trace)]
    gaps = [(gap, launches[b], launches[a]) for gap, b, a in launched if b in launches and a in launches]
    python = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "python_function")
    found = []
    for gap, lo, hi in sorted(gaps, reverse=True)[:top]:
        own, stack = {}, []  # each function's time less its callees', within [lo, hi]
        for start, stop, name in python:
            if stop <= lo or start >= hi:
                continue
            start, stop = max(start, lo), min(stop, hi)
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack:
                own[stack[-1][2]] = own.get(stack[-1][2], 0.0) - (stop - start)
            own[name] = own.get(name, 0.0) + (stop - start)
            stack.append((start, stop, name))
        hottest = sorted(own.items(), key=lambda kv: -kv[1])[:functions]
        found.append({"gap_ms": round(gap / 1e3, 3), "host_ms_between_launches": round((hi - lo) / 1e3, 3),
                      "host": [(name[:90], round(us / 1e3, 3)) for name, us in hottest]})
    return found


_PASSES = (("dot_do_o", "D"), ("convert_dq", "C"), ("lse_merge", "M"), ("sum_parts", "S"), ("sum_pairs", "S"))


def _short(name: str) -> str:
    """A kernel's letter in ``rank_timelines``: a pass of ``_PASSES``, else A for ``_family``'s
    attention (cuDNN's own passes are named after it too, so they are looked for first), else E."""
    lowered = name.lower()
    return next((short for key, short in _PASSES if key in lowered), "A" if _family(name) == "attention" else "E")


def rank_timelines(traces: list) -> str:
    """Several ranks' traces (``--trace 'DIR/tr_{}.json.gz'``, one per rank) side by side on one
    clock, which the ranks of one host share: for each rank the kernels of its busiest stream in
    order, as ``name:start(duration)``, ms from the first kernel of any rank, named short (A
    attention, D and C cuDNN's dO.O and dQ-cast passes of a backward call, M LSE merges, S the
    ring's sums, E any other kernel), then its ms per family. Which rank waits for which shows
    as the gaps before each rank's kernels."""
    kernels = [[e for e in trace.get("traceEvents", ()) if e.get("ph") == "X" and e.get("cat") == "kernel"]
               for trace in traces]
    start = min(e["ts"] for rank in kernels for e in rank)
    lines = []
    for rank, events in enumerate(kernels):
        streams = {}
        for e in events:
            streams.setdefault(e.get("args", {}).get("stream"), []).append(e)
        busiest = sorted(max(streams.values(), key=lambda es: sum(e["dur"] for e in es)), key=lambda e: e["ts"])
        named = [(_short(e["name"]), e) for e in busiest]
        totals = {}
        for short, e in named:
            totals[short] = totals.get(short, 0.0) + e["dur"] / 1e3
        lines.append(f"rank {rank}: " + " ".join(f"{short}:{(e['ts'] - start) / 1e3:.3f}({e['dur'] / 1e3:.3f})"
                                                 for short, e in named))
        lines.append(f"rank {rank} ms: " + ", ".join(f"{short} {ms:.3f}" for short, ms in sorted(totals.items())))
    return "\n".join(lines)


def measure(fn, iters: int) -> dict:
    """Host ms per call, wall ms per call with the GPU drained, and back-to-back ms per call."""
    fn()
    torch.cuda.synchronize()
    host = wall = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host, wall = host + t1 - t0, wall + time.perf_counter() - t0
    back_to_back = timed(fn, iters, 0, torch.device("cuda"))
    return {"host_ms": round(host / iters * 1e3, 3), "wall_ms": round(wall / iters * 1e3, 3),
            "back_to_back_ms": round(back_to_back * 1e3, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384])
    p.add_argument("--masks", nargs="+", default=["none", "causal"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="print a rank's hottest Python functions over N fwd+bwd calls")
    p.add_argument("--host-profile-rank", type=int, default=0, help="the rank whose --host-profile is printed")
    p.add_argument("--profiled-calls", type=int, default=3, help="fwd+bwd calls under the profiler")
    p.add_argument("--hot", type=int, default=0, metavar="N",
                   help="N fwd+bwd calls under the profiler, not recorded, before the profiled ones: the GPUs "
                        "reach the clock of a sustained load (their power limit) first")
    p.add_argument("--gpu-only", action="store_true",
                   help="record GPU activity only: the host runs at its own pace, not the profiler's (no CPU ops "
                        "in the trace)")
    p.add_argument("--with-stack", action="store_true",
                   help="record Python functions too, and print what the host ran behind the longest idle gaps")
    p.add_argument("--trace", help="write a chrome trace (gzip) of rank 0's first workload here, or, if the "
                                   "name has a {} (filled with tokens_mask_rank), of every workload and rank")
    p.add_argument("--timelines", nargs="+", metavar="TRACE",
                   help="print these ranks' traces side by side (rank_timelines) and exit: runs nothing")
    args = p.parse_args()
    if args.timelines:
        print(rank_timelines([json.load(gzip.open(path) if path.endswith(".gz") else open(path))
                              for path in args.timelines]))
        return
    device = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    trace = args.trace
    for seq_len in args.seq_lens:
        for mask in args.masks:
            score_mod, mask_mod = make_mods(mask, seq_len, device, 4096, 4096)
            torch.manual_seed(0)
            shape = (1, args.heads, seq_len, args.head_dim)
            q, k, v = (ringflex.shard(torch.randn(shape, device=device, dtype=torch.bfloat16), 2, layout=args.layout)
                       .requires_grad_() for _ in range(3))
            grad = torch.randn_like(q)

            def attn():
                return ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                    layout=args.layout)

            def forward():
                with torch.no_grad():
                    attn()

            def forward_backward():
                attn().backward(grad)

            def check():  # the argument checks and the agreement alone, without planning
                error = checks.local_error(q, k, v, score_mod, mask_mod, args.layout, None, False, "auto",
                                           dist.group.WORLD)
                call = dict(q=q, k=k, v=v, layout=args.layout, backend="auto", kernel="auto", enable_gqa=False,
                            sinks=None, scale=None, score_mod=score_mod, mask_mod=mask_mod, grad=True, debug=False,
                            return_lse=False)
                agreement.start(dist.group.WORLD, call, [], error).wait()

            for _ in range(3):
                forward_backward()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                check()
            check_ms = (time.perf_counter() - t0) / args.iters * 1e3
            row = {"fwd": measure(forward, args.iters), "fwd_bwd": measure(forward_backward, args.iters)}
            calls = args.profiled_calls
            activities = [ProfilerActivity.CUDA] if args.gpu_only else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            # --hot: calls inside the profiler, not recorded, that keep the GPUs at the clock of
            # a sustained load (its own start-up pause would let them speed up again)
            hot = schedule(wait=args.hot, warmup=1, active=calls) if args.hot else None
            with profile(activities=activities, with_stack=args.with_stack, schedule=hot) as prof:
                for i in range(args.hot + 1 if args.hot else 0):
                    forward_backward()
                    if i == args.hot:  # none of these calls' kernels still runs in the recorded ones,
                        torch.cuda.synchronize()  # and every rank starts them together
                        dist.barrier()
                        torch.cuda.synchronize()
                    prof.step()
                for _ in range(calls):
                    forward_backward()
                torch.cuda.synchronize()
                if args.hot:
                    prof.step()  # ends the recorded cycle
            gpu_ms = gpu_time_by_family(prof, calls)
            with tempfile.TemporaryDirectory() as tmp:
                plain = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(plain)  # a profile exports once
                with open(plain) as f:
                    chrome = json.load(f)
                idle = gpu_idle(chrome, calls)
                if args.with_stack:
                    idle["host_behind_gaps"] = host_behind_gaps(chrome)
                del chrome
                if trace and (rank == 0 or "{}" in trace):
                    path = trace.format(f"{seq_len}_{mask}_{rank}")
                    with open(plain, "rb") as f, (gzip.open if path.endswith(".gz") else open)(path, "wb") as g:
                        shutil.copyfileobj(f, g)
            log(f"== {seq_len} tokens ({seq_len // world}/GPU), mask {mask}: argument check {check_ms:.3f} ms host")
            for name, value in row.items():
                log(f"   {name}: {value}")
            for r, (ms, value) in enumerate(gather_objects(None, (gpu_ms, idle))):  # every rank: the slowest sets the pace
                log(f"   rank {r} GPU ms per fwd_bwd: {ms}")
                log(f"   rank {r} GPU computing nothing, per fwd_bwd: {value}")
            if args.host_profile:
                profiled = host_profile(forward_backward, args.host_profile)
                if rank == args.host_profile_rank:
                    print(f"rank {rank}, {seq_len} tokens, mask {mask}:\n{profiled}", flush=True)
            if trace and "{}" not in trace:
                for key in ("self_cpu_time_total", "self_device_time_total"):
                    log(prof.key_averages().table(sort_by=key, row_limit=25))
                trace = None
            del q, k, v, grad
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
