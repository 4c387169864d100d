"""Train a small GPT-style decoder with context-parallel attention under torchrun.

The model below is ordinary single-device PyTorch (RoPE, causal SDPA, or flex_attention with a
document or sliding-window block mask and a softcap score_mod). Context parallelism is added
around it, not in it: the batch is sharded with its global position ids, the model is wrapped in
``ringflex.RingFlexAttention``, the loss is ``sharded_cross_entropy`` and the gradients are
summed with ``reduce_gradients``. One process runs the plain model: the reference curve.

    python examples/train_example.py --device cpu --dtype float64 --out single.json        # reference
    torchrun --nproc_per_node=4 examples/train_example.py --device cpu --dtype float64 --out ring.json
    python examples/train_example.py --compare single.json ring.json --plot train_loss.png
    torchrun --nproc_per_node=2 examples/train_example.py --device cuda --dtype bfloat16 \\
        --seq-len 65536 --dim 1024 --layers 4 --heads 16 --kv-heads 4 --packed --softcap 30

On CPU, flex_attention has no backward: a one-process run that needs it (--packed, --window or --softcap)
routes it to ringflex on one rank (the reference kernel) and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import ringflex
from ringflex.progress import Progress
from ringflex.training import (destroy_process_group, next_token_labels, reduce_gradients, shard_batch,
                               sharded_cross_entropy)

# What a GPU model calls: torch.compile of flex_attention and create_block_mask (made by train()).
compiled_flex_attention = compiled_create_block_mask = None


# ----------------------------------------------------------------------------- the model (one device)

def rope(x, positions, base=10000.0):
    """Rotary position embedding of x [B, H, S, D] at positions [B, S]."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    angle = (positions.unsqueeze(-1).double() * freq).unsqueeze(1)  # [B, 1, S, half]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, softcap):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.score_mod = None if softcap is None else (
            lambda score, b, h, q_idx, kv_idx: softcap * torch.tanh(score / softcap))

    def forward(self, x, positions, block_mask):
        q, k, v = self.qkv(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = rope(q, positions), rope(k, positions)
        if block_mask is None and self.score_mod is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            attend = compiled_flex_attention if x.is_cuda else flex_attention
            out = attend(q, k, v, score_mod=self.score_mod, block_mask=block_mask, enable_gqa=True)
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, softcap):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, softcap)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x, positions, block_mask):
        x = x + self.attn(self.norm1(x), positions, block_mask)
        return x + self.mlp(self.norm2(x))


def attention_mask(doc_ids=None, window=None):
    """The model's mask_mod: causal, within the last ``window`` tokens, within each row's documents."""
    def mask_mod(b, h, q_idx, kv_idx):
        seen = q_idx >= kv_idx
        if window is not None:
            seen = seen & (q_idx - kv_idx < window)
        return seen if doc_ids is None else seen & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
    return mask_mod


class GPT(nn.Module):
    """A decoder: tokens [B, S], positions [B, S] -> logits [B, S, vocab]. ``doc_ids`` [B, S_total]
    (packed documents) restricts attention to each token's own document, ``window`` to the
    last ``window`` tokens."""

    def __init__(self, vocab, dim, layers, heads, kv_heads, softcap=None, window=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, softcap) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.softcap, self.window = softcap, window

    def forward(self, tokens, positions, doc_ids=None):
        block_mask = None
        if doc_ids is not None or self.softcap is not None or self.window is not None:
            length = tokens.shape[1]
            make_block_mask = compiled_create_block_mask if tokens.is_cuda else create_block_mask
            block_mask = make_block_mask(attention_mask(doc_ids, self.window), tokens.shape[0], None, length, length,
                                         device=tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, block_mask)
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------- data

def make_batch(step, args, group):
    """The full batch of ``step``, the same on every rank: documents whose second half repeats
    the first (attention can learn to copy), packed end to end in rows of ``seq_len`` tokens."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens, doc_ids, positions = [], [], []
    for _ in range(args.batch):
        lengths, left = [], args.seq_len
        while left:
            n = args.seq_len if not args.packed else int(torch.randint(args.min_doc, args.max_doc + 1, (), generator=g))
            lengths.append(min(n, left))
            left -= lengths[-1]
        row = []
        for n in lengths:
            first = torch.randint(0, args.vocab, ((n + 1) // 2,), generator=g)
            row.append(torch.cat([first, first])[:n])
        # its ids and positions (seq_len fits: no padding); the batch's layout is chosen over all rows
        packed = ringflex.PackedSequences(lengths, group=group, layout="contiguous")
        tokens.append(torch.cat(row))
        doc_ids.append(packed.doc_ids)
        positions.append(packed.position_ids())
    tokens, doc_ids = torch.stack(tokens), torch.stack(doc_ids)
    labels = next_token_labels(tokens, doc_ids=doc_ids)
    return {"tokens": tokens, "labels": labels, "positions": torch.stack(positions)}, doc_ids


# ----------------------------------------------------------------------------- training

def _init_ranks(device_type: str) -> None:
    """Joins the ranks under torchrun: a GPU per rank over NCCL, or, where the ranks outnumber
    the GPUs, ranks sharing them over gloo (NCCL refuses ranks that share a GPU)."""
    if device_type != "cuda":
        dist.init_process_group("gloo")
        return
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % gpus)
    dist.init_process_group("gloo" if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > gpus else "nccl")


def _setup(args):
    """(group, rank, world size, device) for torchrun, or a plain single process."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and not dist.is_initialized():
        _init_ranks(args.device)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    return (dist.group.WORLD if world_size > 1 else None), rank, world_size, device


def _peak_memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def batch_layout(args, doc_ids, world_size: int):
    """How a batch is split over the ranks: ``--layout``, else the sharding that
    ``ringflex.shard_by_mask`` chooses for the model's mask over the batch's rows."""
    if args.layout is not None or world_size == 1:
        return args.layout
    mask_mod = attention_mask(doc_ids if args.packed else None, args.window)
    return ringflex.shard_by_mask(mask_mod, args.seq_len, world_size, batch=args.batch)


def train(args) -> dict:
    """Trains for ``args.steps`` steps; returns (and on rank 0 logs) the loss curve and throughput."""
    global compiled_flex_attention, compiled_create_block_mask
    group, rank, world_size, device = _setup(args)
    if device.type == "cuda" and compiled_flex_attention is None:
        compiled_flex_attention, compiled_create_block_mask = map(torch.compile, (flex_attention, create_block_mask))
    dtype = getattr(torch, args.dtype)
    autocast = dtype in (torch.bfloat16, torch.float16)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.softcap, args.window).to(
        device, torch.float32 if autocast else dtype)
    uses_flex = args.packed or args.softcap is not None or args.window is not None
    ring = world_size > 1 or (device.type == "cpu" and uses_flex)
    if ring:
        if world_size == 1:
            print("one process on CPU with flex_attention (no CPU backward): running it as ringflex on one rank",
                  file=sys.stderr)
        layout = args.layout if args.packed else batch_layout(args, None, world_size)  # packed: per batch, below
        model = ringflex.RingFlexAttention(model, group=group, layout=layout, backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    progress = Progress(args.steps, label="step", interval=args.progress_every)
    losses, tokens_per_step = [], args.batch * args.seq_len
    start = None
    for step in range(1, args.steps + 1):
        if step == 2:  # time from the second step: the first one plans, compiles and warms up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        batch, doc_ids = make_batch(step, args, group)
        if world_size > 1:
            if args.packed:  # new documents: a new sharding
                model.layout = batch_layout(args, doc_ids, world_size)
            batch = shard_batch(batch, dim=1, group=group, layout=model.layout)
        batch = {key: value.to(device) for key, value in batch.items()}
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = model(batch["tokens"], batch["positions"], doc_ids.to(device) if args.packed else None)
        loss = sharded_cross_entropy(logits, batch["labels"], group=group)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reduce_gradients(model.parameters(), group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        fields = {"loss": losses[-1]}
        if start is not None:  # no throughput yet at the first step, which is not timed
            fields["tok_s"] = (step - 1) * tokens_per_step / (time.perf_counter() - start)
        progress.update(step, **fields)
    if device.type == "cuda":
        torch.cuda.synchronize()
    # None with one step: the first step plans, compiles and warms up, and is not timed
    tokens_per_s = (args.steps - 1) * tokens_per_step / (time.perf_counter() - start) if start is not None else None
    result = {"args": vars(args), "world_size": world_size, "ring": ring, "losses": losses,
              "tokens_per_s": tokens_per_s, "peak_memory_gib": _peak_memory_gib(device)}
    if rank == 0:
        throughput = f"{tokens_per_s:.0f} tokens/s" if tokens_per_s is not None else "tokens/s from step 2 on"
        print(f"done: {args.steps} steps, world size {world_size}, final loss {losses[-1]:.4f}, "
              f"{throughput}, peak memory {result['peak_memory_gib']:.2f} GiB "
              f"({'allocated by torch' if device.type == 'cuda' else 'process RSS'}, rank 0)", file=sys.stderr)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


# ----------------------------------------------------------------------------- comparing two runs

def relative_differences(a, b):
    return [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)]


def compare(paths, first, tolerance, plot):
    """Prints the worst relative loss difference of the first ``first`` steps; plots the curves."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    reference = runs[0]["losses"]
    ok = True
    for path, run in zip(paths[1:], runs[1:]):
        worst = max(relative_differences(run["losses"][:first], reference[:first]))
        ok &= worst <= tolerance
        print(f"{path} vs {paths[0]}: max relative loss difference over the first {first} steps {worst:.2e} "
              f"({'ok' if worst <= tolerance else 'ABOVE'} tolerance {tolerance:g})")
    if plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed (pip install 'ringflex[plot]'): no plot", file=sys.stderr)
            return ok
        fig, ax = plt.subplots(figsize=(7, 4))
        for path, run, style in zip(paths, runs, ["-", "--", ":", "-."]):
            label = f"{run['world_size']} process{'es' if run['world_size'] > 1 else ''}" + (
                " (ring)" if run["ring"] else " (plain torch)")
            ax.plot(range(1, len(run["losses"]) + 1), run["losses"], style, label=label)
        args = runs[0]["args"]
        ax.set(xlabel="step", ylabel="loss", title=f"GPT, {args['seq_len']} tokens x {args['batch']}, {args['dtype']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        print(f"wrote {plot}")
    return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda: a GPU per rank, NCCL)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"],
                   help="float64/float32: the model's dtype; bfloat16/float16: autocast over fp32 weights")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per sequence (the whole sequence: each rank holds seq-len / ranks)")
    p.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    p.add_argument("--softcap", type=float, default=None, help="tanh softcap of the attention scores")
    p.add_argument("--window", type=int, default=None, help="a causal sliding window of this many tokens")
    p.add_argument("--packed", action="store_true", help="pack documents of random length with a document mask")
    p.add_argument("--min-doc", type=int, default=8, help="with --packed: shortest document")
    p.add_argument("--max-doc", type=int, default=96, help="with --packed: longest document")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (every rank alike)")
    p.add_argument("--layout", default=None, choices=ringflex.LAYOUTS,
                   help="how the sequence is split over the ranks (default: the sharding ringflex.shard_by_mask "
                        "chooses for the model's mask: zigzag for causal attention, contiguous runs for a window; "
                        "with --packed, for each batch's documents)")
    p.add_argument("--backend", default="auto", choices=["auto", "cudnn", "flex", "reference"],
                   help="the kernel of each hop: auto takes cudnn where it can run the call, else flex on a GPU, "
                        "else reference")
    p.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--out", help="write the loss curve and throughput to this JSON file (rank 0)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="compare logged runs (the first is the reference)")
    p.add_argument("--compare-steps", type=int, default=20, help="with --compare: the steps compared")
    p.add_argument("--tolerance", type=float, default=1e-6,
                   help="with --compare: the largest relative loss difference accepted")
    p.add_argument("--plot", help="with --compare: save the overlaid curves here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.dim % args.heads or args.heads % args.kv_heads or (args.dim // args.heads) % 2:
        p.error("--dim must split into --heads of even size, and --heads must be a multiple of --kv-heads")
    if args.packed and not 2 <= args.min_doc <= args.max_doc:
        p.error("--packed needs 2 <= --min-doc <= --max-doc")
    return args


def main():
    args = parse_args()
    if args.compare:
        sys.exit(0 if compare(args.compare, args.compare_steps, args.tolerance, args.plot) else 1)
    train(args)
    if dist.is_initialized():
        destroy_process_group()


if __name__ == "__main__":
    main()
