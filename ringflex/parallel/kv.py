"""The K/V blocks of a ring pass, one per step: brought from their owners (``KVStream``: each
transfer sends this rank's own block to the rank as far ahead, so every rank serves its
readers), or held from forward (``HeldBlocks``: backward where forward kept every block it
received). ``call`` is a ``ring.RingCall``: its agreed reads say which rows travel."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..kernels.merge import Rows, rows
from .compute import leading_rows
from .streams import current_stream, on_stream


class KVStream:
    """The K/V block of each step: ``first``, then blocks received into two buffers that
    alternate (made by the first two transfers; a block is never overwritten while it is still
    being read; over the copy engines, buffers that the senders fill in place, the same at every
    call: ``inplace``), and for the last step ``last``, where the rank holds that block already:
    then the ring skips the transfer that would bring it. Each transfer brings the next step's
    block from its owner, to which this rank sends its own block (``own``: ``first`` forward,
    ``last`` backward) at the same distance, so every send reads the own block's rows (in place
    over the copy engines; over the process group's P2P, a copy made once per range of rows).
    A received block holds only the rows of it that travel (``RingCall.rows_held``), in the
    leading memory of a buffer sized for a whole block; a step that brings the rows of several
    ranks (``RingCall.pieces``) receives each into a buffer and joins them into one block. The
    number of steps is read when the first transfer starts: forward may shorten the schedule
    once the ranks agree. Where forward keeps every block it receives (``RingCall.keeps``),
    each transfer has a buffer of its own (of the rows it brings, where the buffers are not the
    senders' to fill), and the blocks are ``received``, in order."""

    def __init__(self, call, first, last=None, reverse: bool = False):
        self.call, self.reverse, self.last = call, reverse, last
        self.current, self.own = first, last if reverse else first
        self.shapes = [t.shape for t in self.own]  # the own block, whole
        self.offset = self.rows(0)[0]  # the first row of the block that ``current`` holds
        self.buffers = []
        self.in_place = False  # whether the senders fill the buffers: asked at the first transfer (``start``)
        # A transfer starts only after the work queued before it on the current stream. The
        # first one is issued after the own block's compute is queued (forward waits for the
        # argument check there), so it goes from a stream that waits for the inputs alone and
        # still overlaps that compute; what it receives into is ``allocated_beside`` it.
        # Every later send of the own block waits for that stream too (``own_ready``), not for
        # the compute queued since nor for the blocks this rank waits to receive: otherwise a
        # rank's send waits for its previous receive, and the transfers of a step follow those
        # of the step before around the whole ring instead of running beside them. Each send
        # also waits for the one before it (its ``sent`` event): the sends share the copy
        # engines and the link, so side by side each would end as late as the last, while one
        # after another the nearest rank, which reads the block first, has it first.
        self.first_stream, self.own_sent, self.own_ready, self.joined = None, {}, None, False
        self.received = []
        if self.transfers > 0:
            k = first[0]
            if k.is_cuda:
                self.first_stream = first_stream(k.device)
                self.first_stream.wait_stream(current_stream(k.device))
                self.own_ready = self.first_stream.record_event()

    def _add_buffer(self, n: Optional[int] = None, beside: Optional[torch.cuda.Stream] = None):
        """A buffer for a whole block, or for ``n`` rows (a block forward keeps: no larger than it),
        ``allocated_beside`` the compute where ``beside`` (the first transfer's stream) is given."""
        if self.in_place:  # the same memory at every call, which the senders fill (``inplace``)
            index = len(self.buffers)
            self.buffers.append(tuple(self.call.comm.receive_buffer(("block", index, i), t.shape, t.dtype, t.device)
                                      for i, t in enumerate(self.own)))
            return
        self.buffers.append(allocated_beside(beside, lambda: tuple(
            torch.empty((*t.shape[:2], t.shape[2] if n is None else n, *t.shape[3:]), dtype=t.dtype, device=t.device)
            for t in self.own)))

    @property
    def steps(self) -> int:
        return len(self.call.schedule)

    @property
    def transfers(self) -> int:
        return self.steps - 1 - (self.last is not None and self.steps > 1)

    def _forward_step(self, step: int) -> int:
        return self.steps - 1 - step if self.reverse else step

    def rows(self, step: int) -> Rows:
        """Which rows of its block the stream holds at ``step`` (the own block: all)."""
        return self.call.rows_held(self._forward_step(step), self.shapes[0][2])

    def local(self, r: Rows) -> Rows:
        """Rows ``r`` of a block as rows of what ``current`` holds of it."""
        return r[0] - self.offset, r[1] - self.offset

    def keys(self, r: Rows):
        """The current block's keys and values at its rows ``r``."""
        return tuple(rows(t, self.local(r)) for t in self.current)

    def start(self, step: int):
        """Starts bringing the next step's block from its owners, while the own block goes to
        the ranks as far ahead; the block arrives in ``advance``."""
        if step >= self.transfers:
            return None
        if step == 0:  # the ranks agreed: a group's first pass builds its transport here, with every rank
            self.in_place = self.call.comm.receives_in_place(self.own[0].device)
        length = self.shapes[0][2]
        pieces = self.call.pieces(self._forward_step(step + 1), length)
        if step > 0 and self.first_stream is not None and not self.joined:  # the own rows sent were made there
            current_stream(self.first_stream.device).wait_stream(self.first_stream)
            self.joined = True
        slots = range(self._slot(step), self._slot(step) + len(pieces))
        first = self.first_stream if step == 0 else None
        for slot, (_, (lo, hi), _) in zip(slots, pieces):
            if len(self.buffers) <= slot:
                self._add_buffer(hi - lo if self.keeps else None, beside=first)
        transfers, sent, received = [], [], []
        with on_stream(first):
            for slot, (distance, (lo, hi), _) in zip(slots, pieces):
                own_rows = self.call.rows_sent(distance, length)
                if own_rows not in self.own_sent:
                    self.own_sent[own_rows] = tuple(self.call.comm.sendable(rows(t, own_rows)) for t in self.own)
                sent.append(self.own_sent[own_rows])
                received.append(tuple(leading_rows(b, hi - lo) for b in self.buffers[slot]))
                transfers.append(self.call.comm.exchange(sent[-1], received[-1], shift=distance,
                                                         send_after=self.own_ready))
                if transfers[-1].sent is not None:
                    self.own_ready = transfers[-1].sent
        return transfers, sent, received, self.rows(step + 1)[0]

    @property
    def keeps(self) -> bool:
        """Whether forward keeps the blocks it receives (``RingCall.keeps``: known once the ranks agreed)."""
        return not self.reverse and self.call.keeps

    def _slot(self, step: int) -> int:
        """The buffer the transfer of ``step`` fills."""
        return step if self.keeps else step % 2

    def close(self) -> None:
        """Ends the stream's pass: the current stream joins the first transfer's stream (a CUDA
        graph being captured must join every stream it forked) and the transport ends its pass."""
        if self.first_stream is not None:
            current_stream(self.first_stream.device).wait_stream(self.first_stream)
        if self.call.comm is not None:
            self.call.comm.end_pass(self.current[0].device)

    @property
    def received_in_place(self) -> bool:
        """Whether the blocks ``received`` lie in receive buffers that the next call fills (not
        where several ranks' rows were joined into a block of its own)."""
        return self.in_place and all(len(self.call.distances_at(s)) == 1 for s in range(self.steps))

    def advance(self, step: int, pending) -> None:
        if pending is not None:
            transfers, _, received, self.offset = pending  # the sends stay referenced until here
            for transfer in transfers:
                transfer.wait()
            self.current = received[0] if len(received) == 1 else \
                tuple(torch.cat(pieces, dim=2) for pieces in zip(*received))
            if self.keeps:
                self.received.append(self.current)
        elif step + 2 == self.steps and self.last is not None:
            self.current, self.offset = self.last, 0


_FIRST_STREAMS: Dict[int, torch.cuda.Stream] = {}  # device index -> the stream first transfers leave from


def first_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a pass's first transfer leaves from on ``device``: the same for every call.
    torch's caching allocator keeps the memory freed on a stream for that stream: on a stream
    taken new for each call (from torch's pool of 32) what is allocated there (a loan's receive
    buffer) would meet no cached memory of its own and take a new device allocation at every
    call, host time each, and memory reserved until every stream of the pool holds some."""
    if device.index not in _FIRST_STREAMS:
        _FIRST_STREAMS[device.index] = torch.cuda.Stream(device)
    return _FIRST_STREAMS[device.index]


def allocated_beside(stream: Optional[torch.cuda.Stream], make):
    """``make()``'s tensors, for a transfer from ``stream`` (a pass's first, which runs beside the
    compute queued on the current stream) to receive into: allocated on ``stream``, as its receive
    waits only for the work queued there (memory that compute's temporaries were freed from, which
    the GPU may still be using, is then not handed to it), and kept from reuse until the current
    stream, which reads them, is done with them too. ``stream`` None: ``make()`` as it is."""
    if stream is None:
        return make()
    reads_on = current_stream(stream.device)
    with on_stream(stream):
        made = make()
    for t in made:
        t.record_stream(reads_on)
    return made


class HeldBlocks:
    """Backward's blocks where forward kept every block it received (``RingCall.keeps_received``):
    each step's block is at hand, so backward moves no K/V and waits for dK/dV shares alone.
    ``held[i]``: the block of forward step i (0: the own block), as ``KVStream`` held it."""

    def __init__(self, call, held: List[Tuple[Tensor, Tensor]]):
        self.call, self.held, self.step = call, held, 0

    def start(self, step: int) -> None:
        return None

    def advance(self, step: int, pending) -> None:
        self.step = step + 1

    def keys(self, r: Rows):
        """The keys and values at rows ``r`` of the current step's block."""
        forward_step = len(self.held) - 1 - self.step
        offset = self.call.rows_held(forward_step, self.held[0][0].shape[2])[0]
        return tuple(rows(t, (r[0] - offset, r[1] - offset)) for t in self.held[forward_step])

    def close(self) -> None:
        if self.call.comm is not None:
            self.call.comm.end_pass(self.held[0][0].device)


def saved(received: Tensor, in_place: bool) -> Tensor:
    """A received block as saved for backward: out of the receive buffer where the next call
    fills it (received in place), else ``_compact``."""
    return received.clone() if in_place else _compact(received)


def _compact(received: Tensor) -> Tensor:
    """A received block in memory of its own size where that frees more than half of the
    whole-block buffer it fills part of (the rows a window reads over the contiguous layout),
    which saving the view would keep alive: in a model, once per attention layer until its
    backward. The copy is a pass on the SMs, so a block half the buffer (zigzag, causal) stays."""
    if received.untyped_storage().nbytes() > 2 * received.numel() * received.element_size():
        return received.clone()
    return received
