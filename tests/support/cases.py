"""The test matrix of masks and score modifications, shared by the CPU and GPU tests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ringflex import mods
from ringflex.plan.layout import Sharding


@dataclass
class Case:
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    q_heads: int = 4
    kv_heads: int = 4
    kv_len_ratio: float = 1.0  # global K/V length = ratio * global Q length


def _document_lengths(total: int):
    """Uneven documents, some crossing shard boundaries, one a single token."""
    lengths, left, pattern = [], total, [5, 1, 9, 3, 14, 2, 7]
    i = 0
    while left > 0:
        lengths.append(min(left, pattern[i % len(pattern)]))
        left -= lengths[-1]
        i += 1
    return lengths


def cases(seq_len: int, image_width: int = 4, device=None):
    """Name -> Case for a global query length ``seq_len`` (captured tensors on ``device``)."""
    doc_ids = mods.document_ids(_document_lengths(seq_len), device=device)
    slopes = mods.alibi_slopes(4).to(device)
    text_per_image, image_len = seq_len // 4, seq_len // 8  # cross-attention: S_kv = S_q / 2

    def late_queries(b, h, q_idx, kv_idx):  # the first half of the queries sees nothing
        return (q_idx >= seq_len // 2) & (kv_idx <= q_idx)

    def sparse_rows(b, h, q_idx, kv_idx):  # every 5th query sees nothing, the others causal
        return (q_idx % 5 != 0) & (kv_idx <= q_idx)

    def flamingo(b, h, q_idx, kv_idx):  # text tokens see the tokens of their own image
        return kv_idx // image_len == q_idx // text_per_image

    capped, biased = mods.softcap(2.0), mods.alibi(slopes)

    def softcap_alibi(score, b, h, q_idx, kv_idx):
        return biased(capped(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    chunk = max(2, seq_len // 5)  # chunks that straddle the ranks' shards

    def chunked(b, h, q_idx, kv_idx):  # Llama 4's chunked attention: causal within chunks of tokens
        return (q_idx // chunk == kv_idx // chunk) & (kv_idx <= q_idx)

    def head_dependent(b, h, q_idx, kv_idx):  # even heads causal, odd heads a window of 3
        return (kv_idx <= q_idx) & ((h % 2 == 0) | (q_idx - kv_idx < 3))

    return {
        "no_mask": Case(),
        "causal": Case(mask_mod=mods.causal),
        "sliding_window": Case(mask_mod=mods.sliding_window(5)),
        "wide_window": Case(mask_mod=mods.sliding_window(max(2, seq_len // 6))),  # lends rows over contiguous
        "prefix_lm": Case(mask_mod=mods.prefix_lm(seq_len // 3)),
        "documents": Case(mask_mod=mods.document(doc_ids)),
        "chunked": Case(mask_mod=chunked),
        "alibi": Case(score_mod=mods.alibi(slopes), mask_mod=mods.causal),
        "softcap": Case(score_mod=mods.softcap(2.0)),
        "causal_softcap": Case(score_mod=mods.softcap(2.0), mask_mod=mods.causal),
        "image_2d": Case(mask_mod=mods.image_neighbourhood(seq_len // image_width, image_width, 1)),
        "head_dependent": Case(mask_mod=head_dependent),
        "combined_masks": Case(mask_mod=mods.and_masks(
            mods.causal, mods.or_masks(mods.sliding_window(5), mods.prefix_lm(seq_len // 3)))),
        "gqa_causal": Case(mask_mod=mods.causal, q_heads=4, kv_heads=2),
        "gqa_softcap_alibi": Case(score_mod=softcap_alibi, q_heads=4, kv_heads=1),
        "cross_no_mask": Case(kv_len_ratio=0.5),
        "cross_flamingo": Case(mask_mod=flamingo, kv_len_ratio=0.5),
        "late_queries": Case(mask_mod=late_queries),
        "sparse_rows": Case(mask_mod=sparse_rows),
    }


def make_inputs(case: Case, seq_len: int, batch: int = 2, head_dim: int = 16, dtype=torch.float32, seed: int = 0):
    """Full-sequence q, k, v and an upstream gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    kv_len = int(seq_len * case.kv_len_ratio)
    q = torch.randn(batch, case.q_heads, seq_len, head_dim, generator=g)
    k = torch.randn(batch, case.kv_heads, kv_len, head_dim, generator=g)
    v = torch.randn(batch, case.kv_heads, kv_len, head_dim, generator=g)
    dout = torch.randn(batch, case.q_heads, seq_len, head_dim, generator=g)
    return [t.to(dtype) for t in (q, k, v, dout)]


def random_sharding(seq_len: int, world_size: int, seed: int) -> Sharding:
    """Every rank holds seq_len / world_size positions from anywhere, in any local order."""
    order = torch.randperm(seq_len, generator=torch.Generator().manual_seed(seed)).tolist()
    local = seq_len // world_size
    return Sharding.from_ranges(seq_len, [[(p, p + 1) for p in order[r * local:(r + 1) * local]]
                                          for r in range(world_size)], f"random {seed}")
