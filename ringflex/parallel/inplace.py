"""Receive buffers that the senders fill in place (the copy-engine transport, ``peer``).

A copy within one GPU runs on its SMs and waits for the attention kernel that holds them;
a copy into another GPU's memory runs on the copy engines beside it. So the ring's K/V blocks
and dK/dV shares skip the mailbox: each goes straight into the receiver's buffer, in memory
that the senders map (``mapped``). Every rank asks for the buffers of the same keys, in the
same order and sizes (the shards are equal), so a sender finds the receiver's buffer of a key
at the address its own buffer of that key maps there.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .mapped import mapped


class ReceiveBuffers:
    """For each key one buffer, the leading bytes of which every call uses: made by every rank
    of ``group`` together at the first call that needs it (after the ranks agreed on the call),
    made anew, larger, by the first that needs more (calls of many lengths hold the largest's,
    not one for each). A buffer that a CUDA graph captured is kept as long as these are: its
    replays write into it. ``peers``: the ranks that send into them; ``shared_gpu``: some ranks
    share a GPU (``mapped``)."""

    def __init__(self, group, device: torch.device, peers, shared_gpu: bool = False):
        self.group, self.device, self.peers, self.shared_gpu = group, device, set(peers), shared_gpu
        self.current: Dict[object, Tensor] = {}  # key -> its buffer
        self.mapped: Dict[int, Dict[int, int]] = {}  # a buffer's address -> {peer: that peer's buffer of its key}
        self.kept: Dict[int, Tuple[Tensor, object]] = {}  # a buffer's address -> (it, its handle): those in use
        self.in_graphs = set()  # the addresses of the buffers a captured pass writes into

    def get(self, key, nbytes: int) -> Tensor:
        """``nbytes`` of the buffer of ``key`` (see the class)."""
        capturing = torch.cuda.is_current_stream_capturing()
        found = self.current.get(key)
        if found is None or found.numel() < nbytes:
            if capturing:
                raise RuntimeError("ringflex: a ring call captured in a CUDA graph needs an eager call of the same "
                                   "shapes on the same process group first (it makes the receive buffers, which "
                                   "capture cannot)")
            if found is not None and found.data_ptr() not in self.in_graphs:
                torch.cuda.synchronize(self.device)  # no copy into or out of it is under way, here or at a peer
                del self.mapped[found.data_ptr()], self.kept[found.data_ptr()]
            found = self.current[key] = self._mapped(nbytes)
        if capturing:
            self.in_graphs.add(found.data_ptr())
        return found[:nbytes]

    def _mapped(self, nbytes: int) -> Tensor:
        """A buffer made by every rank together, and the peers' buffers' addresses (``mapped``)."""
        with torch.cuda.device(self.device):  # made_together gathers over the group (NCCL: on the current device)
            buffer, theirs, mapping = mapped(self.group, self.device, nbytes, self.peers, self.shared_gpu,
                                             "a receive buffer of the ring")
        self.mapped[buffer.data_ptr()] = {r: t.data_ptr() for r, t in theirs.items()}
        self.kept[buffer.data_ptr()] = buffer, mapping
        return buffer

    def at_peer(self, t: Tensor, peer: int) -> Optional[int]:
        """The address at ``peer`` that corresponds to ``t`` (a view of one of these buffers:
        the same offset into that peer's buffer of the key); None where ``t`` is not one."""
        mapped = self.mapped.get(t.untyped_storage().data_ptr())
        return None if mapped is None else mapped[peer] + t.storage_offset() * t.element_size()  # t may be empty

    def nbytes(self) -> int:
        """The bytes of the buffers in use that torch's allocator does not count: in symmetric
        memory (where ranks share a GPU, torch allocates the buffers that CUDA IPC maps)."""
        return 0 if self.shared_gpu else sum(buffer.numel() for buffer, _ in self.kept.values())
