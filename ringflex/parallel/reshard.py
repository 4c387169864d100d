"""Moving sharded tensors from one ``Sharding`` to another, over the ring's own transport.

A move is a permutation of the sequence's rows: each rank keeps the rows the target leaves
it, and for every shift s of the ring sends the rank s ahead the rows the target gives that
rank, in their order there, while the rank s behind sends it its rows. All the tensors of a
move travel together, one exchange per shift, on the copy engines between the GPUs of one
host (no SM takes part, and nothing waits for the host beyond the packing), else through the
process group's P2P. Per tensor, a move costs the GPU one pass per shift that gathers the
rows sent, and one that puts the target shard together from the rows kept and those that
arrived. The routes (which local rows go where, as runs) are computed once per source,
target and rank. The backward of a move is the reverse move of the gradients.

``ring_flex_attention`` moves a call left in the default layout to the sharding its mask
runs faster in (``plan.sharding.resharding``): q, k and v there, the output back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..plan.layout import Sharding
from .fault import GuardedComm, guard


Runs = Tuple[Tuple[int, int], ...]  # (begin, end) ranges of local rows


@dataclass(frozen=True)
class _Route:
    """One rank's side of a move: for each shift s that moves rows, the runs of source rows
    sent to rank + s (in their order there) and how many rows come from rank - s; and the
    target shard as runs of rows taken in turn from the source shard (``None``) or from what
    arrived at a shift (its index in ``shifts``)."""

    shifts: Tuple[Tuple[int, Runs, int], ...]  # (s, source runs sent to rank + s, rows received from rank - s)
    target: Tuple[Tuple[Optional[int], int, int], ...]  # (None or index into shifts, begin, end), in target order


_ROUTES: Dict[tuple, _Route] = {}


def _runs(rows: Tensor, origin: Optional[Tensor] = None) -> Tuple[Tuple[int, int, int], ...]:
    """``rows`` as (origin, begin, end) runs: rows of one ``origin`` (default: all 0) that
    increase by one."""
    origin = torch.zeros_like(rows) if origin is None else origin
    breaks = torch.nonzero((rows[1:] != rows[:-1] + 1) | (origin[1:] != origin[:-1])).flatten() + 1
    bounds = [0, *breaks.tolist(), len(rows)]
    return tuple((int(origin[a]), int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(bounds, bounds[1:]) if b > a)


def _route(source: Sharding, target: Sharding, rank: int) -> _Route:
    key = (source, target, rank)
    if key not in _ROUTES:
        world = source.world_size
        mine = source.positions(rank)
        to, there = target.owners()[mine], target.local_index()[mine]
        coming_from = source.owners()[target.positions(rank)]  # per target row: the rank it comes from
        origin = torch.full((target.local_len(rank),), -1)  # per target row: -1 kept, else the index of its shift
        offset = torch.zeros_like(origin)  # per target row: its row in the source shard or in what arrived
        kept = torch.nonzero(to == rank).flatten()
        offset[there[kept]] = kept
        shifts = []
        for s in range(1, world):
            sent = torch.nonzero(to == (rank + s) % world).flatten()
            filled = torch.nonzero(coming_from == (rank - s) % world).flatten()
            if sent.numel() or filled.numel():
                origin[filled], offset[filled] = len(shifts), torch.arange(filled.numel())
                shifts.append((s, tuple((b, e) for _, b, e in _runs(sent[torch.argsort(there[sent])])),
                               filled.numel()))
        _ROUTES[key] = _Route(tuple(shifts), tuple((None if o < 0 else o, b, e) for o, b, e in _runs(offset, origin)))
    return _ROUTES[key]


def _joined(parts: Sequence[Tensor], dim: int) -> Tensor:
    """``parts`` one after the other along ``dim``, contiguous: one pass."""
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)


def _moved(tensors: Sequence[Tensor], dim: int, source: Sharding, target: Sharding, group, what: str
           ) -> List[Tensor]:
    """``tensors``' shards along ``dim`` moved from ``source`` to ``target``, contiguous: per
    tensor one pass gathers each shift's rows, one puts the target together. A failure here
    fails the group for every rank (``fault``): the others wait for its transfers."""
    comm = GuardedComm(group)
    route = _route(source, target, comm.rank)
    received = []
    with guard(comm, what):
        arriving = []
        for shift, runs, count in route.shifts:
            send = [_joined([x.narrow(dim, b, e - b) for b, e in runs], dim) if runs else x.narrow(dim, 0, 0)
                    for x in tensors]
            receive = [x.new_empty([count if d == dim else n for d, n in enumerate(x.shape)]) for x in tensors]
            arriving.append(comm.exchange(send, receive, shift))
            received.append(receive)
        for transfer in arriving:
            transfer.wait()
        comm.end_pass(tensors[0].device)
    if len(route.target) == 1 and route.target[0][0] is None:  # nothing arrives: a copy, not a view of an input
        return [x.clone(memory_format=torch.contiguous_format) for x in tensors]
    return [_joined([(x if o is None else received[o][i]).narrow(dim, b, e - b) for o, b, e in route.target], dim)
            for i, x in enumerate(tensors)]


class _Move(torch.autograd.Function):
    """A move of several shards; its backward moves their gradients back."""

    @staticmethod
    def forward(ctx, dim, source, target, group, what, *tensors):
        ctx.route = dim, source, target, group, what
        return tuple(_moved(tensors, dim, source, target, group, what))

    @staticmethod
    def backward(ctx, *grads):
        dim, source, target, group, what = ctx.route
        return (None,) * 5 + tuple(_moved(grads, dim, target, source, group, f"{what} (its gradient)"))


def move(tensors: Sequence[Tensor], dim: int, source: Sharding, target: Sharding, group, what: str) -> List[Tensor]:
    """``tensors``, this rank's shards in ``source`` along ``dim``, as this rank's shards in
    ``target``, contiguous, all in one move over ``group`` (``what`` names them in errors).
    Differentiable."""
    return list(_Move.apply(dim, source, target, group if group is not None else dist.group.WORLD, what, *tensors))
