"""Which process group a ``group`` argument names: a ProcessGroup, a 1-D DeviceMesh (the
context-parallel dimension of a larger mesh, ``mesh["cp"]``) or None (the default group);
and every rank's Python value, gathered."""
from __future__ import annotations

from typing import List

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


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
