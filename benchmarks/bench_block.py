"""A transformer block's forward and backward over the ring, per sharding: what a training
step sees of each sharding where a ring call alone is bound by the host.

    torchrun --nproc_per_node=4 -m benchmarks.bench_block --seq-lens 32768 --masks window documents causal \
        --layouts zigzag contiguous by-mask --json out/block.json

The block is a pre-norm layer as language models have it: attention (the q, k, v and output
projections around ``ring_flex_attention`` over the rank's shard of the sequence) and an MLP
``--mlp-ratio`` times wider, ``--dim`` = heads x head dim, in bf16. Its projections and MLP do
the same work in every sharding; only the attention's differs, and while the GPU runs them the
host runs ahead, so a call's host time can hide behind them. Each row: the block's fwd+bwd and
the ring call's alone on the same shards (ms, the slowest rank's median over ``--rounds``
rounds that time every layout in turn), each against the fastest layout for its mask.
On CPU (gloo, reference kernel) it runs at toy sizes as a smoke test:

    torchrun --nproc_per_node=2 -m benchmarks.bench_block --device cpu --seq-lens 256 --dim 64 --heads 4
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import MASKS, device_and_dtype, make_mods, report, timed, timers_group

from tools.ranks import launch, max_over_ranks
import ringflex


class Block(nn.Module):
    """Pre-norm attention and MLP; ``attend(q, k, v)`` is the attention over [B, H, S, D]."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim, bias=False), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim, bias=False))

    def project(self, x):
        """q, k, v [B, H, S, D] of ``x`` [B, S, dim]."""
        return self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)

    def forward(self, x, attend):
        x = x + self.proj(attend(*self.project(x)).transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


def layouts_of(args, mask_mod, seq_len: int, world_size: int) -> dict:
    """Row label -> layout: a name, ``shard_by_mask``'s Sharding ("by-mask"), or None ("default":
    none given to ``shard`` or the call)."""
    chosen = {label: None if label == "default" else label for label in args.layouts}
    if "by-mask" in chosen:
        chosen["by-mask"] = ringflex.shard_by_mask(mask_mod, seq_len, world_size, heads=args.heads)
    return chosen


def bench_one(args, seq_len: int, mask: str, block: Block, device, dtype, group) -> list:
    """The rows of one length and mask, one per layout."""
    world_size = dist.get_world_size()
    score_mod, mask_mod = make_mods(mask, seq_len, device, args.window, args.doc_len)
    torch.manual_seed(0)
    x_full = torch.randn(1, seq_len, args.dim, device=device, dtype=dtype)
    timers = {}
    for label, layout in layouts_of(args, mask_mod, seq_len, world_size).items():
        def attend(q, k, v, layout=layout):
            return ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, layout=layout,
                                                backend=args.backend)

        x = ringflex.shard(x_full, 1, layout=layout).requires_grad_()
        grad = torch.randn_like(x)
        q, k, v = (t.detach().contiguous().requires_grad_() for t in block.project(x))
        attention_grad = torch.randn_like(q)
        timers[label] = {"block": lambda x=x, grad=grad, attend=attend: block(x, attend).backward(grad),
                         "call": lambda q=q, k=k, v=v, g=attention_grad, attend=attend: attend(q, k, v).backward(g),
                         "sharding": "zigzag" if layout is None else layout if isinstance(layout, str) else layout.name}
    samples = {(label, part): [] for label in timers for part in ("block", "call")}
    for _ in range(args.rounds):
        for (label, part), times in samples.items():
            times.append(timed(timers[label][part], args.iters, args.warmup, device, group))
    medians = {key: 1e3 * max_over_ranks([statistics.median(times)], device, group)[0]
               for key, times in samples.items()}
    best = {part: min(ms for (_, p), ms in medians.items() if p == part) for part in ("block", "call")}
    return [{"seq_len": seq_len, "mask": mask, "world_size": world_size, "layout": label,
             "sharding": timers[label]["sharding"],
             **{f"{part}_ms": medians[label, part] for part in ("block", "call")},
             **{f"{part}_vs_best": medians[label, part] / best[part] for part in ("block", "call")}}
            for label in timers]


def table(rows) -> str:
    lines = ["| tokens | mask | layout | block fwd+bwd ms | / fastest | ring call fwd+bwd ms | / fastest |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['seq_len']} | {r['mask']} | {r['layout']} ({r['sharding']}) | {r['block_ms']:.2f} | "
              f"{r['block_vs_best']:.2f} | {r['call_ms']:.2f} | {r['call_vs_best']:.2f} |" for r in rows]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768], help="tokens in all, over every rank")
    p.add_argument("--masks", nargs="+", default=["window", "documents", "causal"], choices=MASKS)
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous", "by-mask"],
                   choices=(*ringflex.LAYOUTS, "by-mask", "default"))
    p.add_argument("--dim", type=int, default=4096, help="model width: heads x head dim")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--mlp-ratio", type=int, default=4)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--doc-len", type=int, default=4096, help="mean document length of the documents mask")
    p.add_argument("--backend", default="auto")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def run(args) -> list:
    """Runs the benchmark on an initialised process group; returns the rows."""
    device, dtype = device_and_dtype(args.device)
    group = timers_group(device)
    torch.manual_seed(0)  # the same weights on every rank
    block = Block(args.dim, args.heads, args.mlp_ratio).to(device, dtype)
    rows = []
    for seq_len in args.seq_lens:
        for mask in args.masks:
            rows += bench_one(args, seq_len, mask, block, device, dtype, group)
    report(args, rows, table(rows))
    return rows


def main():
    launch(run, parse_args())


if __name__ == "__main__":
    main()
