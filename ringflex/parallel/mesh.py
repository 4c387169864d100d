"""A heads x ring DeviceMesh: what a rank is in it, and the order of its tokens.

``group=mesh``, a 2-D DeviceMesh whose dimensions are named "heads" and "ring" (sizes a x r),
runs attention in two stages (``ringflex.heads``). Token order (``positions``): the ring
layout's segment of ring rank j (of r), split in a contiguous pieces; the rank at heads
coordinate i holds piece i, so that after the all-to-all over "heads" (``parallel.alltoall``)
each rank holds exactly the ring layout's segment of its ring coordinate.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..cache import remember
from ..plan import layout as layouts
from . import fault
from .groups import process_group, rank_and_size, ring_of

DIMS = ("heads", "ring")


class HeadsRing:
    """A heads x ring DeviceMesh as this rank sees it."""

    def __init__(self, mesh: DeviceMesh):
        names = list(mesh.mesh_dim_names)
        if mesh.get_coordinate() is None:
            raise ValueError(f"group does not include this process (global rank {dist.get_rank()}): only the ranks of "
                             "the mesh may call ringflex with it")
        self.mesh = mesh
        self.heads_group, self.ring_group = mesh.get_group("heads"), mesh.get_group("ring")
        self.heads, self.ring = mesh.size(names.index("heads")), mesh.size(names.index("ring"))
        self.head_rank, self.ring_rank = mesh.get_local_rank("heads"), mesh.get_local_rank("ring")
        self._flat = None

    @property
    def size(self) -> int:
        return self.heads * self.ring

    @property
    def flat(self):
        """A process group of every rank of the mesh (for the argument check, ``unshard`` and
        the training helpers' sums), made at first use by every rank of the mesh."""
        if self._flat is None:
            if self.heads == 1:
                self._flat = self.ring_group
            elif self.ring == 1:
                self._flat = self.heads_group
            else:
                ranks = sorted(self.mesh.mesh.flatten().tolist())
                self._flat = dist.new_group(ranks, backend=dist.get_backend(self.heads_group),
                                            use_local_synchronization=True)
        return self._flat

    def coordinates(self) -> Dict[int, Tuple[int, int]]:
        """Global rank -> (heads coordinate, ring coordinate)."""
        names = list(self.mesh.mesh_dim_names)
        grid = self.mesh.mesh if names == list(DIMS) else self.mesh.mesh.t()
        return {int(grid[i, j]): (i, j) for i in range(self.heads) for j in range(self.ring)}

    def groups(self):
        return [g for g in dict.fromkeys((self.heads_group, self.ring_group, self._flat)) if g is not None]

    def failure(self) -> Optional[str]:
        return next((f for f in map(fault.failure, self.groups()) if f), None)

    def fail(self, message: str) -> None:
        """Marks every group of the mesh failed, here and (in their stores) for every rank."""
        for group in self.groups():
            fault.fail(group, message)

    def raised(self, error: BaseException, where: str) -> None:
        """Fails the mesh for ``error``, raised on this rank in ``where``. A ``RingFailure`` passes
        on what failed first; the ring's own text counts its ranks along "ring", which says so."""
        message = f"rank {dist.get_rank()} raised in {where}: {type(error).__name__}: {error}"
        if isinstance(error, fault.RingFailure):
            mesh_wide = next((f for f in map(fault.failure, self.groups()[::-1]) if f), None)
            ring = fault.failure(self.ring_group)
            if mesh_wide is not None and mesh_wide != ring:
                message = mesh_wide
            elif ring is not None:
                message = f"in the ring at heads coordinate {self.head_rank} (ranks counted along \"ring\"), {ring}"
        self.fail(message)


_MESHES: "OrderedDict[tuple, HeadsRing]" = OrderedDict()


def describe(group) -> Optional[HeadsRing]:
    """The ``HeadsRing`` of ``group`` where it is a 2-D DeviceMesh of dimensions "heads" and
    "ring" (in either order), else None (the 1-D ring's ``group``)."""
    if not isinstance(group, DeviceMesh) or group.ndim != 2 or sorted(group.mesh_dim_names or ()) != sorted(DIMS):
        return None
    heads_group, ring_group = group.get_group("heads"), group.get_group("ring")
    key = (id(heads_group), id(ring_group))
    found = _MESHES.get(key)
    if found is None or found.heads_group is not heads_group or found.ring_group is not ring_group:
        found = remember(_MESHES, key, HeadsRing(group), 16)
    return found


def group_or_mesh(group):
    """What a wrapper keeps of its ``group`` argument: a heads x ring mesh as it is, else its
    ProcessGroup (``process_group``, which refuses other meshes and objects)."""
    return group if describe(group) is not None else process_group(group)


def ring_key(group):
    """Equal for two ``group`` arguments that name the same ring (or heads x ring mesh)."""
    described = describe(group)
    return ring_of(group) if described is None else ("heads x ring", described.heads_group, described.ring_group)


def world_size(group) -> int:
    """How many ranks share the sequence: a x r over a heads x ring mesh."""
    described = describe(group)
    return rank_and_size(group)[1] if described is None else described.size


def flat(group):
    """The ProcessGroup over which a value summed over the sequence's ranks is summed (the
    loss, the parameters' gradients): every rank of a heads x ring mesh, else ``group``'s."""
    described = describe(group)
    return process_group(group) if described is None else described.flat


# --------------------------------------------------------------------------- token order

def divisor(layout: str, group) -> int:
    """A global length must be a multiple of this for ``layout`` over ``group``."""
    described = describe(group)
    if described is None:
        return layouts.divisor(layout, rank_and_size(group)[1])
    return math.lcm(layouts.divisor(layout, described.ring), described.size)


def positions(layout: str, seq_len: int, group, device=None, coordinate: Optional[Tuple[int, int]] = None) -> Tensor:
    """Global positions of the tokens of the rank at ``coordinate`` (heads, ring; default this
    rank's) of a heads x ring mesh ``group``: piece ``heads`` of the ring layout's segment of
    ring rank ``ring``."""
    described = describe(group)
    d = divisor(layout, group)
    if seq_len % d:
        raise ValueError(f"sequence length {seq_len} does not fit layout {layout!r} on a {described.heads} x "
                         f"{described.ring} heads x ring mesh: it must be a multiple of {d}")
    i, j = (described.head_rank, described.ring_rank) if coordinate is None else coordinate
    ring = layouts.positions(layout, seq_len, described.ring, j, device)
    piece = ring.numel() // described.heads
    return ring[i * piece:(i + 1) * piece]
