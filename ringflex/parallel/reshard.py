"""Moving sharded tensors from one ``Sharding`` to another: one all-to-all, with its autograd.

Each rank sends every other rank the rows of its shard that the target gives that rank, in
the target's local order there, and puts the rows it receives (grouped by the rank they come
from) into its target order. The routes (which local rows go where, and how what arrives is
put back in order) are computed once per source, target, rank and device. The backward of a
move is the reverse move of the gradient: a move is a permutation of the sequence's rows.

``ring_flex_attention`` moves a call left in the default layout to the sharding its mask
runs faster in (``plan.sharding.resharding``): q, k and v there, the output back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..plan.layout import Sharding
from . import fault


@dataclass(frozen=True)
class _Route:
    """One rank's side of a move."""

    send_order: Tensor  # local rows of the source shard, grouped by the rank they go to, each in its target order
    send_counts: List[int]  # rows sent to each rank
    receive_counts: List[int]  # rows received from each rank
    receive_order: Tensor  # which received row becomes each local row of the target shard


_ROUTES: Dict[tuple, _Route] = {}


def _route(source: Sharding, target: Sharding, rank: int, device) -> _Route:
    key = (source, target, rank, device)
    if key not in _ROUTES:
        world = source.world_size
        mine = source.positions(rank)
        to, there = target.owners()[mine], target.local_index()[mine]
        arriving_from = source.owners()[target.positions(rank)]  # by target local row
        arrival = torch.sort(arriving_from, stable=True).indices  # received row i is target row arrival[i]
        _ROUTES[key] = _Route(torch.argsort(to * source.seq_len + there).to(device),
                              torch.bincount(to, minlength=world).tolist(),
                              torch.bincount(arriving_from, minlength=world).tolist(),
                              torch.argsort(arrival).to(device))
    return _ROUTES[key]


def _moved(rows: Tensor, source: Sharding, target: Sharding, group, what: str) -> Tensor:
    """``rows`` [source local length, C] moved to [target local length, C]. A failure here
    fails the group for every rank (``fault``): the others wait in the same all-to-all."""
    rank = dist.get_rank(group)
    route = _route(source, target, rank, rows.device)
    send = rows.index_select(0, route.send_order)
    received = rows.new_empty((target.local_len(rank), rows.shape[1]))
    try:
        if rows.is_cuda:  # NCCL: ordered on the stream, the host does not wait
            dist.all_to_all_single(received, send, route.receive_counts, route.send_counts, group=group)
        else:
            work = dist.all_to_all_single(received, send, route.receive_counts, route.send_counts, group=group,
                                          async_op=True)
            fault.wait_collective(work, group, what)
    except (fault.RingFailure, fault.RaisedTogether):
        raise
    except BaseException as e:
        fault.fail(group, f"rank {rank} raised in {what}: {type(e).__name__}: {e}")
        raise
    return received.index_select(0, route.receive_order)


class _Move(torch.autograd.Function):
    """A move of rows; its backward moves the gradient back."""

    @staticmethod
    def forward(ctx, rows, source, target, group, what):
        ctx.route = source, target, group, what
        return _moved(rows, source, target, group, what)

    @staticmethod
    def backward(ctx, grad):
        source, target, group, what = ctx.route
        return _moved(grad.contiguous(), target, source, group, f"the gradient of {what}"), None, None, None, None


def move(tensors: Sequence[Tensor], dim: int, source: Sharding, target: Sharding, group, what: str) -> List[Tensor]:
    """``tensors``, this rank's shards in ``source`` along ``dim`` (of one dtype and one length
    there), as this rank's shards in ``target``, contiguous; in one all-to-all over ``group``
    (``what`` names it in errors). Differentiable."""
    along = [t.movedim(dim, 0) for t in tensors]
    widths = [math.prod(t.shape[1:]) for t in along]
    rows = torch.cat([t.reshape(t.shape[0], w) for t, w in zip(along, widths)], 1)
    parts = _Move.apply(rows, source, target, group, what).split(widths, 1)
    return [p.reshape(-1, *t.shape[1:]).movedim(0, dim).contiguous() for p, t in zip(parts, along)]
