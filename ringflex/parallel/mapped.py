"""Memory that the other ranks of a group copy into: the copy-engine transport's mailboxes
(``peer``) and its receive buffers (``inplace``). torch's symmetric memory maps it between
the GPUs of a host; it refuses ranks that share a GPU, whose processes map each other's
memory by CUDA IPC instead, through the driver (torch's own sharing of CUDA tensors counts
references across processes, and a process that exits while another still maps its memory
prints a warning for memory that every rank holds until it exits)."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Tuple

import torch
from torch import Tensor

from .driver import Driver
from .groups import gather_objects, made_together


def mapped(group, device: torch.device, nbytes: int, peers: Iterable[int], shared_gpu: bool,
           what: str) -> Tuple[Tensor, Dict[int, int], object]:
    """``nbytes`` of this rank's memory on ``device``, made by every rank of ``group`` together
    (``what`` names it in the error where a rank cannot), the address in this process of each
    of ``peers``' counterpart, and what keeps them mapped: hold it as long as they are used;
    to drop them, ``close()`` it before a collective after which the peers free their memory."""
    peers = sorted(set(peers))
    if shared_gpu:
        mine = made_together(group, lambda: _DriverMemory(device, nbytes).tensor(), what)
        opened = _IpcOpened(device, gather_objects(group, Driver().ipc_handle(device.index, mine.data_ptr())), peers)
        return mine, dict(opened.addresses), opened
    import torch.distributed._symmetric_memory as symm_mem
    mine = made_together(group, lambda: symm_mem.empty(nbytes, dtype=torch.uint8, device=device), what)
    handle = symm_mem.rendezvous(mine, group.group_name)
    return mine, {r: handle.get_buffer(r, (nbytes,), torch.uint8).data_ptr() for r in peers}, _Symmetric(handle)


class _Symmetric:
    """Keeps torch's symmetric memory mapped (its rendezvous ``handle``)."""

    def __init__(self, handle):
        self.handle = handle

    def close(self) -> None:
        """Nothing to do: torch unmaps symmetric memory as it frees it."""


class _DriverMemory:
    """Memory the driver allocated (``Driver.allocate``), as a torch tensor of bytes: torch
    holds this object as long as the tensor's memory, which is freed with it."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device, self.driver = device.index, Driver()
        self.address = self.driver.allocate(self.device, nbytes)
        self.__cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(self.address, False),
                                             version=3, strides=None)

    def tensor(self) -> Tensor:
        return torch.as_tensor(self, device=torch.device("cuda", self.device))

    def __del__(self):
        with contextlib.suppress(RuntimeError):  # at exit the driver may have shut down before
            self.driver.free(self.device, self.address)


class _IpcOpened:
    """The memory of ``peers`` named by their IPC handles (every rank's, by rank), mapped into
    this rank's GPU's context whichever GPU it lies on: a stream memory operation reaches only
    memory mapped in its stream's context."""

    def __init__(self, device: torch.device, handles, peers):
        self.device, self.driver = device.index, Driver()
        self.addresses = {r: self.driver.ipc_open(self.device, handles[r]) for r in peers}

    def close(self) -> None:
        """Unmaps the peers' memory (before they free it); done once."""
        addresses, self.addresses = self.addresses, {}
        for address in addresses.values():
            self.driver.ipc_close(self.device, address)

    def __del__(self):
        with contextlib.suppress(RuntimeError):  # at exit the driver may have shut down before
            self.close()
