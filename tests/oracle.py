"""The single-process truth every test compares with: dense attention over the whole
sequence, straight from the definition, in the inputs' precision (use fp64)."""
from __future__ import annotations

import torch


def attention(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """flex_attention semantics: q [B, Hq, S, D], k/v [B, Hkv, S_kv, D]; rows that see no key give 0."""
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
    if mask_mod is not None:
        allowed = torch.broadcast_to(mask_mod(b, h, qi, ki), s.shape)
        sees_any = allowed.any(-1, keepdim=True)
        s = torch.where(allowed, s, float("-inf"))
        s = torch.where(sees_any, s, 0.0)
        return torch.where(sees_any, torch.softmax(s, -1), 0.0) @ v
    return torch.softmax(s, -1) @ v
