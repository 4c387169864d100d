"""Random ring calls: a layout (a named one, ``shard_by_mask``'s choice for the call's mask, or
chunks dealt to the ranks at random), lengths (cross-attention too), heads (GQA), a mask drawn from
a pool (lookups by position, by distance, constants) and combined with and / or, a score_mod
(lookups by head, by batch element and head, by clamped distance), sinks, an LSE the loss
reads, a scale, and some calls forward only, without grad mode. The matrix in ``cases.py``
names the mods users write; these mix them as nobody listed, which is how the per-batch
inputs cuDNN read wrong were found (docs/cudnn.md). Shared by the CPU test
(``test_random_calls.py``) and the GPU script (``tools/fuzz_ring.py``); the same seed gives
the same call on every rank and device."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

import ringflex
from .oracle import attention
from ringflex import mods
from ringflex.plan.layout import Sharding, divisor


@dataclass
class RandomCall:
    layout: Union[str, Sharding]
    q: torch.Tensor  # the full sequence, [B, Hq, S, D]
    k: torch.Tensor
    v: torch.Tensor
    dout: Optional[torch.Tensor]  # the output's upstream gradient; None where the loss reads the LSE alone
    dlse: Optional[torch.Tensor]  # the LSE's upstream gradient where the call returns it, else None
    mask_mod: Optional[Callable]
    score_mod: Optional[Callable]
    sinks: Optional[torch.Tensor]
    scale: Optional[float]
    parts: List[str]  # what the mods are made of
    bshd: bool  # the ranks' q, k, v in [B, S, H, D] memory, as models pass them
    learnable: Optional[torch.Tensor]  # a tensor the score_mod reads that requires grad (a learnable bias)
    grad: bool  # False: forward only, without grad mode (as at evaluation)

    def describe(self) -> str:
        (b, hq, s, d), hkv, s_kv = self.q.shape, self.k.shape[1], self.k.shape[2]
        extras = [name for name, on in (("sinks", self.sinks is not None), ("lse", self.dlse is not None),
                                         ("a loss of the LSE alone", self.dout is None),
                                         ("[B, S, H, D] memory", self.bshd), ("learnable", self.learnable is not None),
                                         ("no grad", not self.grad))
                  if on]
        layout = self.layout if isinstance(self.layout, str) else f"{self.layout.name} {self.layout.ranks}"
        return (f"{layout}, {s} x {s_kv} tokens, B={b}, heads {hq}/{hkv}, D={d}, scale {self.scale}, "
                f"{' + '.join(self.parts) or 'no mods'}{', ' + ', '.join(extras) if extras else ''}")


def random_call(seed: int, world_size: int, device="cpu", dtype=torch.float64, max_chunks: int = 6,
                head_dims=(4, 8), gathers: bool = True, values_of: Optional[torch.dtype] = None) -> RandomCall:
    """The call of ``seed``: local lengths of up to ``max_chunks`` layout chunks per rank, and
    captured tensors (a table, a bias) on ``device`` in ``dtype`` (fp32 at most). ``gathers``:
    mods may index a tensor by q_idx and kv_idx (flex_attention runs those on a GPU).
    ``values_of``: the dtype whose values the tensors hold (default ``dtype``). The fp64 truth
    of a bf16 call takes bf16 values: a sharp softmax turns the rounding of its inputs into
    gradients 20% apart (a dq, 8 tokens with documents), which is no error of the ring's."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout = rnd.choice(ringflex.LAYOUTS)
    chunk = divisor(layout, world_size) // world_size
    s, s_kv = (chunk * world_size * rnd.randint(1, max_chunks) for _ in range(2))
    if rnd.random() < 0.75:
        s_kv = s
    batch, kv_heads = rnd.choice([1, 2]), rnd.choice([1, 2])
    heads, head_dim = kv_heads * rnd.choice([1, 2]), rnd.choice(head_dims)
    longest, parts, learnable = max(s, s_kv), [], []
    table_dtype = dtype if dtype == torch.float64 else torch.float32
    values_of = values_of or dtype
    table_values = values_of if values_of == torch.float64 else torch.float32

    def table(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(table_values).to(device, table_dtype)

    def mask(depth: int = 0):
        kinds = ["causal", "window", "prefix", "documents", "late", "sparse", "band", "everything"] + [
            "table", "distances"] * gathers
        if depth == 0:
            kinds += ["head", "batch", "padding", "keys_kept", "nothing", "combined", "combined"]
        kind = rnd.choice(kinds)
        parts.append(kind)
        if kind == "causal":
            return mods.causal
        if kind == "window":
            return mods.sliding_window(rnd.randint(1, longest))
        if kind == "prefix":
            return mods.prefix_lm(rnd.randint(0, longest))
        if kind == "documents":
            lengths, left = [], longest
            while left:
                lengths.append(min(left, rnd.randint(1, max(1, longest // 2))))
                left -= lengths[-1]
            return mods.document(mods.document_ids(lengths, device=device), causal_within=rnd.random() < 0.5)
        if kind == "late":  # the first queries see nothing
            start = rnd.randint(0, s)
            return lambda b, h, q, kv: (q >= start) & (kv <= q)
        if kind == "sparse":  # every m-th query sees nothing
            m = rnd.randint(2, 5)
            return lambda b, h, q, kv: (q % m != 0) & (kv <= q)
        if kind == "band":
            left, right = rnd.randint(-3, longest), rnd.randint(-3, longest)
            return lambda b, h, q, kv: (kv >= q - left) & (kv <= q + right)
        if kind == "head":
            width = rnd.randint(1, 5)
            return lambda b, h, q, kv: (kv <= q) & ((h % 2 == 0) | (q - kv < width))
        if kind == "batch":
            return lambda b, h, q, kv: (b == 0) | (kv <= q)
        if kind == "padding":
            seen = torch.tensor([rnd.randint(1, s_kv) for _ in range(batch)], device=device)
            return lambda b, h, q, kv: kv < seen[b]
        if kind == "keys_kept":  # a key padding mask per batch element, as [B, S_kv] attention masks give
            kept = (torch.rand(batch, s_kv, generator=gen) < 0.8).to(device)
            return lambda b, h, q, kv: kept[b, kv]
        if kind == "table":
            allowed = (torch.rand(s, s_kv, generator=gen) < rnd.choice([0.1, 0.5, 0.9])).to(device)
            return lambda b, h, q, kv: allowed[q, kv]
        if kind == "distances":  # a table of every distance q - kv
            near = (torch.rand(s + s_kv - 1, generator=gen) < rnd.choice([0.1, 0.5, 0.9])).to(device)
            return lambda b, h, q, kv: near[q - kv + s_kv - 1]
        if kind == "everything":  # a constant that broadcasts, as flex_attention's noop_mask
            return lambda b, h, q, kv: b.new_ones((), dtype=torch.bool)
        if kind == "nothing":
            return lambda b, h, q, kv: kv < 0
        first, second = mask(1), mask(1)
        return (mods.and_masks if rnd.random() < 0.5 else mods.or_masks)(first, second)

    def score():
        kinds = [None, None, "softcap", "alibi", "relative", "per_head", "per_batch", "head_query", "batch_head",
                 "huge"] + ["table", "clamped_relative"] * gathers
        kind = rnd.choice(kinds)
        if kind is None:
            return None
        parts.append(kind)
        if kind == "softcap":
            return mods.softcap(rnd.uniform(0.5, 5))
        if kind == "alibi":
            return mods.alibi(mods.alibi_slopes(heads).to(device))
        if kind == "relative":
            bias = table(s + s_kv + 1)
            if rnd.random() < 0.5:
                learnable.append(bias.requires_grad_())
            return lambda sc, b, h, q, kv: sc + bias[q - kv + s_kv]
        if kind == "per_head":
            return lambda sc, b, h, q, kv: sc * (h + 1) * 0.5
        if kind == "per_batch":
            return lambda sc, b, h, q, kv: sc + b * 0.5
        if kind == "huge":  # an additive -1e30 / finfo.min mask (Hugging Face's): rows may see no other key
            big, m, pad = rnd.choice([1e30, -torch.finfo(torch.float32).min]), rnd.randint(2, 4), rnd.randint(0, s_kv)
            if rnd.random() < 0.5:  # every m-th query ordinary
                return lambda sc, b, h, q, kv: torch.where(q % m == 0, sc, sc - big)
            return lambda sc, b, h, q, kv: sc - big * (kv < pad)  # left padding
        if kind == "head_query":  # a bias per head and query
            per_query = table(heads, s)
            return lambda sc, b, h, q, kv: sc + per_query[h, q]
        if kind == "batch_head":  # a bias per batch element and head, in one subscript
            per_batch_head = table(batch * heads)
            return lambda sc, b, h, q, kv: sc + per_batch_head[b * heads + h]
        if kind == "clamped_relative":  # a bias per head and distance, as far as ``reach``
            reach = rnd.randint(1, longest)
            per_distance = table(heads, 2 * reach + 1)
            return lambda sc, b, h, q, kv: sc + per_distance[h, (q - kv).clamp(-reach, reach) + reach]
        scores = table(s, s_kv)
        return lambda sc, b, h, q, kv: sc + scores[q, kv]

    mask_mod = mask() if rnd.random() < 0.85 else None
    score_mod = score()
    sinks = table(heads) if rnd.random() < 0.2 else None
    return_lse, scale, bshd = rnd.random() < 0.3, rnd.choice([None, 0.3]), rnd.random() < 0.25
    lse_only = return_lse and rnd.random() < 0.25
    grad = rnd.random() < 0.85

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(values_of).to(device, dtype)

    q = randn(batch, heads, s, head_dim)
    k, v = randn(batch, kv_heads, s_kv, head_dim), randn(batch, kv_heads, s_kv, head_dim)
    dout, dlse = randn(batch, heads, s, head_dim), randn(batch, heads, s)
    if s == s_kv and rnd.random() < 0.3:  # a Sharding: the mask's own, or chunks dealt at random
        layout = (ringflex.shard_by_mask(mask_mod, s, world_size, batch=batch, heads=heads) if rnd.random() < 0.5
                  else _dealt(rnd, s, world_size))
    return RandomCall(layout, q, k, v, None if lse_only else dout, dlse if return_lse else None, mask_mod, score_mod,
                      sinks, scale, parts, bshd, learnable[0] if learnable else None, grad)


def local_mask_call(seed: int, world_size: int, device="cpu", dtype=torch.float64,
                    values_of: Optional[torch.dtype] = None) -> RandomCall:
    """A local mask over zigzag, whose ranks read rows of both neighbours (on 3 ranks and more
    a step brings both at once): a window no wider than a chunk, or packed documents of up to a
    chunk each (causal within them or not, with a window or not); grouped heads, a softcap,
    sinks and a loss of the LSE at random. ``device``, ``dtype`` and ``values_of`` as
    ``random_call``'s."""
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    chunk = rnd.choice([32, 64, 96, 128])
    seq_len = 2 * chunk * world_size
    kind = rnd.choice(["window", "documents", "bidirectional documents", "documents in a window"])
    window = rnd.randint(2, chunk)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(min(rnd.randint(1, chunk), seq_len - sum(lengths)))
    ids = mods.document_ids(lengths, device=device)
    mask_mod = {"window": mods.sliding_window(window),
                "documents": mods.document(ids),
                "bidirectional documents": mods.document(ids, causal_within=False),
                "documents in a window": mods.and_masks(mods.document(ids), mods.sliding_window(window))}[kind]
    score_mod = mods.softcap(20.0) if rnd.random() < 0.25 else None
    kv_heads = rnd.choice([1, 2, 4])
    values_of = values_of or dtype

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(values_of).to(device, dtype)

    q, k, v = randn(1, 4, seq_len, 64), randn(1, kv_heads, seq_len, 64), randn(1, kv_heads, seq_len, 64)
    return_lse = rnd.random() < 0.3
    return RandomCall("zigzag", q, k, v, randn(1, 4, seq_len, 64), randn(1, 4, seq_len) if return_lse else None,
                      mask_mod, score_mod, randn(4) if rnd.random() < 0.2 else None, None,
                      [kind] + ["softcap"] * (score_mod is not None), False, None, True)


def _dealt(rnd: random.Random, seq_len: int, world_size: int) -> Sharding:
    """Chunks of a random size dealt to the ranks at random, equally many each, each rank's in a
    random local order."""
    local = seq_len // world_size
    size = rnd.choice([c for c in range(1, local + 1) if local % c == 0])
    chunks = rnd.sample(range(seq_len // size), seq_len // size)
    per_rank = local // size
    return Sharding.from_ranges(seq_len, [[(c * size, (c + 1) * size) for c in chunks[r * per_rank:(r + 1) * per_rank]]
                                          for r in range(world_size)], name="dealt")


def ring_errors(call: RandomCall, truth: RandomCall, backend: str = "reference", group=None,
                floor: float = 1.0) -> Dict[str, float]:
    """This rank's largest error of the ring's output, LSE and gradients (the sinks' summed over
    the ranks, a learnable bias's too) against the definition on ``truth`` (the same call in
    fp64, on the CPU, made apart: gradients accumulate in its tensors), each relative to the
    largest value of the truth (at least ``floor``; those summed over rows at least 1); inf
    where the ring's infinite entries (an LSE of a row that sees nothing) differ from the
    truth's."""
    full = [t.detach().requires_grad_() for t in (truth.q, truth.k, truth.v)]
    full_sinks = truth.sinks.detach().requires_grad_() if truth.sinks is not None else None
    want_out, want_lse = attention(*full, truth.score_mod, truth.mask_mod, scale=truth.scale, return_lse=True,
                                   sinks=full_sinks)
    _loss(want_out, want_lse, truth.dout, truth.dlse).backward()

    def shard(t):
        return ringflex.shard(t, 2, group=group, layout=call.layout)

    local = [shard(t).detach() for t in (call.q, call.k, call.v)]
    if call.bshd:
        local = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in local]
    local = [t.requires_grad_() for t in local]
    sinks = call.sinks.detach().requires_grad_() if call.sinks is not None else None
    with torch.set_grad_enabled(call.grad):
        got = ringflex.ring_flex_attention(*local, score_mod=call.score_mod, mask_mod=call.mask_mod, group=group,
                                           layout=call.layout, scale=call.scale, enable_gqa=True, backend=backend,
                                           return_lse=call.dlse is not None, sinks=sinks)
    out, lse = got if call.dlse is not None else (got, None)
    pairs = {"out": (out, want_out), "lse": (lse, want_lse)}
    if call.grad:
        _loss(out, lse, *(shard(t) if t is not None else None for t in (call.dout, call.dlse))).backward()
        pairs.update({name: (_grad(got), _grad(want)) for name, got, want in
                      zip(("dq", "dk", "dv"), local, full)})  # a loss of the LSE alone: dv None
    pairs = {name: (got, shard(want.to(got.device))) for name, (got, want) in pairs.items() if got is not None}
    # Each rank holds its queries' share of the gradients of the sinks and of a learnable bias.
    for name, got, want in (("dsinks", sinks, full_sinks), ("dlearnable", call.learnable, truth.learnable)):
        if got is not None and call.grad:
            total = torch.zeros_like(got, dtype=torch.float64) if got.grad is None else got.grad.detach().double()
            total = total.cpu() if "gloo" in str(dist.get_backend(group)) else total
            dist.all_reduce(total, group=group)
            pairs[name] = (total, want.grad)
    # The gradients of the sinks and of a bias sum a term per row, which cancel: their rounding
    # follows the terms, so they are weighed against 1 at least.
    return {name: _error(got, want, max(floor, 1.0) if name in ("dsinks", "dlearnable") else floor)
            for name, (got, want) in pairs.items()}


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _loss(out, lse, dout, dlse):
    """The loss whose gradients are compared: ``dout`` against the output (None: the loss reads
    the LSE alone), ``dlse`` against the LSE where it is finite (a row that sees nothing has
    -inf, and no gradient)."""
    loss = (out * dout.to(out.dtype)).sum() if dout is not None else 0
    if dlse is not None:
        loss = loss + (torch.where(lse.isneginf(), 0.0, lse) * dlse.to(lse.dtype)).sum()
    return loss


def _error(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    finite = want.isfinite()
    if not torch.equal(got.isfinite(), finite) or not torch.equal(got[~finite], want[~finite]):
        return math.inf
    if not finite.any():
        return 0.0
    return ((got - want)[finite].abs().max() / want[finite].abs().max().clamp_min(floor)).item()
