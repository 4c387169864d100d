"""The ring's point-to-point exchange: send to the rank ``shift`` ahead while receiving from
the one ``shift`` behind (the next and the previous rank by default; -1 the reverse).

Between the GPUs of one host the copy engines carry it (``peer``); elsewhere the process
group's batched P2P ops (NCCL, gloo)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels.merge import contiguous_rows
from . import peer


def capturing(t: Tensor) -> bool:
    """Whether work on ``t``'s device is being captured into a CUDA graph now."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def capture_error(t: Tensor, group) -> Optional[str]:
    """Why a ring call on ``t`` over ``group`` cannot run now, where it is being captured into
    a CUDA graph; None otherwise. One rank makes no transfer. Over several ranks the
    copy-engine transport's passes replay (``peer``), once an eager call has built it
    (capture cannot allocate its mailbox or rendezvous); the process group's P2P is not
    captured by ringflex."""
    if group is None or dist.get_world_size(group) == 1 or not capturing(t):
        return None
    if not peer.built(group):
        return ("a ring call over several ranks is captured in a CUDA graph only after an eager call on the "
                "same process group (it sets up the transfers, which capture cannot); run one before capturing")
    if peer.transport(group, t.device) is None:
        return (f"the ring's transfers go through the process group's P2P ({dist.get_backend(group)}), which "
                "ringflex does not capture in a CUDA graph; capture needs the copy-engine transport (every rank "
                "on one host, RINGFLEX_TRANSPORT=auto or copy-engine)")
    return None


class RingComm:
    """Sends to rank + shift and receives from rank - shift of ``group`` with batched P2P ops."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def peer(self, shift: int) -> int:
        """The global rank ``shift`` ranks after this one in the ring."""
        return dist.get_global_rank(self.group, (self.rank + shift) % self.world_size)

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], shift: int = 1,
                 send_after: Optional[torch.cuda.Event] = None):
        """Starts the transfer of ``send`` to the rank ``shift`` ahead while ``recv`` is filled
        from the rank ``shift`` behind (every rank makes the same call); call ``.wait()`` on
        the result before reading ``recv``, and ``join_sends`` before the caller writes into
        ``send``. Empty tensors do not travel (a block none of whose rows another rank reads).
        ``send`` may hold rows of a block (views): the copy engines read them in place, the
        process group's P2P a contiguous copy.

        It runs beside the compute launched meanwhile (NCCL and the copy engines use their own
        streams). It starts after the work queued so far on the current stream; over the copy
        engines the sends, where ``send_after`` (a CUDA event) is given, after that event
        instead: a block that was ready before the compute queued since then (the own K/V)
        leaves without waiting for it, nor for the blocks this rank waits to receive. The
        process group's P2P orders its sends after the current stream whatever is given.
        The result's ``sent`` is an event of the sends' end over the copy engines (None over
        the process group).
        """
        transport = self._copy_engines(send[0].device)
        if transport is not None:
            return transport.exchange(send, recv, shift, send_after)
        to, source = self.peer(shift), self.peer(-shift)
        send = [contiguous_rows(t) for t in send if t.numel()]  # P2P sends contiguous memory alone
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for t in recv if t.numel()]
        return _Pending(dist.batch_isend_irecv(ops) if ops else [], send)

    def sendable(self, t: Tensor) -> Tensor:
        """``t`` (rows of a block) as ``exchange`` sends it: itself over the copy engines, which
        read it in place, else a contiguous copy: made once, a tensor sent several times (the
        own block, at every step) is copied once."""
        return t if self._copy_engines(t.device) is not None else contiguous_rows(t)

    def receives_in_place(self, device) -> bool:
        """Whether ``receive_buffer`` serves ``device``: where the copy engines carry the ring.
        On a group's first call this builds the transport, a collective, which a rank whose
        call the ranks rejected never joins: ask only once the ranks agreed."""
        return self._copy_engines(device) is not None

    def receive_buffer(self, key, shape, dtype: torch.dtype, device) -> Tensor:
        """A tensor of ``shape`` and ``dtype``, the same memory for ``key`` at every call, that
        the copy engines fill in place (``inplace.ReceiveBuffers``; where ``receives_in_place``).
        Every rank asks for the same keys and shapes in the same order, after the ranks agreed
        on the call: the first ask makes it, with every rank."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self._copy_engines(device).receive_buffers.get(key, nbytes).view(dtype).view(shape)

    def _copy_engines(self, device) -> Optional[peer.PeerTransport]:
        """The copy-engine transport where it carries this ring's transfers on ``device``, else None."""
        return peer.transport(self.group, device) if device.type == "cuda" else None

    def join_sends(self, device) -> None:
        """Orders the current stream after every send issued so far: ``wait()`` orders it after
        the receive alone over the copy engines (the process group's P2P waits for both)."""
        transport = self._copy_engines(device)
        if transport is not None:
            transport.join_sends()

    def end_pass(self, device) -> None:
        """Ends a pass of the ring (a forward or a backward): the copy-engine transport leaves
        its flags as the pass found them, so that a CUDA graph can replay the pass (``peer``)."""
        transport = self._copy_engines(device)
        if transport is not None:
            transport.end_pass()


class _Pending:
    sent = None  # the process group orders its sends itself

    def __init__(self, works, sent_tensors):
        self.works = works
        self.sent_tensors = sent_tensors  # a send (gloo) reads them until it is waited for

    def wait(self):
        for w in self.works:
            w.wait()
