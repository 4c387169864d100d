"""Ring transfers between the GPUs of one host by their copy engines.

cuDNN's attention kernels are persistent: they hold every SM until they finish, so a
transfer that needs SMs (NCCL's kernels) starts only when the kernel beside it ends and
then sits on the critical path. A copy engine needs no SM, so its transfer runs beside the
kernel and adds little to it.

Each rank owns a mailbox in symmetric memory (``torch.distributed._symmetric_memory``; where
ranks share a GPU, which it refuses, one mapped by CUDA IPC: ``mapped``): for each channel, ``SLOTS``
slots of ``SLOT_BYTES`` and their flags. A channel carries the transfers of one shift: to the
next rank, to the previous one, and to each rank further away (a block goes straight from
its owner to every rank that reads it, a dK/dV share straight back): ``max(2, world - 1)`` channels. A transfer moves in
chunks of at most a slot, copied by the driver's ``cuMemcpyAsync``; rows of a block (a view
whose heads lie a block apart) are read in place by its 2-D copy (``layout``), so no pass on
the SMs gathers them first. The sender waits until
the slot is FREE, copies the chunk into the receiver's mailbox and raises the slot's READY
flag there; the receiver waits for READY, copies the chunk out into its own tensor and raises
FREE at the sender. Flags are written and awaited by CUDA stream memory operations (the
driver's cuStreamWriteValue32 and cuStreamWaitValue32), so no host thread and no SM takes
part, and a rank waits only on flags in its own memory. Every rank makes the same transfers in the same order, so both
ends of a channel count the chunks of a pass of the ring (a forward or a backward) alike:
chunk ``c`` uses slot ``c % SLOTS``, and its flags carry the mark of the slot's use in the
pass, ``MARKS[(c // SLOTS) % 2]``: a wait looks for that mark, so it is passed by the flag
of this use and not of the one before. A pass ends (``end_pass``) by using once more, with
no data, each slot it used an odd number of times, which leaves every flag as the pass
found it: a CUDA graph that captured a pass replays the very same marks on flags in the
state they expect, and eager calls and replays can follow each other in any order. These
waits have no timeout, so a rank that marks the ring failed (``fault.fail``) releases them
(``release``).

The receiver's copy out of its mailbox is a copy within one GPU, which the driver runs on
the SMs: it waits for the attention kernel that holds them, and the next step's kernel
waits for it. So the ring's K/V blocks and dK/dV shares are received in place, into buffers
that the senders map (``inplace``). The receiver raises CLEAR at the sender once the work
queued before the receive (the kernels that read the buffer's previous block) is done; the
sender waits for it, copies straight into the receiver's buffer and raises DONE there; the
receiver waits for DONE. Both ends count these handshakes per channel, and their flags
alternate marks as the slots' do.

An arrival orders the compute stream after the receive only. A send completes when the
peer has copied the chunks out of its mailbox, which its device-local copies do only once
its own kernel releases the SMs; ordering after it too would make each rank wait for its
neighbour's kernel. So a sent tensor's memory is kept from reuse by ``record_stream`` on
the send stream, a receive into memory that a send still reads waits for that send, and
``join_sends`` orders the compute stream after every send where the caller's own tensors
went out (the end of a forward, whose first send is the caller's K/V). Under CUDA-graph
capture ``end_pass`` also joins the transport's streams into the capturing one, as a graph
must join every stream it forked.

``RINGFLEX_TRANSPORT`` chooses: ``auto`` (default; copy engines when every rank of the
group is on one host with CUDA tensors and symmetric memory, else the process group's P2P
with a one-time warning), ``copy-engine`` (an error where it cannot run) or ``nccl``.
"""
from __future__ import annotations

import importlib
import socket
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import config
from ..config import warn_once
from .driver import Driver
from .groups import gather_objects
from .inplace import ReceiveBuffers
from .mapped import mapped
from .streams import current_stream

SLOT_BYTES = 32 << 20
SLOTS = 4  # per channel: 128 MiB of mailbox per rank and channel
_FLAGS_BYTES = 4096
_READY, _FREE = 0, 1
_CLEAR, _DONE = 2, 3  # a transfer into the receiver's own buffer: its flags, one pair per channel
MARKS = (1, 2)  # a slot's flag after its even / odd uses in a pass; it starts as after an odd one
_RELEASED = MARKS[0] | MARKS[1]  # passes every wait (see ``release``)
_TRANSPORTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> PeerTransport or None


def chunks(nbytes: int) -> List[Tuple[int, int]]:
    """(start, end) byte ranges of at most a slot that cover ``nbytes``."""
    return [(start, min(start + SLOT_BYTES, nbytes)) for start in range(0, nbytes, SLOT_BYTES)]


def layout(t: Tensor) -> Optional[Tuple[int, int]]:
    """``t``'s memory as rows of contiguous bytes evenly apart, (bytes a row, pitch), which a
    send reads in place; None where it is not (a copy is sent). A contiguous tensor is one row;
    rows ``a:b`` of a [B, H, L, D] block (dim 2), a row of ``(b - a) * D`` elements per batch
    and head."""
    size = t.element_size()
    if t.is_contiguous():
        return t.numel() * size, t.numel() * size
    if t.dim() != 4 or t.stride(3) != 1 or t.stride(2) != t.shape[3]:
        return None
    if t.shape[1] > 1 and t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        return None
    width, pitch = t.shape[2] * t.shape[3] * size, t.stride(1 if t.shape[1] > 1 else 0) * size
    return (width, pitch) if pitch >= width else None  # heads that overlap (expanded): a copy


def _readable(t: Tensor) -> Tuple[Tensor, Tuple[int, int]]:
    """``t`` and its ``layout``, or where a send cannot read it in place a contiguous copy and
    that copy's."""
    found = layout(t)
    if found is None:
        t = t.contiguous()
        found = layout(t)
    return t, found


def pieces(start: int, end: int, width: int, pitch: int) -> List[Tuple[int, int, int]]:
    """The copies that bring bytes ``start:end`` of memory laid out as rows of ``width`` bytes,
    ``pitch`` apart (``layout``), into contiguous memory, in order: (offset of the source,
    rows, bytes a row). A part of one row is a row of its own; whole rows go in one copy
    (the driver's 2-D copy), or one row where they are contiguous."""
    if width == pitch:
        return [(start, 1, end - start)] if end > start else []
    found = []
    while start < end:
        row, column = divmod(start, width)
        if column or end - start < width:
            n = min(width - column, end - start)
            found.append((row * pitch + column, 1, n))
        else:
            count = (end - start) // width
            found.append((row * pitch, count, width))
            n = count * width
        start += n
    return found


def slot_of(chunk: int) -> Tuple[int, int]:
    """The slot of the ``chunk``-th chunk of a pass in one channel, and the mark its flags carry."""
    return chunk % SLOTS, MARKS[(chunk // SLOTS) % 2]


def other(mark: int) -> int:
    """The mark of a slot's previous use: the FREE flag a sender waits for."""
    return MARKS[mark == MARKS[0]]


def odd_slots(chunks: int) -> List[int]:
    """The slots that ``chunks`` chunks of a pass used an odd number of times."""
    return [s for s in range(SLOTS) if len(range(s, chunks, SLOTS)) % 2]


def channel_shifts(world_size: int) -> List[int]:
    """The shift each channel carries: +1 and -1 (the ring's two directions), then 2 to
    ``world_size - 2`` (the ranks further away)."""
    return [1, -1] + list(range(2, world_size - 1))


def channel_of(shift: int, world_size: int) -> int:
    """The channel of transfers to rank + ``shift``: +1 and -1 keep their own (on two ranks
    both reach the other rank), another shift s (mod the world) takes channel s, where
    ``world_size - 1`` is -1's and 1 is +1's."""
    if shift in (1, -1):
        return int(shift == -1)
    s = shift % world_size
    if s == 0:
        raise ValueError("ringflex: a rank does not send to itself")
    return {1: 0, world_size - 1: 1}.get(s, s)


class PeerTransport:
    """The ring's exchange over copy engines and a mailbox per rank that the other ranks map
    (see module). ``shared_gpu``: some ranks share a GPU, where CUDA IPC maps the mailboxes and
    receive buffers, which torch's symmetric memory refuses to (``mapped``)."""

    def __init__(self, group, device: torch.device, shared_gpu: bool = False):
        self.device, self.driver = device, Driver()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.size = size
        # channel c sends to rank + shifts[c] and receives from rank - shifts[c]
        self.shifts = channel_shifts(size)
        self.to = [(rank + shift) % size for shift in self.shifts]
        self.source = [(rank - shift) % size for shift in self.shifts]
        total = _FLAGS_BYTES + len(self.shifts) * SLOTS * SLOT_BYTES
        self.mailbox, self.peer_mailbox, self._mapping = mapped(group, device, total, self.to, shared_gpu,
                                                                 "the copy engines' mailboxes")
        self.mailbox[:_FLAGS_BYTES].view(torch.int32).fill_(MARKS[1])  # as after an odd use
        torch.cuda.synchronize(device)
        gather_objects(group, None)  # no rank raises a flag in a mailbox before its owner has set them
        self.base = {r: mailbox.data_ptr() for r, mailbox in (*self.peer_mailbox.items(), (rank, self.mailbox))}
        self.rank = rank
        self.streams = [(torch.cuda.Stream(device), torch.cuda.Stream(device)) for _ in self.shifts]  # (send, recv)
        self.sent, self.received = [0] * len(self.shifts), [0] * len(self.shifts)  # chunks of the pass, per channel
        self.handed, self.taken = [0] * len(self.shifts), [0] * len(self.shifts)  # transfers in place, per channel
        self.receive_buffers = ReceiveBuffers(group, device, self.to, shared_gpu)  # filled in place (``inplace``)
        # storage address -> the event of the last send that reads it; eager sends, and those
        # of the pass being captured (its events mean nothing outside the graph)
        self.sending, self.sending_captured = {}, {}
        self.captured = False  # whether a pass was captured in a CUDA graph (see ``end_pass``)

    def _slot(self, owner: int, channel: int, slot: int) -> int:
        """The address of a slot of ``owner``'s mailbox."""
        return self.base[owner] + _FLAGS_BYTES + (channel * SLOTS + slot) * SLOT_BYTES

    def _flag(self, owner: int, kind: int, channel: int, slot: int) -> int:
        return self.base[owner] + 4 * ((kind * len(self.shifts) + channel) * SLOTS + slot)

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], shift: int = 1,
                 send_after: Optional[torch.cuda.Event] = None):
        """Sends ``send`` to rank + ``shift`` while ``recv`` is filled from rank - ``shift``; the
        copies start once the work queued so far on the current stream is done (the sends,
        where ``send_after`` is given, once that event is). ``wait()`` on the result orders the
        current stream after them."""
        channel = channel_of(shift, self.size)
        into = self._in_place(channel, send, recv)  # None: through the mailbox
        send = [_readable(t) for t in send if t.numel()]  # (tensor, its layout)
        recv = [t for t in recv if t.numel()]
        if any(not t.is_contiguous() for t in recv):
            raise ValueError("ringflex: a receive buffer of the copy-engine transport must be contiguous")
        sending = self._sending()
        queued = current_stream(self.device).record_event()
        send_stream, recv_stream = self.streams[channel]
        recv_stream.wait_event(queued)
        for event in self._still_sending(sending, recv):
            recv_stream.wait_event(event)
        if into is not None:
            self._clear(recv_stream.cuda_stream, channel)
            self._take(recv_stream.cuda_stream, channel)
        for t in recv if into is None else ():
            self._receive(recv_stream.cuda_stream, channel, t)
        received = recv_stream.record_event()
        send_stream.wait_event(queued if send_after is None else send_after)
        if into is not None:
            self._hand(send_stream.cuda_stream, channel, [(*sent, a) for sent, a in zip(send, into)])
        for t, rows_of_t in send if into is None else ():
            self._send(send_stream.cuda_stream, channel, t, rows_of_t)
        sent = send_stream.record_event()
        for t, _ in send:
            t.record_stream(send_stream)  # its memory is not reused before the send has read it
            sending.pop(_storage(t), None)  # kept in the order the sends were issued
            sending[_storage(t)] = sent
        return _Arrival(self.device, received, sent)

    def _in_place(self, channel: int, send: Sequence[Tensor], recv: Sequence[Tensor]) -> Optional[List[int]]:
        """Where ``recv`` lies in receive buffers (``inplace``): for each tensor of ``send`` that
        holds any bytes, the address in the receiver's buffer of the same key, where the
        receiver's counterpart of it lies (every rank receives a step's block into the buffers
        of the same keys, so both ends decide alike). None where the mailbox carries the transfer."""
        if len(send) != len(recv):
            return None
        found = [self.receive_buffers.at_peer(t, self.to[channel]) for t in recv]
        return None if None in found else [a for t, a in zip(send, found) if t.numel()]

    def _sending(self) -> dict:
        """The sends that memory may still be read by, as the current stream sees them."""
        return self.sending_captured if torch.cuda.is_current_stream_capturing() else self.sending

    def _still_sending(self, sending: dict, tensors: Sequence[Tensor]) -> List[torch.cuda.Event]:
        """The sends that may still read the memory of ``tensors``."""
        self._forget_finished(sending)
        return [sending[a] for a in {_storage(t) for t in tensors} if a in sending]

    def _forget_finished(self, sending: dict) -> None:
        """Forgets finished eager sends, oldest first up to the first unfinished one, so a host
        that runs ahead of the GPU does not query every send in flight at each exchange (a
        captured event cannot be queried, and its pass joins it anyway)."""
        if sending is self.sending:
            while sending:
                address, event = next(iter(sending.items()))
                if not event.query():
                    break
                del sending[address]

    def join_sends(self) -> None:
        """Orders the current stream after every send issued so far."""
        stream = current_stream(self.device)
        sending = self._sending()
        self._forget_finished(sending)
        for event in set(sending.values()):
            stream.wait_event(event)

    def end_pass(self) -> None:
        """Ends a pass of the ring: each slot used an odd number of times is used once more,
        with no data, and so is each channel's handshake of transfers in place, so every flag
        is back as the pass found it, and the next pass counts its chunks from 0 (see the
        module). Under capture the current stream then waits for the transport's streams,
        which the graph must join. Once a pass was captured, an
        eager pass also orders the current stream after its receives' uses without data: a
        slot's READY flag holds its first use's mark until then, which a replay, running on
        other streams than the transport's, would take for its own first chunk."""
        capturing = torch.cuda.is_current_stream_capturing()
        self.captured |= capturing
        for channel, (send_stream, recv_stream) in enumerate(self.streams):
            for stream, count, chunk, handshakes, handshake in (
                    (send_stream, self.sent, self._send_chunk, self.handed, [self._hand]),
                    (recv_stream, self.received, self._receive_chunk, self.taken, [self._clear, self._take])):
                if count[channel] == handshakes[channel] == 0:
                    continue  # this pass left the channel's streams alone
                for slot in odd_slots(count[channel]):
                    chunk(stream.cuda_stream, channel, slot, MARKS[1])  # an odd use of the slot
                for half in handshake if handshakes[channel] % 2 else ():
                    half(stream.cuda_stream, channel)  # an odd handshake, without data
                count[channel] = handshakes[channel] = 0
                if capturing or (self.captured and stream is recv_stream):
                    current_stream(self.device).wait_stream(stream)
        if capturing:
            self.sending_captured.clear()

    def _send(self, stream: int, channel: int, data: Tensor, rows_of_data: Tuple[int, int]) -> None:
        """``data`` sent a slot at a time, read in place as ``rows_of_data`` (its ``layout``): each
        chunk of its bytes, as they lie contiguous, numbered in ``sent`` as the receiver numbers it."""
        address, (width, pitch) = data.data_ptr(), rows_of_data
        for start, end in chunks(data.numel() * data.element_size()):
            copies = [(address + offset, rows, nbytes) for offset, rows, nbytes in pieces(start, end, width, pitch)]
            self._send_chunk(stream, channel, *slot_of(self.sent[channel]), copies, pitch)
            self.sent[channel] += 1

    def _receive(self, stream: int, channel: int, data: Tensor) -> None:
        """``data`` (contiguous) filled a slot at a time, each chunk numbered in ``received``."""
        address = data.data_ptr()
        for start, end in chunks(data.numel() * data.element_size()):
            self._receive_chunk(stream, channel, *slot_of(self.received[channel]), address + start, end - start)
            self.received[channel] += 1

    def _send_chunk(self, stream: int, channel: int, slot: int, mark: int, copies=(), pitch: int = 0) -> None:
        """Waits until the receiver has copied out the slot's previous use, fills it by
        ``copies`` (``pieces`` at their addresses, rows ``pitch`` apart; none: a use without
        data) and raises READY at the receiver."""
        to = self.to[channel]
        self.driver.wait(stream, self._flag(self.rank, _FREE, channel, slot), other(mark))
        self._copy(stream, self._slot(to, channel, slot), copies, pitch)
        self.driver.write(stream, self._flag(to, _READY, channel, slot), mark)

    def _copy(self, stream: int, destination: int, copies, pitch: int) -> None:
        """Copies ``copies`` (``pieces`` at their addresses, rows ``pitch`` apart) one after
        another into contiguous memory at ``destination``."""
        for source, rows, nbytes in copies:
            if rows == 1:
                self.driver.copy(stream, destination, source, nbytes)
            else:
                self.driver.copy_rows(stream, destination, source, pitch, nbytes, rows)
            destination += rows * nbytes

    def _receive_chunk(self, stream: int, channel: int, slot: int, mark: int, destination: int = 0,
                       nbytes: int = 0) -> None:
        """Waits for READY, copies ``nbytes`` of the slot out to address ``destination`` (if any)
        and raises FREE at the sender."""
        self.driver.wait(stream, self._flag(self.rank, _READY, channel, slot), mark)
        if nbytes:
            self.driver.copy(stream, destination, self._slot(self.rank, channel, slot), nbytes)
        self.driver.write(stream, self._flag(self.source[channel], _FREE, channel, slot), mark)

    def _hand(self, stream: int, channel: int, copies=()) -> None:
        """Waits until the receiver is CLEAR (its buffer's previous block read), copies each
        (tensor, its layout, address) straight into the receiver's buffer at that address
        and raises DONE there; none: a handshake without data."""
        to, mark = self.to[channel], MARKS[self.handed[channel] % 2]
        self.driver.wait(stream, self._flag(self.rank, _CLEAR, channel, 0), mark)
        for t, (width, pitch), destination in copies:
            self._copy(stream, destination, [(t.data_ptr() + offset, rows, nbytes) for offset, rows, nbytes
                                             in pieces(0, t.numel() * t.element_size(), width, pitch)], pitch)
        self.driver.write(stream, self._flag(to, _DONE, channel, 0), mark)
        self.handed[channel] += 1

    def _clear(self, stream: int, channel: int) -> None:
        """Raises CLEAR at the sender: the work queued before it on this stream is done."""
        self.driver.write(stream, self._flag(self.source[channel], _CLEAR, channel, 0),
                          MARKS[self.taken[channel] % 2])

    def _take(self, stream: int, channel: int) -> None:
        """Waits for the sender's DONE: the block is then in the receive buffer."""
        self.driver.wait(stream, self._flag(self.rank, _DONE, channel, 0), MARKS[self.taken[channel] % 2])
        self.taken[channel] += 1

    def release(self) -> None:
        """Raises every flag this rank's and its peers' streams may wait on (see ``release``)."""
        with torch.cuda.stream(torch.cuda.Stream(self.device)):  # the transport's streams may be blocked
            for mailbox in (self.mailbox, *self.peer_mailbox.values()):
                mailbox[:_FLAGS_BYTES].view(torch.int32).fill_(_RELEASED)


def release(group) -> None:
    """After ``group`` failed: releases the GPU streams of this rank and its peers that
    wait for a transfer which will not come, so no GPU stays blocked (there is no timeout on
    these waits). What the released copies then deliver is garbage; every rank raises
    ``RingFailure`` at its next call on the group (``fault``)."""
    transport = _TRANSPORTS.get(group)
    if transport is not None:
        transport.release()


def receive_bytes(device: torch.device) -> int:
    """The bytes of the receive buffers (``inplace``) of every transport on ``device``, which
    torch's allocator does not count."""
    return sum(t.receive_buffers.nbytes() for t in _TRANSPORTS.values() if t is not None and t.device == device)


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Arrival:
    def __init__(self, device: torch.device, received: torch.cuda.Event, sent: torch.cuda.Event):
        self.device, self.received, self.sent = device, received, sent

    def wait(self) -> None:
        """Orders the current stream after the receive (not the send: see the module)."""
        current_stream(self.device).wait_event(self.received)


def transport(group, device: torch.device) -> Optional[PeerTransport]:
    """The copy-engine transport of ``group`` (built once, by every rank together), or None
    where the ring uses the process group's P2P. See the module for ``RINGFLEX_TRANSPORT``."""
    if group in _TRANSPORTS:
        return _TRANSPORTS[group]
    wanted = config.TRANSPORT.value()
    found = None
    if wanted != "nccl":
        with torch.cuda.device(device):
            ranks = gather_objects(group, (socket.gethostname(), local_reason(device), _uuid(device)))
            why = _why_not(group, device, ranks)
            if why is None:
                try:
                    found = PeerTransport(group, device, shared_gpu=len({uuid for *_, uuid in ranks}) < len(ranks))
                except (RuntimeError, TypeError, AttributeError) as e:  # alike on every rank: an older torch, or
                    # a rank out of memory for its mailbox (``made_together``)
                    why = f"the ranks' mailboxes could not be mapped ({e})"
        if why is not None and wanted == "copy-engine":
            raise RuntimeError(f"ringflex: RINGFLEX_TRANSPORT=copy-engine cannot be used: {why}")
        if why is not None:
            warn_once(f"ringflex: the ring's transfers go through the process group's P2P "
                      f"({dist.get_backend(group)}), not the copy engines: {why}")
    _TRANSPORTS[group] = found
    return found


def built(group) -> bool:
    """Whether ``transport`` has decided, for ``group``, what carries its ring."""
    return group in _TRANSPORTS


def in_use(group, device: torch.device) -> str:
    """What carries the ring's transfers on ``group``: "copy-engine" or the process group's backend."""
    if device.type == "cuda" and transport(group, device) is not None:
        return "copy-engine"
    return str(dist.get_backend(group))


def _why_not(group, device: torch.device, ranks) -> Optional[str]:
    """Why the copy engines cannot carry this group's ring (the same answer on every rank), or
    None; ``ranks``: every rank's (host, ``local_reason``, GPU uuid)."""
    if len({host for host, _, _ in ranks}) > 1:
        return "the ranks are on more than one host"
    for r, (_, reason, _) in enumerate(ranks):
        if reason:
            return f"rank {r}: {reason}"
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    peers = {ranks[r][2] for r in range(size) if r != rank}
    local = {_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
    blocked = [u for u in peers if u in local and local[u] != device.index
               and not torch.cuda.can_device_access_peer(device.index, local[u])]
    verdicts = gather_objects(group, bool(blocked))
    if any(verdicts):
        return f"rank {verdicts.index(True)} cannot access another rank's GPU memory (no peer access)"
    return None


def local_reason(device: torch.device) -> Optional[str]:
    """Why this process cannot use the copy-engine transport on ``device``, or None."""
    if device.type != "cuda":
        return "the tensors are not on a GPU"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
        from torch._C._distributed_c10d import _SymmetricMemory
        del _SymmetricMemory  # only whether this torch has it
    except ImportError as e:
        return f"this torch has no symmetric memory ({e})"
    try:
        Driver()
    except (OSError, AttributeError) as e:
        return f"the CUDA driver's stream memory operations are not available ({e})"
    return None


def _uuid(device: torch.device) -> Optional[str]:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
