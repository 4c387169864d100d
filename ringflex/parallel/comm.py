"""The ring's point-to-point exchange: send to the next rank while receiving from the previous (or the reverse)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

_TRANSFER_GROUPS = {}


def transfer_group(group):
    """The group the ring's transfers go through: ``group`` itself, or for NCCL a group of the
    same ranks (and timeout) whose stream has high priority, made once per group.

    NCCL starts a transfer after the work queued before it on the current stream, so the
    next block's transfer becomes ready together with the step's attention kernel. At equal
    priority it then waits for SMs until that kernel's last thread blocks: traced on H200s,
    the transfers started up to 0.8 ms late and the next step waited for them. At high
    priority the transfer gets the first SMs that free up.
    """
    if "nccl" not in str(dist.get_backend(group)):
        return group
    if group not in _TRANSFER_GROUPS:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        timeout = getattr(getattr(group._get_backend(torch.device("cuda")), "options", None), "_timeout", None)
        _TRANSFER_GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group), backend="nccl", timeout=timeout,
                                                 pg_options=options, use_local_synchronization=True)
    return _TRANSFER_GROUPS[group]


class RingComm:
    """Sends to rank+1 and receives from rank-1 of ``group`` (or the reverse) with batched P2P ops."""

    def __init__(self, group):
        self.group = group
        self.transfer_group = transfer_group(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world_size)

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], reverse: bool = False):
        """Starts the transfer; call ``.wait()`` on the result before reading ``recv``.
        ``reverse``: send to the previous rank and receive from the next.

        NCCL runs it on its own stream, so the compute launched meanwhile overlaps it.
        """
        to, source = (self.prev, self.next) if reverse else (self.next, self.prev)
        ops = [dist.P2POp(dist.isend, t, to, self.transfer_group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, source, self.transfer_group) for t in recv]
        return _Pending(dist.batch_isend_irecv(ops))


class _Pending:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
