"""Moving sharded tensors from one ``Sharding`` to another: an all-to-all each, with its autograd.

Each rank sends every other rank the rows of its shard that the target gives that rank, in
the target's local order there, and puts the rows it receives (grouped by the rank they come
from) into its target order. The routes (which local rows go where, and how what arrives is
put back in order) are computed once per source, target, rank and device. The backward of a
move is the reverse move of the gradient: a move is a permutation of the sequence's rows.

``ring_flex_attention`` moves a call left in the default layout to the sharding its mask
runs faster in (``plan.sharding.resharding``): q, k and v there, the output back.
"""
from __future__ import annotations

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


def _moved(x: Tensor, dim: int, source: Sharding, target: Sharding, group, what: str) -> Tensor:
    """``x``'s shard along ``dim`` moved from ``source`` to ``target``, contiguous. Each side
    gathers the rows in the order they travel or land with one ``index_select`` over a view
    that puts ``dim`` first (a pass that also lays the rows out for the all-to-all), and one
    last pass puts ``dim`` back. A failure here fails the group for every rank (``fault``):
    the others wait in the same all-to-all."""
    rank = dist.get_rank(group)
    route = _route(source, target, rank, x.device)
    send = x.movedim(dim, 0).index_select(0, route.send_order)
    received = send.new_empty((target.local_len(rank), *send.shape[1:]))
    try:
        if x.is_cuda:  # NCCL: ordered on the stream, the host does not wait
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
    return received.index_select(0, route.receive_order).movedim(0, dim).contiguous()


class _Move(torch.autograd.Function):
    """A move of a shard; its backward moves the gradient back."""

    @staticmethod
    def forward(ctx, x, dim, source, target, group, what):
        ctx.route = dim, source, target, group, what
        return _moved(x, dim, source, target, group, what)

    @staticmethod
    def backward(ctx, grad):
        dim, source, target, group, what = ctx.route
        return _moved(grad, dim, target, source, group, f"the gradient of {what}"), None, None, None, None, None


def move(tensors: Sequence[Tensor], dim: int, source: Sharding, target: Sharding, group, what: str) -> List[Tensor]:
    """``tensors``, this rank's shards in ``source`` along ``dim``, as this rank's shards in
    ``target``, contiguous: an all-to-all over ``group`` each (``what`` names them in errors).
    Differentiable."""
    return [_Move.apply(t, dim, source, target, group, what) for t in tensors]
