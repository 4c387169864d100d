"""Moving whole sequences in and out of a layout: ``shard`` splits, ``unshard`` gathers."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import warn_once
from ..mod.fingerprint import digest
from ..plan import layout as layouts
from . import agreement, mesh as meshes
from .groups import process_group, rank_and_size


def warn_if_launched_alone() -> None:
    """Says once that torchrun launched several processes (WORLD_SIZE) but no process group
    joins them: each then works alone on what it holds, which raises no error anywhere."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        warn_once(f"ringflex: WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialized: each "
                  "process works alone (shard keeps the whole sequence, attention sees its own tokens only). Call "
                  "torch.distributed.init_process_group() first")


def _rank_and_size(group):
    if not dist.is_available() or not dist.is_initialized():
        warn_if_launched_alone()
    return rank_and_size(group)


def _dim_error(what: str, x: Tensor, dim) -> str:
    """What is wrong with ``dim`` of ``x``, or "" where nothing is."""
    if not isinstance(x, Tensor):
        return f"{what}: x must be a torch.Tensor, got {type(x).__name__}"
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        return f"{what}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}"
    return ""


def shard(x: Tensor, dim: int, group=None, layout=None) -> Tensor:
    """This rank's tokens of the full sequence ``x`` along ``dim`` (every rank passes the same x).

    Differentiable: the gradient flows back into the slice this rank took. ``layout``: a name
    of ``LAYOUTS``, a ``Sharding`` (``ringflex.shard_by_mask``), or None: "zigzag", the
    default of ``ring_flex_attention`` too. ``group`` may be a heads x ring mesh (``ringflex.heads``).
    """
    layout = layouts.or_default(layout)
    heads_ring = meshes.describe(group)
    if heads_ring is not None:
        return _shard_over_mesh(x, dim, heads_ring, layout)
    error = _dim_error("shard", x, dim)
    if error:
        raise ValueError(error)
    rank, world_size = _rank_and_size(group)
    index = layouts.positions(layout, x.shape[dim], world_size, rank, x.device)
    return x.index_select(dim, index)


_MAX_DIMS = 8


def _dtype_code(dtype: torch.dtype) -> int:
    return digest(str(dtype).encode())


def _layout_error(layout, what: str) -> str:
    error = layouts.layout_error(layout)
    return f"{what}: {error}" if error else ""


def _check_same_shards(x: Tensor, dim, layout, group) -> None:
    """Raises the same error on every rank, before any data moves, if the ranks gather in
    different layouts (a rank's result would come out in another order), the shards differ in
    shape or dtype (an all_gather of unequal tensors would hang or kill a rank), the ranks
    gather along different dims, or a rank's ``dim`` is not one of its tensor's or its
    ``layout`` is no layout."""
    error = _dim_error("unshard", x, dim) or _layout_error(layout, "unshard") or None
    if error is None and x.dim() > _MAX_DIMS:
        error = f"unshard supports tensors of at most {_MAX_DIMS} dims, got {x.dim()}"
    mine = ([layouts.code(layout), _dtype_code(x.dtype), dim % x.dim(), x.dim(), *x.shape]
            + [0] * (_MAX_DIMS - x.dim()) if error is None else [0] * (4 + _MAX_DIMS))
    records = agreement.exchange(group, mine, error, "unshard", caller=None)
    if any(r[0] != mine[0] for r in records):
        raise ValueError("unshard: the ranks differ in layout (" + ", ".join(
            f"rank {rank}: {layouts.text(r[0])}" for rank, r in enumerate(records)) + "); every rank must "
            "gather in the layout the shards were made in")
    if any(r != mine for r in records):
        names = {_dtype_code(d): str(d).replace("torch.", "") for d in vars(torch).values() if isinstance(d, torch.dtype)}
        raise ValueError("unshard: the ranks' shards or dims differ (" + ", ".join(
            f"rank {rank}: {tuple(r[4:4 + r[3]])} {names.get(r[1], '?')} along dim {r[2]}"
            for rank, r in enumerate(records)) + ")")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, layout):
        rank, world_size = _rank_and_size(group)
        _check_same_shards(x, dim, layout, group)
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full_len = x.shape[dim] * world_size
        inverse = layouts.inverse_permutation(layout, full_len, world_size, x.device)
        ctx.dim, ctx.index = dim, layouts.positions(layout, full_len, world_size, rank, x.device)
        return torch.cat(parts, dim).index_select(dim, inverse)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.dim, ctx.index), None, None, None


def unshard(x: Tensor, dim: int, group=None, layout=None) -> Tensor:
    """The full sequence, in global order, gathered from every rank's shard ``x`` (in ``layout``, as ``shard``'s).

    The result is a value every rank holds alike; its gradient on each rank flows back into
    that rank's own shard (so a loss computed identically on every rank is counted once).
    """
    layout = layouts.or_default(layout)
    heads_ring = meshes.describe(group)
    if heads_ring is not None:
        return _unshard_over_mesh(x, dim, heads_ring, layout)
    group = process_group(group)
    _, world_size = _rank_and_size(group)
    if world_size == 1:
        error = _dim_error("unshard", x, dim) or _layout_error(layout, "unshard")
        if error:
            raise ValueError(error)
        return x
    return _Gather.apply(x, dim, group, layout)


def _shard_over_mesh(x: Tensor, dim: int, mesh: meshes.HeadsRing, layout: str) -> Tensor:
    """``shard`` over a heads x ring mesh: this rank's tokens in the mesh's order."""
    error = _dim_error("shard", x, dim) or _layout_error(layout, "shard")
    if error:
        raise ValueError(error)
    return x.index_select(dim, meshes.positions(layout, x.shape[dim], mesh.mesh, x.device))


class _GatherOverMesh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mesh: meshes.HeadsRing, layout):
        group = mesh.flat
        _check_same_shards(x, dim, layout, group)
        parts = [torch.empty_like(x) for _ in range(mesh.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full_len = x.shape[dim] * mesh.size
        where = mesh.coordinates()
        order = torch.cat([meshes.positions(layout, full_len, mesh.mesh, x.device, where[r])
                           for r in dist.get_process_group_ranks(group)])
        ctx.dim, ctx.index = dim, meshes.positions(layout, full_len, mesh.mesh, x.device)
        return torch.cat(parts, dim).index_select(dim, torch.argsort(order))

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.dim, ctx.index), None, None, None


def _unshard_over_mesh(x: Tensor, dim: int, mesh: meshes.HeadsRing, layout: str) -> Tensor:
    """``unshard`` over a heads x ring mesh: the whole sequence, gathered from every rank."""
    if mesh.size == 1:
        return _shard_over_mesh(x, dim, mesh, layout)  # checks the arguments; the whole sequence
    return _GatherOverMesh.apply(x, dim, mesh, layout)
