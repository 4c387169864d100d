"""The hops of a ring call, computed: the kernel's forward of a hop, and its backward with the
LSE's share of the gradient, under the call's mods and scale; a ring step's hops, as one
kernel call where they share no row and no key and the kernel takes them. The ring (``ring``)
and the loans (``loans``) run their hops through here; ``call`` is a ``ring.RingCall``."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..kernels.merge import Rows, optional_rows, rows
from ..kernels.reference import compute_dtype
from ..plan.blocks import Hop, around


def masked(hop: Hop) -> bool:
    """Whether the kernel must apply the mask (a FULL block needs none)."""
    return hop.kind != hop.kind.FULL


def hop_forward(call, hop: Hop, q: Tensor, k: Tensor, v: Tensor):
    """(out, lse, res) of ``hop`` from its query rows ``q`` and key rows ``k``, ``v``."""
    return call.kernel.forward(q, k, v, hop.q_seg, hop.kv_seg, call.mods, call.scale, masked(hop))


def hop_backward(call, hop: Hop, q, k, v, out, lse, res, dout, lse_grad, r: Rows):
    """One hop's (dq, dk, dv, gradients of ``call.tensors``) from its rows ``q``, ``out``, ``lse``,
    ``res`` (the LSE's res, ``kernels.base``, or None) and keys ``k``, ``v``; ``dout`` and ``lse_grad`` (``lse_as_attention``'s, or None) are
    whole and taken at rows ``r``. With ``lse_grad`` a second call over zero values adds the
    LSE's share; ``dout`` None: the loss reads the LSE alone."""
    args = hop.q_seg, hop.kv_seg, call.mods, call.scale, masked(hop), call.tensors
    if dout is not None:
        hq, hk, hv, *ht = call.kernel.backward(q, k, v, out, lse, rows(dout, r), *args, res=res)
    if lse_grad is None:
        return hq, hk, hv, ht
    lse_out, lse_dout = (rows(t, r) for t in lse_grad)
    lq, lk, lv, *lt = call.kernel.backward(q, k, torch.zeros_like(v), lse_out, lse, lse_dout, *args, res=res)
    if dout is None:  # the loss reads the LSE alone, which the values do not change
        return lq, lk, torch.zeros_like(lv), lt
    acc = compute_dtype(q.dtype)  # added in fp32, before any rounding
    return hq.to(acc) + lq, hk.to(acc) + lk, hv, [a + b for a, b in zip(ht, lt)]


def step_forward(call, hops: Sequence[Hop], q: Tensor, keys: Callable) -> List[tuple]:
    """(q rows, out, lse, res) of a ring step's hops; ``keys(r)``: the K and V rows ``r`` of the
    block the step holds. Hops of disjoint rows and keys (a rank's own block over zigzag: its
    two diagonal blocks) go to the kernel as one call where it takes them
    (``HopKernel.forward_hops``): a call fewer for the host; and where they fill their rows
    and keys, one result over all of them, which the ring merges as one part."""
    if _joinable(call, hops):
        q_span, kv_span, local = _local_hops(hops)
        joined = call.kernel.forward_hops(rows(q, q_span), *keys(kv_span), local, call.mods, call.scale)
        if joined is not None:
            if _filled(hops):
                return [(q_span, *joined)]
            return [(hop.q_rows, *(optional_rows(t, r.q_rows) for t in joined)) for hop, r in zip(hops, local)]
    return [(hop.q_rows, *hop_forward(call, hop, rows(q, hop.q_rows), *keys(hop.kv_rows))) for hop in hops]


def step_backward(call, hops: Sequence[Hop], q: Tensor, keys: Callable, out: Tensor, lse: Tensor,
                  res: Optional[Tensor], dout: Optional[Tensor], lse_grad) -> List[tuple]:
    """(q rows, key rows, dq, dk, dv, gradients of ``call.tensors``) of a ring step's hops, as
    ``step_forward`` runs them: one call where the kernel takes them (not with the LSE's
    share, ``lse_grad``), one result where they fill their rows and keys."""
    if _joinable(call, hops) and lse_grad is None and dout is not None:
        q_span, kv_span, local = _local_hops(hops)
        joined = call.kernel.backward_hops(rows(q, q_span), *keys(kv_span), rows(out, q_span), rows(lse, q_span),
                                           rows(dout, q_span), local, call.mods, call.scale, optional_rows(res, q_span))
        if joined is not None:
            if _filled(hops):
                return [(q_span, kv_span, *joined, [])]
            dq, dk, dv = joined
            return [(hop.q_rows, hop.kv_rows, rows(dq, r.q_rows), rows(dk, r.kv_rows), rows(dv, r.kv_rows), [])
                    for hop, r in zip(hops, local)]
    return [(hop.q_rows, hop.kv_rows, *hop_backward(call, hop, rows(q, hop.q_rows), *keys(hop.kv_rows),
                                                    rows(out, hop.q_rows), rows(lse, hop.q_rows),
                                                    optional_rows(res, hop.q_rows), dout, lse_grad, hop.q_rows))
            for hop in hops]


def _joinable(call, hops: Sequence[Hop]) -> bool:
    """Whether ``hops`` may run as one call: several, none sharing a query row or a key."""
    return len(hops) > 1 and not call.tensors and _side_by_side(hops, lambda end, start: end <= start)


def _filled(hops: Sequence[Hop]) -> bool:
    """Whether disjoint ``hops`` leave no row and no key between them: their joined result is
    then theirs over every row and key it has."""
    return _side_by_side(hops, lambda end, start: end == start)


def _side_by_side(hops: Sequence[Hop], follows: Callable[[int, int], bool]) -> bool:
    """Whether, in order, each hop's query rows and key rows ``follows`` the previous hop's."""
    return all(all(follows(a[1], b[0]) for a, b in zip(spans, spans[1:]))
               for spans in (sorted(h.q_rows for h in hops), sorted(h.kv_rows for h in hops)))


def _local_hops(hops: Sequence[Hop]):
    """The rows and keys around ``hops``, and the hops with rows local to those."""
    q_span, kv_span = around(h.q_rows for h in hops), around(h.kv_rows for h in hops)
    return q_span, kv_span, [replace(h, q_rows=(h.q_rows[0] - q_span[0], h.q_rows[1] - q_span[0]),
                                     kv_rows=(h.kv_rows[0] - kv_span[0], h.kv_rows[1] - kv_span[0])) for h in hops]


def lse_as_attention(dlse: Tensor, out: Tensor, lse: Tensor):
    """(out, dout) under which a hop's backward over ZERO values gives the LSE's share of dq
    and dk. A backward computes dS = P * (dout V^T - rowsum(dout * out)); with V = 0 and
    rowsum(dout * out) = -dlse that is P * dlse, the LSE's derivative (its softmax weights)
    times dlse, through the score_mod as any dS. dout holds ones in two columns and out -dlse
    split over them (the input dtype's rounding of it, then of what that leaves), so dlse
    keeps about twice the input dtype's precision. Rows that see no key (LSE -inf) take none,
    whatever the loss made of their LSE (an infinite dlse would spread NaN to every key)."""
    dlse = torch.where(lse.isneginf(), 0.0, dlse)
    lse_out, lse_dout = torch.zeros_like(out), torch.zeros_like(out)
    columns = min(2, out.shape[-1])
    high = dlse.to(out.dtype)
    lse_out[..., 0] = -high
    if columns == 2:
        lse_out[..., 1] = high.to(dlse.dtype) - dlse
    lse_dout[..., :columns] = 1
    return lse_out, lse_dout


def some(r: Rows) -> bool:
    """Whether ``r`` holds any row."""
    return r[1] > r[0]


def rows_shape(like: Tensor, r: Rows, *tail: int) -> Tuple[int, ...]:
    """[B, H, rows of ``r``, *tail] of ``like``."""
    return (*like.shape[:2], r[1] - r[0], *tail)


def new_rows(like: Tensor, r: Rows, *tail: int, dtype=None) -> Tensor:
    """A new ``rows_shape`` tensor on ``like``'s device, of its dtype unless ``dtype``."""
    return torch.empty(rows_shape(like, r, *tail), dtype=dtype or like.dtype, device=like.device)


def leading_rows(buffer: Tensor, n: int) -> Tensor:
    """A [B, H, n, ...] tensor in the leading memory of ``buffer`` (a whole block's receive
    buffer): contiguous, as received, and where every rank's rows of it start."""
    shape = (*buffer.shape[:2], n, *buffer.shape[3:])
    return buffer.view(-1)[:math.prod(shape)].view(shape)
