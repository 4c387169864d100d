"""The all-to-alls of a heads x ring mesh (``ringflex.heads``), with their autograd.

Over the "heads" dimension of the mesh (``a`` ranks), ``to_sequence`` turns each rank's
[B, H, L, ...] (all heads of its L tokens) into [B, H/a, a*L, ...] (its slice of the heads, for
the tokens of the whole heads group, in the group's rank order); ``to_heads`` is the reverse.
Each is the other's backward: an all-to-all is a permutation of the pieces, and its transpose
is the reverse all-to-all.

torch's functional ``all_to_all_single_autograd`` computes the same (it works on gloo in
torch 2.13), but its wait blocks: a rank whose peer failed in another ring of the mesh would
wait for the group's timeout. Here the wait on CPU tensors (gloo) polls the mesh's failure
mark, as the ring's transfers do (``parallel.fault``): the others then raise ``RingFailure``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import fault


def _all_to_all(send: Tensor, mesh, what: str) -> Tensor:
    """``send`` [a, ...]: piece i goes to rank i of ``mesh.heads_group``; returns the pieces
    received, piece i from rank i. A failure here fails the mesh (``mesh.raised``)."""
    received = torch.empty_like(send)
    try:
        if send.is_cuda:  # NCCL: ordered on the stream, the host does not wait
            dist.all_to_all_single(received, send, group=mesh.heads_group)
        else:
            work = dist.all_to_all_single(received, send, group=mesh.heads_group, async_op=True)
            fault.wait_collective(work, mesh.heads_group, what, ring_group=mesh.flat)
    except BaseException as e:
        mesh.raised(e, what)
        raise
    return received


def _sequence_from(x: Tensor, mesh, what: str) -> Tensor:
    a = mesh.heads
    batch, heads, length, rest = x.shape[0], x.shape[1], x.shape[2], tuple(x.shape[3:])
    send = x.reshape(batch, a, heads // a, length, *rest).movedim(1, 0).contiguous()
    received = _all_to_all(send, mesh, what)  # [a, B, H/a, L, ...]: piece i holds rank i's tokens
    return received.movedim(0, 2).reshape(batch, heads // a, a * length, *rest)


def _heads_from(y: Tensor, mesh, what: str) -> Tensor:
    a = mesh.heads
    batch, heads, length, rest = y.shape[0], y.shape[1], y.shape[2] // a, tuple(y.shape[3:])
    send = y.reshape(batch, heads, a, length, *rest).movedim(2, 0).contiguous()
    received = _all_to_all(send, mesh, what)  # [a, B, H/a, L, ...]: piece i holds rank i's heads
    return received.movedim(0, 1).reshape(batch, a * heads, length, *rest)


class _AllToAll(torch.autograd.Function):
    """One all-to-all over "heads" (towards the sequence's layout or back to the heads'); its
    backward is the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, mesh, name, towards_sequence: bool):
        ctx.mesh, ctx.name, ctx.towards_sequence = mesh, name, towards_sequence
        move = _sequence_from if towards_sequence else _heads_from
        return move(x, mesh, f"the heads all-to-all of {name}")

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None
        back = _heads_from if ctx.towards_sequence else _sequence_from
        return back(grad, ctx.mesh, f"the heads all-to-all of the gradient of {ctx.name}"), None, None, None


def to_sequence(x: Tensor, mesh, name: str) -> Tensor:
    """[B, H, L, ...] (all heads of this rank's tokens) -> [B, H/a, a*L, ...] (this rank's
    slice of the heads, for the tokens of every rank of the heads group, in rank order)."""
    if mesh.heads == 1:
        return x
    return _AllToAll.apply(x, mesh, name, True)


def to_heads(y: Tensor, mesh, name: str) -> Tensor:
    """The reverse of ``to_sequence``: [B, H/a, a*L, ...] -> [B, H, L, ...]."""
    if mesh.heads == 1:
        return y
    return _AllToAll.apply(y, mesh, name, False)
