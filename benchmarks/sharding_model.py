"""The ring's cost model (``ringflex.plan.cost.estimate``) for the fixed layouts and the sharding
``shard_by_mask`` chooses, and the host time of choosing. CPU only, no process group:

    python benchmarks/sharding_model.py                      # 8k tokens a rank, 2 and 4 ranks
    python benchmarks/sharding_model.py --per-rank 16384 --world-sizes 2 4 8
    python benchmarks/sharding_model.py --device cuda      # document ids on the GPU, as in training

Masks: causal, a sliding window of 4096, packed documents of 512 to 6144 tokens (seeded),
prefix-LM with a prefix of a quarter of the sequence. Each row: the critical path in pairs
(per head), balance, ring steps, non-empty hops, kernel calls, the most rows one transfer carries,
the model's cost, and that cost as milliseconds at ``--ms-per-mpair`` (H100, cuDNN, fwd+bwd,
B=1 H=32 D=128: 0.109 ms per million pairs, kernels/cudnn/kernel.py). Host time: CPU time of
``shard_by_mask`` on one thread (wall time with ``--device cuda``, which waits for the GPU), the
least of ``--repeats``, its mask counted anew each time; and per new packed batch (``--batches`` random batches of documents of 512 to 6144 tokens,
each with its own ids and mask, as a training loop meets them), the median.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ringflex import mods
from ringflex.plan import workload as workloads
from ringflex.plan.sharding import cheapest, compare, shard_by_mask


def documents(seq_len: int, low: int, high: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Document ids of documents of ``low`` to ``high`` tokens filling ``seq_len`` (the last cut)."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(rng.randint(low, high))
    lengths[-1] -= sum(lengths) - seq_len
    return mods.document_ids([n for n in lengths if n > 0], device=device)


def _clock(device: str):
    """Host time on one thread where the work is the CPU's; wall time where it waits for a GPU."""
    return time.thread_time if device == "cpu" else time.perf_counter


def masks(seq_len: int, window: int, seed: int, device="cpu"):
    ids = documents(seq_len, 512, 6144, seed, device)
    return {"causal": (mods.causal, None), f"window {window}": (mods.sliding_window(window), None),
            "documents 512-6144": (mods.document(ids), ids), "prefix-LM (S/4)": (mods.prefix_lm(seq_len // 4), None)}


def host_ms(mask_mod, seq_len, world_size, ids, repeats: int, device="cpu") -> float:
    spent, clock = [], _clock(device)
    for _ in range(repeats):
        workloads._WORKLOADS.cache.clear()
        begin = clock()
        shard_by_mask(mask_mod, seq_len, world_size, document_ids=ids)
        spent.append(clock() - begin)
    return 1e3 * min(spent)


def packed_batch_ms(seq_len: int, world_size: int, batches: int, seed: int, device="cpu") -> float:
    """Median ms of ``shard_by_mask`` for a new packed batch: new document ids and a new mask
    each time (the first batch, which traces the mask's code, left out)."""
    spent, clock = [], _clock(device)
    for batch in range(batches + 1):
        ids = documents(seq_len, 512, 6144, seed + 1000 + batch, device)
        begin = clock()
        shard_by_mask(mods.document(ids), seq_len, world_size, document_ids=ids)
        spent.append(clock() - begin)
    return 1e3 * statistics.median(spent[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-rank", type=int, default=8192)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=5, help="new packed batches timed per world size")
    p.add_argument("--ms-per-mpair", type=float, default=0.109)
    p.add_argument("--device", default="cpu", help="where the document ids live (cuda: as a GPU training loop has them)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| ranks | mask | sharding | critical (M pairs) | balance | steps | hops | calls | travel rows | cost (M) | ~ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    hosts = []
    for world_size in args.world_sizes:
        seq_len = args.per_rank * world_size
        for name, (mask_mod, ids) in masks(seq_len, args.window, args.seed, args.device).items():
            found = compare(mask_mod, seq_len, world_size, document_ids=ids)
            best = cheapest(found)[0]
            for s, e in found:
                label = f"**{s.name}** (chosen)" if s is best else s.name
                print(f"| {world_size} | {name} | {label} | {e['critical_pairs'] / 1e6:.2f} | {e['balance']:.2f} | "
                      f"{e['steps']} | {e['hops']} | {e['calls']} | {e['travel_rows']} | {e['cost'] / 1e6:.2f} | "
                      f"{e['cost'] / 1e6 * args.ms_per_mpair:.1f} |")
            hosts.append((world_size, name, host_ms(mask_mod, seq_len, world_size, ids, args.repeats, args.device)))
    print(f"\nhost time of shard_by_mask (ids on {args.device}):")
    for world_size, name, ms in hosts:
        print(f"  {world_size} ranks, {args.per_rank * world_size} tokens, {name}: {ms:.1f} ms")
    print(f"\nhost time of shard_by_mask per new packed batch (documents of 512 to 6144 tokens, median of {args.batches}):")
    for world_size in args.world_sizes:
        ms = packed_batch_ms(args.per_rank * world_size, world_size, args.batches, args.seed, args.device)
        print(f"  {world_size} ranks, {args.per_rank * world_size} tokens: {ms:.1f} ms per batch")


if __name__ == "__main__":
    main()
