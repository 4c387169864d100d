"""Backward's joins (``plan.joins``) on and off in one process, in turn for many rounds, beside
the single-GPU kernel on the whole sequence: the GPUs' drift in clock falls on all alike.

    torchrun --nproc_per_node=4 -m benchmarks.probes.join_ab --seq-len 32768 --masks causal none

Prints per mask the median fwd+bwd ms (the slowest rank's) of each variant and the ring's
efficiency against torch's cuDNN SDPA on one GPU (every rank runs it on its own GPU at once).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringflex
from benchmarks.common import make_mods, timed
from ringflex.plan import joins
from tools.ranks import init


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--masks", nargs="+", default=["causal", "none"])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    device = init()
    world = dist.get_world_size()
    control = dist.new_group(backend="gloo")
    most_kept = joins.MOST_KEPT_BYTES
    for mask in args.masks:
        score_mod, mask_mod = make_mods(mask, args.seq_len, device, 4096, 4096)
        shape = (1, 32, args.seq_len, 128)
        full = [torch.randn(shape, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        local = [ringflex.shard(t.detach(), 2, layout="zigzag").requires_grad_() for t in full]
        grad, full_grad = torch.randn_like(local[0]), torch.randn_like(full[0])

        def single():
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(*full, is_causal=mask == "causal").backward(full_grad)

        def ring(kept_bytes):
            def call():
                joins.MOST_KEPT_BYTES = kept_bytes
                ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod,
                                             layout="zigzag").backward(grad)
            return call

        variants = {"single GPU": single, "ring, no joins": ring(0), "ring, joins": ring(most_kept)}
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(timed(fn, args.iters, 1, device, control))
        joins.MOST_KEPT_BYTES = most_kept
        per_rank = {}
        for name, t in times.items():
            gathered = [None] * world
            dist.all_gather_object(gathered, statistics.median(t) * 1e3, group=control)
            per_rank[name] = gathered
        medians = {name: max(ms) for name, ms in per_rank.items()}
        if dist.get_rank() == 0:
            single_ms = medians["single GPU"]
            for name, ms in medians.items():
                eff = "" if name == "single GPU" else f"  efficiency {single_ms / (world * ms):.3f}"
                spread = sorted(times[name])
                print(f"{mask:7s} {world} GPUs {name:15s} median {ms:8.2f} ms  (rank 0 rounds "
                      f"{1e3 * spread[0]:.2f}-{1e3 * spread[-1]:.2f}; per rank "
                      f"{' '.join(f'{r:.2f}' for r in per_rank[name])}){eff}", flush=True)
        for name in ("ring, no joins", "ring, joins"):
            lines = _gpu_breakdown(variants[name])
            gathered = [None] * world
            dist.all_gather_object(gathered, lines, group=control)
            if dist.get_rank() == 0:
                for rank, text in enumerate(gathered):
                    print(f"{mask} {name}, rank {rank}: {text}", flush=True)
    dist.destroy_process_group()


def _gpu_breakdown(fn, calls: int = 3) -> str:
    """GPU ms per call by kernel family, and the largest other kernels (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    families, others = {}, []
    for e in prof.key_averages():
        ms = e.self_device_time_total / calls / 1e3
        if ms <= 0:
            continue
        key = e.key.lower()
        family = ("attention" if any(s in key for s in ("sdpa", "fmha", "flash")) else
                  "copy engines" if key.startswith("memcpy") else "other")
        families[family] = families.get(family, 0.0) + ms
        if family != "attention" and ms > 0.02:
            others.append((ms, e.key[:50], e.count // calls))
    top = ", ".join(f"{k} x{n} {ms:.2f}" for ms, k, n in sorted(others, reverse=True)[:8])
    return " ".join(f"{f} {ms:.2f}" for f, ms in sorted(families.items())) + f" | {top}"


if __name__ == "__main__":
    main()
