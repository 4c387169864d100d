"""The reference hop kernel: plain PyTorch, fp32 (fp64 for fp64 inputs), CPU or GPU.

Every other kernel is tested against it. Mods are called on broadcastable index tensors,
exactly as written by the user, so it supports any mod that flex_attention supports.
Memory stays bounded by processing query rows in chunks.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..plan.blocks import index_grid
from ..plan.layout import Segment
from .base import Mods, OneCallPerHop, split_lse

# Score elements per chunk of query rows (a few such temporaries live at once).
_CHUNK_ELEMENTS = 1 << 22


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for inputs of ``dtype``: fp64 stays fp64, the rest is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_chunks(q: Tensor, kv_len: int):
    rows = max(1, _CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * kv_len))
    for begin in range(0, q.shape[2], rows):
        yield begin, min(q.shape[2], begin + rows)


def _expand_heads(x: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    return x.to(dtype).repeat_interleave(groups, dim=1) if groups > 1 else x.to(dtype)


def _reduce_heads(x: Tensor, groups: int) -> Tensor:
    return x.unflatten(1, (-1, groups)).sum(2) if groups > 1 else x


def modified_scores(q: Tensor, k: Tensor, q_seg: Segment, kv_seg: Segment, mods: Mods, scale: float, masked: bool) -> Tensor:
    """Scaled scores after score_mod, with -inf where mask_mod hides a key (if ``masked``)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mods.score_mod is None and not (masked and mods.mask_mod is not None):
        return s
    b, h, qi, ki = index_grid(q.shape[0], q.shape[1], q_seg.positions(q.device), kv_seg.positions(q.device))
    if mods.score_mod is not None:
        s = torch.broadcast_to(mods.score_mod(s, b, h, qi, ki), s.shape).to(s.dtype)
    if masked and mods.mask_mod is not None:
        allowed = torch.as_tensor(mods.mask_mod(b, h, qi, ki), device=s.device)
        s = torch.where(allowed.bool(), s, float("-inf"))
    return s


class ReferenceKernel(OneCallPerHop):
    name = "reference"

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return compute_dtype(dtype)

    def plans_within(self, mask_mod, has_score_mod: bool, q_seg: Segment, kv_seg: Segment, device) -> None:
        return None  # it computes every pair of the block it is given

    def call_pairs(self, batch: int, heads: int, head_dim: int) -> int:
        return 0  # not measured: lending weighs pairs alone

    def forward(self, q, k, v, q_seg: Segment, kv_seg: Segment, mods: Mods, scale: float,
                masked: bool) -> Tuple[Tensor, Tensor, Tensor]:
        dtype = compute_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        qf, kf, vf = q.to(dtype), _expand_heads(k, groups, dtype), _expand_heads(v, groups, dtype)
        out = q.new_empty(*q.shape[:3], v.shape[-1], dtype=dtype)
        lse, res = (q.new_empty(q.shape[:3], dtype=dtype) for _ in range(2))
        for begin, end in _row_chunks(q, k.shape[2]):
            s = modified_scores(qf[:, :, begin:end], kf, q_seg and q_seg.slice(begin, end), kv_seg, mods, scale, masked)
            # The row's max and log-sum apart: where scores are huge (-1e30 added to every key),
            # m + log(l) rounds log(l) away, and exp(s - lse) would sum to l, not 1.
            top = s.amax(-1, keepdim=True)
            seen = top > float("-inf")
            top = torch.where(seen, top, 0.0)  # a row that sees no key: weights exactly 0
            log_sum = torch.log(torch.exp(s - top).sum(-1, keepdim=True))
            out[:, :, begin:end] = torch.matmul(torch.exp(s - top - torch.where(seen, log_sum, 0.0)), vf)
            lse[:, :, begin:end], res[:, :, begin:end] = split_lse(top.squeeze(-1), log_sum.squeeze(-1))
        return out, lse, res

    def backward(self, q, k, v, out, lse, dout, q_seg: Segment, kv_seg: Segment, mods: Mods, scale: float, masked: bool,
                 tensors=(), res=None):
        dtype = compute_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        qf, kf, vf = q.to(dtype), _expand_heads(k, groups, dtype), _expand_heads(v, groups, dtype)
        dof = dout.to(dtype)
        delta = (dof * out.to(dtype)).sum(-1)
        # Rows with no visible key anywhere (global lse -inf) get probability exp(-inf) = 0.
        lse = torch.where(lse.isneginf(), float("inf"), lse.to(dtype))
        res = torch.zeros_like(lse) if res is None else res.to(dtype)
        dq = torch.zeros_like(qf)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        d_tensors = [torch.zeros_like(t, dtype=dtype) for t in tensors]
        for begin, end in _row_chunks(q, k.shape[2]):
            with torch.enable_grad():
                qc = qf[:, :, begin:end].detach().requires_grad_()
                kc = kf.detach().requires_grad_()
                s = modified_scores(qc, kc, q_seg and q_seg.slice(begin, end), kv_seg, mods, scale, masked)
            # s - lse first: exact where both are huge, and then res normalises the row
            p = torch.exp(s.detach() - lse[:, :, begin:end].unsqueeze(-1) - res[:, :, begin:end].unsqueeze(-1))
            do_c = dof[:, :, begin:end]
            dv += torch.matmul(p.transpose(-1, -2), do_c)
            ds = p * (torch.matmul(do_c, vf.transpose(-1, -2)) - delta[:, :, begin:end].unsqueeze(-1))
            if not s.requires_grad:  # constant: the score_mod ignores the score and reads no learnable tensor
                continue
            # Unused inputs get zeros: the score_mod may read no score, or the mask hide every read.
            gq, gk, *g_tensors = torch.autograd.grad(s, (qc, kc, *tensors), ds, allow_unused=True,
                                                     materialize_grads=True)
            dq[:, :, begin:end] = gq
            dk += gk
            for total, g in zip(d_tensors, g_tensors):
                total += g
        return (dq, _reduce_heads(dk, groups), _reduce_heads(dv, groups), *d_tensors)
