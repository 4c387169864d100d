"""The ring: K/V blocks travel around the ranks, each step runs the hops of the plan.

Forward keeps the running output and LSE in fp32 (fp64 for fp64 inputs). Backward runs the
ring again: K/V travel as in forward, and the dK/dV accumulated for each block travel with
it, in fp32, until they arrive back at the block's owner after a full turn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from ..kernels.base import HopKernel, Mods
from ..kernels.reference import compute_dtype
from ..plan import Hop
from .comm import RingComm
from .fault import guard
from .merge import merge_


@dataclass
class RingCall:
    """Everything forward and backward of one call need besides the tensors."""

    comm: Optional[RingComm]  # None on a single rank
    schedule: List[List[Hop]]  # schedule[i]: hops against the K/V block held at step i
    kernel: HopKernel
    mods: Mods
    scale: float


def _rows(x: Tensor, rows) -> Tensor:
    return x[:, :, rows[0]:rows[1]]


class _KVStream:
    """The K/V block of each step: the local one first, then blocks received into two
    buffers that alternate, so no step allocates and a block is never overwritten while
    it is still being read or sent."""

    def __init__(self, call: RingCall, k: Tensor, v: Tensor):
        self.call = call
        self.current = (k, v)
        steps = len(call.schedule)
        self.buffers = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, steps - 1))]

    def start(self, step: int):
        """Starts passing the current block on; the next one arrives in ``advance``."""
        if step + 1 == len(self.call.schedule):
            return None
        self.incoming = self.buffers[step % 2]
        return self.call.comm.exchange(self.current, self.incoming)

    def advance(self, pending) -> None:
        if pending is not None:
            pending.wait()
            self.current = self.incoming


def _masked(hop: Hop) -> bool:
    return hop.kind != hop.kind.FULL


def ring_forward(call: RingCall, q: Tensor, k: Tensor, v: Tensor):
    acc = compute_dtype(q.dtype)
    out = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=acc)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)
    blocks = _KVStream(call, k, v)
    merged = []  # local query row ranges that hold a partial result already
    for step, hops in enumerate(call.schedule):
        pending = blocks.start(step)
        bk, bv = blocks.current
        for hop in hops:
            part_out, part_lse = call.kernel.forward(
                _rows(q, hop.q_rows), _rows(bk, hop.kv_rows), _rows(bv, hop.kv_rows),
                hop.q_seg, hop.kv_seg, call.mods, call.scale, _masked(hop))
            first = not any(b < hop.q_rows[1] and hop.q_rows[0] < e for b, e in merged)
            merge_(_rows(out, hop.q_rows), _rows(lse, hop.q_rows), part_out, part_lse, first)
            merged.append(hop.q_rows)
        blocks.advance(pending)
    return out, lse


def ring_backward(call: RingCall, q, k, v, out, lse, dout):
    acc = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    blocks = _KVStream(call, k, v)
    # Two dK/dV accumulators alternate: one travels on while the next step fills the other.
    grads = [(torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
             for _ in range(2 if call.comm else 1)]
    inbox = tuple(torch.empty_like(g) for g in grads[0])
    grads_pending = None
    for step, hops in enumerate(call.schedule):
        kv_pending = blocks.start(step)
        bk, bv = blocks.current
        dk, dv = grads[step % len(grads)]
        dk.zero_()
        dv.zero_()
        for hop in hops:
            hq, hk, hv = call.kernel.backward(
                _rows(q, hop.q_rows), _rows(bk, hop.kv_rows), _rows(bv, hop.kv_rows),
                _rows(out, hop.q_rows), _rows(lse, hop.q_rows), _rows(dout, hop.q_rows),
                hop.q_seg, hop.kv_seg, call.mods, call.scale, _masked(hop))
            _rows(dq, hop.q_rows).add_(hq)
            _rows(dk, hop.kv_rows).add_(hk)
            _rows(dv, hop.kv_rows).add_(hv)
        if grads_pending is not None:
            grads_pending.wait()
            dk.add_(inbox[0])
            dv.add_(inbox[1])
        if call.comm is not None:  # the block's gradients follow the block round the ring
            grads_pending = call.comm.exchange((dk, dv), inbox)
        blocks.advance(kv_pending)
    if grads_pending is not None:  # after a full turn the gradients are back at their owner
        grads_pending.wait()
        dk, dv = inbox
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd of the ring. ``call`` carries the plan, kernel, mods and scale to backward."""

    @staticmethod
    def forward(ctx, q, k, v, call: RingCall):
        with guard(call.comm, "forward"):  # a failure here releases the other ranks
            out, lse = ring_forward(call, q, k, v)
        out = out.to(q.dtype)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with guard(ctx.call.comm, "backward"):
            dq, dk, dv = ring_backward(ctx.call, q, k, v, out, lse, dout.contiguous())
        return dq, dk, dv, None
