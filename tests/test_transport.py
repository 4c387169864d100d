"""The copy-engine transport's bookkeeping, on CPU (tests/gpu/test_peer_transport.py moves bytes)."""
import ctypes

import pytest
import torch

from ringflex.parallel import peer


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


def _ranks(world_size: int):
    """One PeerTransport per simulated rank, their mailboxes plain CPU tensors they share."""
    flags = _Flags()
    total = peer._FLAGS_BYTES + 2 * peer.SLOTS * peer.SLOT_BYTES
    mailboxes = [torch.zeros(total, dtype=torch.uint8) for _ in range(world_size)]
    ranks = []
    for r in range(world_size):
        t = object.__new__(peer.PeerTransport)
        t.driver, t.rank, t.mailbox = flags, r, mailboxes[r]
        t.to = [(r + 1) % world_size, (r - 1) % world_size]
        t.source = [t.to[1], t.to[0]]
        t.peer_mailbox = {p: mailboxes[p] for p in t.to}
        t.base = {p: mailboxes[p].data_ptr() for p in range(world_size)}
        t.sent, t.received = [0, 0], [0, 0]
        ranks.append(t)
    return ranks


def _exchange_all(ranks, reverse: bool, sizes, g):
    """Every rank sends chunks of ``sizes`` bytes, then every rank receives; returns whether
    each received what its source sent."""
    direction = int(reverse)
    sends = [[torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes] for _ in ranks]
    recvs = [[torch.empty(n, dtype=torch.uint8) for n in sizes] for _ in ranks]
    for t, send in zip(ranks, sends):
        for data in send:
            t._send(0, direction, data)
    for t, recv in zip(ranks, recvs):
        for data in recv:
            t._receive(0, direction, data)
    sources = [(r + (1 if reverse else -1)) % len(ranks) for r in range(len(ranks))]
    return [all(torch.equal(got, sent) for got, sent in zip(recv, sends[source]))
            for recv, source in zip(recvs, sources)]


def _end_pass(ranks) -> None:
    """``end_pass`` without CUDA: each rank's uses without data, senders first."""
    for count, chunk in (("sent", "_send_chunk"), ("received", "_receive_chunk")):
        for t in ranks:
            for direction in (0, 1):
                for slot in peer.odd_slots(getattr(t, count)[direction]):
                    getattr(t, chunk)(0, direction, slot, peer.MARKS[1])
                getattr(t, count)[direction] = 0


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_chunks_reach_the_right_neighbour_through_the_slots(world_size, monkeypatch):
    """The mailbox protocol: each byte lands where the receiver reads it, in both directions,
    over several uses of every slot. Here every rank's sends run before the receives, so an
    exchange takes at most SLOTS chunks (a larger one needs both ends at once, as on the
    GPUs: tests/gpu/test_peer_transport.py moves 9 slots' worth)."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(world_size)
    g = torch.Generator().manual_seed(0)
    for reverse, sizes in [(False, [100, 28]), (True, [256]), (False, [1, 64, 120]),
                           (True, [65]), (False, [256]), (True, [190, 3])]:
        assert _exchange_all(ranks, reverse, sizes, g) == [True] * world_size


@pytest.mark.parametrize("chunks", [1, 3, 4, 5, 8])
def test_a_pass_leaves_the_flags_as_it_found_them(chunks, monkeypatch):
    """What makes a captured pass replayable: after ``end_pass`` every flag holds what it did
    before the pass, so the same operations with the same marks run again (a replay), and
    so does the next eager pass, which counts from 0 too."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(2)
    flags, g = ranks[0].driver, torch.Generator().manual_seed(1)
    for reverse in (False, True, False):
        before = dict(flags.values)
        for _ in range(2):  # the pass, then its replay: the same chunks in the same slots
            for step in range(chunks):
                assert _exchange_all(ranks, reverse, [64], g) == [True, True], step
            _end_pass(ranks)
            after = {a: v for a, v in flags.values.items() if before.get(a, peer.MARKS[1]) != v}
            assert after == {}, after
            assert all(t.sent == t.received == [0, 0] for t in ranks)


def test_a_slot_used_oddly_holds_the_first_mark_until_the_pass_ends(monkeypatch):
    """Why an eager pass orders the compute stream after its receives' uses without data once
    a pass was captured: until then READY holds the mark a next pass's first chunk waits for,
    and a replay (on streams of its own) would read the stale slot."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(2)
    flags, g = ranks[0].driver, torch.Generator().manual_seed(2)
    assert _exchange_all(ranks, False, [64], g) == [True, True]  # slot 0 used once
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
