"""The copy-engine transport's bookkeeping, on CPU (tests/gpu/test_peer_transport.py moves bytes)."""
import ctypes
import inspect

import pytest
import torch

from ringflex.parallel import peer
from ringflex.parallel.inplace import ReceiveBuffers


def test_chunks_cover_a_transfer_in_slots():
    assert peer.chunks(0) == []
    assert peer.chunks(5) == [(0, 5)]
    n = 2 * peer.SLOT_BYTES + 7
    spans = peer.chunks(n)
    assert spans == [(0, peer.SLOT_BYTES), (peer.SLOT_BYTES, 2 * peer.SLOT_BYTES), (2 * peer.SLOT_BYTES, n)]


def test_slots_are_reused_in_turn_with_alternating_marks():
    seen = [peer.slot_of(c) for c in range(2 * peer.SLOTS + 1)]
    first, second = peer.MARKS
    assert [s for s, _ in seen] == list(range(peer.SLOTS)) * 2 + [0]
    assert [m for _, m in seen] == [first] * peer.SLOTS + [second] * peer.SLOTS + [first]
    assert peer.other(first) == second and peer.other(second) == first
    assert peer.odd_slots(0) == [] and peer.odd_slots(2 * peer.SLOTS) == []
    assert peer.odd_slots(peer.SLOTS + 1) == list(range(1, peer.SLOTS))


class _Flags:
    """The driver's flag operations on a dict (every flag starts as the mailbox's does): a
    wait must already hold when it is issued (the simulation below runs every rank's
    operations in an order where it should)."""

    def __init__(self):
        self.values = {}

    def write(self, stream: int, address: int, value: int) -> None:
        self.values[address] = value

    def wait(self, stream: int, address: int, mark: int) -> None:
        assert self.values.get(address, peer.MARKS[1]) & mark, (address, mark)  # as the driver's AND wait

    def copy(self, stream: int, destination: int, source: int, nbytes: int) -> None:
        ctypes.memmove(destination, source, nbytes)  # the mailboxes are CPU tensors here

    def copy_rows(self, stream: int, destination: int, source: int, pitch: int, width: int, rows: int) -> None:
        for row in range(rows):
            ctypes.memmove(destination + row * width, source + row * pitch, width)


def _ranks(world_size: int):
    """One PeerTransport per simulated rank, their mailboxes plain CPU tensors they share."""
    flags = _Flags()
    shifts = peer.channel_shifts(world_size)
    total = peer._FLAGS_BYTES + len(shifts) * peer.SLOTS * peer.SLOT_BYTES
    mailboxes = [torch.zeros(total, dtype=torch.uint8) for _ in range(world_size)]
    ranks = []
    for r in range(world_size):
        t = object.__new__(peer.PeerTransport)
        t.driver, t.rank, t.mailbox, t.size, t.shifts = flags, r, mailboxes[r], world_size, shifts
        t.to = [(r + s) % world_size for s in shifts]
        t.source = [(r - s) % world_size for s in shifts]
        t.peer_mailbox = {p: mailboxes[p] for p in t.to}
        t.base = {p: mailboxes[p].data_ptr() for p in range(world_size)}
        t.sent, t.received = [0] * len(shifts), [0] * len(shifts)
        t.handed, t.taken = [0] * len(shifts), [0] * len(shifts)
        t.device, t.receive_buffers = torch.device("cpu"), ReceiveBuffers(None, torch.device("cpu"), t.to)
        ranks.append(t)
    return ranks


def _exchange_all(ranks, shift: int, sizes, g):
    """Every rank sends chunks of ``sizes`` bytes to the rank ``shift`` ahead, then every rank
    receives; returns whether each received what its source sent."""
    channel = peer.channel_of(shift, len(ranks))
    sends = [[torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes] for _ in ranks]
    recvs = [[torch.empty(n, dtype=torch.uint8) for n in sizes] for _ in ranks]
    for t, send in zip(ranks, sends):
        for data in send:
            t._send(0, channel, data, peer.layout(data))
    for t, recv in zip(ranks, recvs):
        for data in recv:
            t._receive(0, channel, data)
    sources = [(r - shift) % len(ranks) for r in range(len(ranks))]
    return [all(torch.equal(got, sent) for got, sent in zip(recv, sends[source]))
            for recv, source in zip(recvs, sources)]


def _end_pass(ranks) -> None:
    """``end_pass`` without CUDA: each rank's uses without data, senders first; the odd
    handshakes of transfers in place, CLEAR before the sender's wait for it."""
    for count, chunk in (("sent", "_send_chunk"), ("received", "_receive_chunk")):
        for t in ranks:
            for channel in range(len(t.shifts)):
                for slot in peer.odd_slots(getattr(t, count)[channel]):
                    getattr(t, chunk)(0, channel, slot, peer.MARKS[1])
                getattr(t, count)[channel] = 0
    for half, count in (("_clear", "taken"), ("_hand", "handed"), ("_take", "taken")):
        for t in ranks:
            for channel in range(len(t.shifts)):
                if getattr(t, count)[channel] % 2:
                    getattr(t, half)(0, channel)
    for t in ranks:
        t.handed, t.taken = [0] * len(t.shifts), [0] * len(t.shifts)


def _in_place_all(ranks, shift: int, rows, g):
    """Every rank hands ``rows[r]`` (start, count) of its block (a [1, 2, 8, 4] view, read in place)
    straight into the receive buffers of the rank ``shift`` ahead, as ``exchange`` issues it:
    receivers raise CLEAR, senders copy and raise DONE, receivers wait for it. Returns what
    each rank received, and what each sent."""
    channel = peer.channel_of(shift, len(ranks))
    blocks = [torch.randint(0, 256, (1, 2, 8, 4), dtype=torch.uint8, generator=g) for _ in ranks]
    sends = [b.narrow(2, *rows[r]) for r, b in enumerate(blocks)]
    recvs = [t.recv_buffer[:sends[(r - shift) % len(ranks)].numel()].view(1, 2, rows[(r - shift) % len(ranks)][1], 4)
             for r, t in enumerate(ranks)]
    for t in ranks:
        t._clear(0, channel)
    for t, send, recv in zip(ranks, sends, recvs):
        into = t._in_place(channel, [send], [recv])
        assert into is not None
        t._hand(0, channel, [(send, peer.layout(send), a) for a in into])  # none for an empty send
    for t in ranks:
        t._take(0, channel)
    return recvs, sends


def test_each_shift_has_a_channel():
    """+1 and -1 have channels of their own, even where they reach the same rank (two ranks);
    every other distance one more, whichever sign names it."""
    assert peer.channel_shifts(2) == peer.channel_shifts(3) == [1, -1]
    assert peer.channel_shifts(5) == [1, -1, 2, 3]
    assert [peer.channel_of(s, 2) for s in (1, -1)] == [0, 1]
    assert [peer.channel_of(s, 3) for s in (1, -1, 2, -2)] == [0, 1, 1, 0]
    assert [peer.channel_of(s, 5) for s in (1, -1, 2, -2, 3, -3, 4, -4)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="itself"):
        peer.channel_of(4, 4)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_chunks_reach_the_right_rank_through_the_slots(world_size, monkeypatch):
    """The mailbox protocol: each byte lands where the receiver reads it, in every channel,
    over several uses of every slot. Here every rank's sends run before the receives, so an
    exchange takes at most SLOTS chunks (a larger one needs both ends at once, as on the
    GPUs: tests/gpu/test_peer_transport.py moves 9 slots' worth)."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(world_size)
    g = torch.Generator().manual_seed(0)
    for shift, sizes in [(1, [100, 28]), (-1, [256]), (1, [1, 64, 120]), (-2, [65]), (1, [256]), (-1, [190, 3]),
                         (2, [64, 30]), (-3, [129]), (3, [7])]:
        if shift % world_size:
            assert _exchange_all(ranks, shift, sizes, g) == [True] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("chunks", [1, 3, 4, 5, 8])
def test_a_pass_leaves_the_flags_as_it_found_them(world_size, chunks, monkeypatch):
    """What makes a captured pass replayable: after ``end_pass`` every flag holds what it did
    before the pass, so the same operations with the same marks run again (a replay), and
    so does the next eager pass, which counts from 0 too; on four ranks a backward's pass
    uses the channel of a distance of two as well (its dK/dV shares)."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(world_size)
    flags, g = ranks[0].driver, torch.Generator().manual_seed(1)
    for shifts in ((1,), (-1, -2) if world_size > 2 else (-1,), (1,)):
        before = dict(flags.values)
        for _ in range(2):  # the pass, then its replay: the same chunks in the same slots
            for step in range(chunks):
                for shift in shifts:
                    assert _exchange_all(ranks, shift, [64], g) == [True] * world_size, step
            _end_pass(ranks)
            after = {a: v for a, v in flags.values.items() if before.get(a, peer.MARKS[1]) != v}
            assert after == {}, after
            assert all(t.sent == t.received == [0] * len(t.shifts) for t in ranks)


def test_a_slot_used_oddly_holds_the_first_mark_until_the_pass_ends(monkeypatch):
    """Why an eager pass orders the compute stream after its receives' uses without data once
    a pass was captured: until then READY holds the mark a next pass's first chunk waits for,
    and a replay (on streams of its own) would read the stale slot."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(2)
    flags, g = ranks[0].driver, torch.Generator().manual_seed(2)
    assert _exchange_all(ranks, 1, [64], g) == [True, True]  # slot 0 used once
    ready = ranks[1]._flag(1, peer._READY, 0, 0)
    assert flags.values[ready] == peer.slot_of(0)[1]
    _end_pass(ranks)
    assert flags.values[ready] == peer.MARKS[1] != peer.slot_of(0)[1]


def test_released_flags_pass_every_wait():
    """release() writes a value that passes a wait for either mark."""
    flags = _Flags()
    flags.write(0, 0, peer._RELEASED)
    for mark in peer.MARKS:
        flags.wait(0, 0, mark)
    flags.write(0, 0, 0)
    with pytest.raises(AssertionError):
        flags.wait(0, 0, peer.MARKS[0])


def test_rows_of_a_block_are_read_in_place():
    """``layout``: a contiguous tensor is one row; rows of a [B, H, L, D] block are a row per
    batch and head, a block apart; other views are copied first (None)."""
    block = torch.zeros(2, 3, 10, 4, dtype=torch.bfloat16)
    assert peer.layout(block) == (block.numel() * 2, block.numel() * 2)
    assert peer.layout(block.narrow(2, 3, 5)) == (5 * 4 * 2, 10 * 4 * 2)
    assert peer.layout(block[:, :1].narrow(2, 1, 2)) == (2 * 4 * 2, 3 * 10 * 4 * 2)  # one head: batches apart
    assert peer.layout(block.transpose(1, 2)) is None
    assert peer.layout(block.narrow(3, 0, 2)) is None
    assert peer.layout(block[:, :2].narrow(2, 0, 3)) is None  # batches not a whole number of head pitches apart
    assert peer.layout(block[:1, :1].expand(1, 3, 10, 4).narrow(2, 0, 5)) is None  # heads overlap (expanded)
    rows = block.narrow(2, 3, 5)
    sent, rows_of_sent = peer._readable(rows)  # what an exchange sends: the view itself
    assert sent is rows and rows_of_sent == peer.layout(rows)
    sent, rows_of_sent = peer._readable(block.transpose(1, 2))  # else a contiguous copy, one row
    assert sent.is_contiguous() and torch.equal(sent, block.transpose(1, 2))
    assert rows_of_sent == (block.numel() * 2, block.numel() * 2)


@pytest.mark.parametrize("width, pitch", [(10, 10), (10, 16), (3, 7), (64, 100)])
def test_pieces_bring_every_byte_in_order(width, pitch):
    """Any span of the bytes, cut anywhere (in a row, across rows), comes out of its pieces
    as the bytes lie contiguous: the sender cuts chunks where the receiver counts them."""
    rows = 6
    memory = torch.arange(rows * pitch, dtype=torch.int64)
    contiguous = memory.view(rows, pitch)[:, :width].reshape(-1)
    for start in range(0, rows * width + 1, 2):
        for end in range(start, rows * width + 1, 5):
            got = []
            for offset, count, nbytes in peer.pieces(start, end, width, pitch):
                assert count == 1 or nbytes == width
                got += [memory[offset + r * pitch: offset + r * pitch + nbytes] for r in range(count)]
            assert torch.equal(torch.cat(got) if got else contiguous[:0], contiguous[start:end]), (start, end)


def test_rows_of_a_block_reach_the_receiver_contiguous(monkeypatch):
    """A send of rows of a block (a view, read in place by 2-D copies) fills the receiver's
    contiguous tensor, in chunks that cut through its rows."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(2)
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randint(0, 256, (1, 3, 12, 5), dtype=torch.uint8, generator=g) for _ in ranks]
    sent = [b.narrow(2, 4, 7) for b in blocks]
    got = [torch.empty(1, 3, 7, 5, dtype=torch.uint8) for _ in ranks]
    for t, data in zip(ranks, sent):
        t._send(0, 0, data, peer.layout(data))
    for t, data in zip(ranks, got):
        t._receive(0, 0, data)
    assert all(torch.equal(got[r], sent[1 - r]) for r in range(2))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_blocks_land_in_the_receive_buffers_in_place(world_size, monkeypatch):
    """Transfers in place: a sender copies its rows (read in place) straight into the
    receiver's buffer of the key it receives into itself, whatever the rows each rank sends
    (a rank's own receive may be empty: the last rank's block under a window, which no one
    reads), with no slot of the mailbox used; the handshakes alternate marks over several
    uses and a pass leaves every flag as it found it."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(world_size)
    buffers = [torch.zeros(64, dtype=torch.uint8) for _ in ranks]
    for r, t in enumerate(ranks):
        t.recv_buffer = buffers[r]
        t.receive_buffers.mapped = {buffers[r].data_ptr(): {p: buffers[p].data_ptr() for p in t.to}}
    flags, g = ranks[0].driver, torch.Generator().manual_seed(4)
    before = dict(flags.values)
    for uses in (1, 2, 3):
        for _ in range(uses):
            for shift in (1, -1):
                rows = [(2, 4) if r < world_size - 1 else (0, 0) for r in range(world_size)]
                recvs, sends = _in_place_all(ranks, shift, rows, g)
                for r in range(world_size):
                    assert torch.equal(recvs[r], sends[(r - shift) % world_size].contiguous()), (uses, shift, r)
        assert all(t.sent == t.received == [0] * len(t.shifts) for t in ranks)  # no slot used
        _end_pass(ranks)
        changed = {a: v for a, v in flags.values.items() if before.get(a, peer.MARKS[1]) != v}
        assert changed == {}, (uses, changed)


def test_only_receive_buffers_are_received_into_in_place():
    """``_in_place``: the addresses in the receiver's buffers only where every tensor received
    lies in one (at its offset there), else None: the mailbox carries the transfer."""
    t = _ranks(2)[0]
    mine, theirs = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    t.receive_buffers.mapped = {mine.data_ptr(): {1: theirs.data_ptr()}}
    send = torch.ones(10, dtype=torch.uint8)
    assert t._in_place(0, [send], [mine[:10]]) == [theirs.data_ptr()]
    assert t._in_place(0, [send], [mine[:0]]) == [theirs.data_ptr()]  # nothing to receive here, still in place there
    assert t._in_place(0, [send, send], [mine[:10], torch.zeros(10, dtype=torch.uint8)]) is None
    assert t._in_place(0, [send], []) is None


def _pool(monkeypatch):
    """A transport whose receive buffers are CPU tensors (its peers' stand-in addresses), with
    the device's synchronisation and the capture state simulated."""
    t = _ranks(2)[0]
    pool = t.receive_buffers
    state = {"capturing": False, "synchronized": 0}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: state.update(synchronized=state["synchronized"] + 1))

    def made(nbytes):
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        pool.mapped[buffer.data_ptr()] = {p: 1 << 40 for p in pool.peers}
        pool.kept[buffer.data_ptr()] = buffer, None
        return buffer
    monkeypatch.setattr(pool, "_mapped", made)
    return t, pool, state


def test_a_key_keeps_one_receive_buffer_the_largest_asked(monkeypatch):
    """Calls of many lengths hold one buffer per key, the largest asked for: a smaller ask
    gets the leading bytes of the one there, a larger one a new buffer, after the device is
    synchronised (no copy into the old one under way), and the old one is let go."""
    t, pool, state = _pool(monkeypatch)
    first = pool.get((0, 0), 100)
    assert first.numel() == 100 and len(pool.kept) == 1
    smaller = pool.get((0, 0), 40)
    assert smaller.data_ptr() == first.data_ptr() and smaller.numel() == 40 and state["synchronized"] == 0
    other = pool.get((1, 0), 40)
    assert other.data_ptr() != first.data_ptr() and len(pool.kept) == 2
    larger = pool.get((0, 0), 300)
    assert larger.numel() == 300 and state["synchronized"] == 1
    assert first.data_ptr() not in pool.kept and first.data_ptr() not in pool.mapped and len(pool.kept) == 2
    assert t._in_place(0, [torch.ones(10, dtype=torch.uint8)], [pool.get((0, 0), 10)]) == [1 << 40]


def test_a_receive_buffer_a_graph_captured_stays(monkeypatch):
    """A captured pass's replays write into the buffers it was captured with: a larger ask
    later makes a new buffer but keeps that one (and its peers' addresses); under capture a
    key or size not made before is refused, since capture cannot make one."""
    t, pool, state = _pool(monkeypatch)
    pool.get((0, 0), 100)
    state["capturing"] = True
    captured = pool.get((0, 0), 100)
    with pytest.raises(RuntimeError, match="eager call of the same shapes"):
        pool.get((0, 0), 200)
    with pytest.raises(RuntimeError, match="eager call of the same shapes"):
        pool.get((1, 1), 10)
    state["capturing"] = False
    larger = pool.get((0, 0), 200)
    assert larger.data_ptr() != captured.data_ptr()
    assert captured.data_ptr() in pool.kept and captured.data_ptr() in pool.mapped and state["synchronized"] == 0


def test_receive_buffers_are_counted_apart_from_torchs_allocator(monkeypatch):
    """``receive_bytes``: the bytes of the receive buffers in use on a device (the benchmark
    adds them to the peak memory it reports: torch's allocator does not see them)."""
    t, pool, _ = _pool(monkeypatch)
    monkeypatch.setattr(peer, "_TRANSPORTS", {"group": t, "another group, over the process group": None})
    pool.get((0, 0), 100)
    pool.get((1, 0), 50)
    assert peer.receive_bytes(torch.device("cpu")) == 150
    pool.get((0, 0), 300)
    assert peer.receive_bytes(torch.device("cpu")) == 350
    assert peer.receive_bytes(torch.device("cuda", 0)) == 0


def test_receive_buffers_torch_allocates_are_not_counted_again(monkeypatch):
    """Where ranks share a GPU the receive buffers come from torch's allocator (CUDA IPC maps
    them), which counts them already: ``receive_bytes`` adds none of them."""
    t, pool, _ = _pool(monkeypatch)
    monkeypatch.setattr(peer, "_TRANSPORTS", {"group": t})
    pool.shared_gpu = True
    pool.get((0, 0), 100)
    assert peer.receive_bytes(torch.device("cpu")) == 0


def test_ipc_mapped_memory_opens_in_the_ranks_own_gpu():
    """Where ranks share a GPU, ``mapped`` hands torch's rebuild of a shared CUDA tensor this
    rank's GPU in place of the one the tensor lies on: the argument it replaces is still the
    storage's device."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    from ringflex.parallel import mapped
    assert list(inspect.signature(rebuild_cuda_tensor).parameters)[mapped._IPC_DEVICE] == "storage_device"


def _made_together(rank, world_size):
    from ringflex.parallel.groups import made_together

    def make():
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")
        return torch.empty(4)

    try:
        made_together(None, make, "the copy engines' mailboxes")
    except RuntimeError as e:
        failed = str(e)
    return failed, made_together(None, lambda: rank, "a value")


def test_memory_a_collective_maps_is_made_by_every_rank_or_by_none():
    """The transport's mailboxes and receive buffers are mapped by a collective right after
    they are made: a rank out of GPU memory would leave the others in it. Every rank raises
    the same error instead (where the mailboxes fail, the ring falls back to the process
    group's P2P on every rank alike)."""
    from support.harness import run_world
    results = run_world(3, _made_together)
    assert {failed for failed, _ in results} == {
        "ringflex: the copy engines' mailboxes could not be made on every rank (rank 1: OutOfMemoryError: CUDA out "
        "of memory. Tried to allocate 256.00 MiB)"}
    assert [value for _, value in results] == [0, 1, 2]
