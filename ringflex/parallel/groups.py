"""Which process group a ``group`` argument names: a ProcessGroup, a 1-D DeviceMesh (the
context-parallel dimension of a larger mesh, ``mesh["cp"]``) or None (the default group);
every rank's Python value, gathered; memory every rank must make before a collective maps it."""
from __future__ import annotations

from typing import Callable, List, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")


def process_group(group):
    """The ProcessGroup of ``group`` (None stays None: the callers read it as the default group)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks it leaves out
        raise ValueError(f"group does not include this process (global rank {dist.get_rank()}): only the ranks of "
                         "the group may call ringflex with it")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = f" {group.mesh_dim_names}" if group.mesh_dim_names else ""
            raise ValueError(f"group must be a 1-D DeviceMesh (the ring's dimension, e.g. mesh['cp']), got a "
                             f"{group.ndim}-D DeviceMesh of shape {tuple(group.shape)}{names}")
        return group.get_group()
    raise TypeError(f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got "
                    f"{type(group).__name__}")


def ring_of(group):
    """The ProcessGroup of the ring ``group`` names: the default group for None, None where
    torch.distributed is not initialized (one process)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return process_group(group) if group is not None else dist.group.WORLD


def rank_and_size(group):
    """This rank's index in ``group`` and the group's size; (0, 1) where torch.distributed is
    not initialized (one process holds the whole sequence)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    group = process_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


def gather_objects(group, value) -> List:
    """Every rank's ``value`` (picklable), in rank order; over NCCL on the current device."""
    values: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def made_together(group, make: Callable[[], T], what: str) -> T:
    """``make()`` where it succeeds on every rank of ``group``; else the same RuntimeError on
    every rank, naming each rank that failed and why. For memory that a collective maps next
    (symmetric memory, CUDA IPC): a rank out of GPU memory would leave the others in it."""
    try:
        made, error = make(), None
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        made, error = None, f"{type(e).__name__}: {str(e)[:300]}"
    failed = [(rank, e) for rank, e in enumerate(gather_objects(group, error)) if e is not None]
    if failed:
        raise RuntimeError(f"ringflex: {what} could not be made on every rank ("
                           + "; ".join(f"rank {rank}: {e}" for rank, e in failed) + ")")
    return made
