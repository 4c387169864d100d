"""Built-in score_mod / mask_mod functions, written as plain flex_attention-style PyTorch.

Factories return a mod; combine masks with ``and_masks`` / ``or_masks``. All of them read
GLOBAL positions, so the same mod serves one GPU and a ring of them.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, or_masks

__all__ = ["causal", "sliding_window", "prefix_lm", "document_ids", "document", "softcap", "alibi_slopes", "alibi",
           "image_neighbourhood", "and_masks", "or_masks"]


def causal(b, h, q_idx, kv_idx):
    """Each query sees itself and earlier keys."""
    return q_idx >= kv_idx


def sliding_window(window: int):
    """Causal attention to the last ``window`` keys (the query's own included)."""
    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return sliding_window_mask


def prefix_lm(prefix_len: int):
    """Bidirectional over the first ``prefix_len`` tokens, causal after them."""
    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)
    return prefix_lm_mask


def document_ids(lengths: Sequence[int], device=None) -> Tensor:
    """Document id of every token of a packed sequence with documents of ``lengths``."""
    lengths = torch.as_tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def document(doc_ids: Tensor, causal_within: bool = True):
    """Packed documents: a query sees keys of its own document (causally, by default).

    ``doc_ids`` covers the whole global sequence; it is indexed at global positions and never
    travels round the ring.
    """
    def document_mask(b, h, q_idx, kv_idx):
        same = doc_ids[q_idx] == doc_ids[kv_idx]
        return same & (q_idx >= kv_idx) if causal_within else same
    return document_mask


def softcap(cap: float):
    """Gemma-style tanh soft-capping of the scores to (-cap, cap)."""
    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_score


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's geometric per-head slopes (for any number of heads)."""
    closest = 2 ** int(torch.log2(torch.tensor(float(num_heads))).floor())
    base = torch.tensor(2.0 ** (-8.0 / closest))
    slopes = base ** torch.arange(1, closest + 1)
    if closest < num_heads:
        extra = torch.tensor(2.0 ** (-4.0 / closest)) ** torch.arange(1, 2 * (num_heads - closest) + 1, 2)
        slopes = torch.cat([slopes, extra])
    return slopes


def alibi(slopes: Tensor):
    """ALiBi, causal form: ``slopes[h] * (kv_idx - q_idx)`` added to each score, a penalty per
    token a key lies before its query (use it with a causal mask: keys after the query would
    get a bonus)."""
    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi_score


def image_neighbourhood(height: int, width: int, radius: int):
    """Tokens of a row-major ``height`` x ``width`` image see the (2r+1) x (2r+1) square
    of tokens around them (Chebyshev distance <= radius)."""
    def neighbourhood_mask(b, h, q_idx, kv_idx):
        dy = (q_idx // width - kv_idx // width).abs()
        dx = (q_idx % width - kv_idx % width).abs()
        return (dy <= radius) & (dx <= radius)
    return neighbourhood_mask
