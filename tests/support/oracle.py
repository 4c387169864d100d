"""The single-process truth every test compares with: dense attention over the whole
sequence, straight from the definition, in the inputs' precision (use fp64)."""
from __future__ import annotations

import torch


def attention(q, k, v, score_mod=None, mask_mod=None, scale=None, return_lse=False, sinks=None):
    """flex_attention semantics: q [B, Hq, S, D], k/v [B, Hkv, S_kv, D]; rows that see no key give
    0 (and LSE -inf, with no gradient). ``sinks`` [Hq]: a logit per head in every softmax's
    denominator, with no value (gpt-oss)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    qi = torch.arange(q.shape[2]).view(1, 1, -1, 1)
    ki = torch.arange(k.shape[2]).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    sees_any = torch.ones_like(s[..., :1], dtype=torch.bool)
    if mask_mod is not None:
        allowed = torch.broadcast_to(mask_mod(b, h, qi, ki), s.shape)
        sees_any = allowed.any(-1, keepdim=True)
        s = torch.where(allowed, s, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
        sees_any = torch.ones_like(sees_any)  # the sink
    s = torch.where(sees_any, s, 0.0)
    out = torch.where(sees_any, torch.softmax(s, -1), 0.0)[..., :k.shape[2]] @ v
    if not return_lse:
        return out
    # Not torch.logsumexp: its backward, exp(s - lse), sums to l rather than 1 where every
    # score is -1e30 (lse = -1e30 + log(l) rounds log(l) away in float64 too); softmax's does not.
    top = s.amax(-1, keepdim=True).detach()
    lse = (top + torch.log(torch.exp(s - top).sum(-1, keepdim=True)))[..., 0]
    return out, torch.where(sees_any[..., 0], lse, float("-inf"))


def visible_extent(mask_mod, q_seg, kv_seg, batch: int = 1, heads: int = 1, device=None):
    """The local rows and keys of a (q_seg, kv_seg) block where the mask holds for some pair,
    batch and head: ((first row, last row + 1), (first key, last key + 1))."""
    from ringflex.plan.blocks import evaluate_mask
    allowed = evaluate_mask(mask_mod, batch, heads, q_seg.positions(device), kv_seg.positions(device)).flatten(0, 1).any(0)
    rows, keys = allowed.any(1).nonzero().flatten(), allowed.any(0).nonzero().flatten()
    return (int(rows[0]), int(rows[-1]) + 1), (int(keys[0]), int(keys[-1]) + 1)
