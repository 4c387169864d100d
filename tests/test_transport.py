"""The copy-engine transport's bookkeeping, on CPU (tests/gpu/test_peer_transport.py moves bytes)."""
import pytest
import torch

from ringflex.parallel import peer


def test_chunks_cover_a_transfer_in_slots():
    assert peer.chunks(0) == []
    assert peer.chunks(5) == [(0, 5)]
    n = 2 * peer.SLOT_BYTES + 7
    spans = peer.chunks(n)
    assert spans == [(0, peer.SLOT_BYTES), (peer.SLOT_BYTES, 2 * peer.SLOT_BYTES), (2 * peer.SLOT_BYTES, n)]


def test_slots_are_reused_in_turn_with_a_new_generation():
    seen = [peer.slot_of(c) for c in range(2 * peer.SLOTS + 1)]
    assert [s for s, _ in seen] == list(range(peer.SLOTS)) * 2 + [0]
    assert [g for _, g in seen] == [1] * peer.SLOTS + [2] * peer.SLOTS + [3]


def test_transport_choice_is_checked(monkeypatch):
    monkeypatch.setenv("RINGFLEX_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="RINGFLEX_TRANSPORT='shm'.*auto, copy-engine, nccl"):
        peer.choice()
    monkeypatch.setenv("RINGFLEX_TRANSPORT", "nccl")
    assert peer.choice() == "nccl"
    monkeypatch.delenv("RINGFLEX_TRANSPORT")
    assert peer.choice() == "auto"


class _Flags:
    """The driver's flag operations on a dict: a wait must already hold when it is issued
    (the simulation below runs every rank's operations in an order where it should)."""

    def __init__(self):
        self.values = {}

    def write(self, stream: int, address: int, value: int) -> None:
        self.values[address] = value

    def wait(self, stream: int, address: int, value: int) -> None:
        # as the driver compares: (int32)(flag - value) >= 0
        assert ((self.values.get(address, 0) - value + (1 << 31)) % (1 << 32)) >= 1 << 31, (address, value)


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
        t.flag_base = {p: p << 32 for p in range(world_size)}
        t.sent, t.received = [0, 0], [0, 0]
        ranks.append(t)
    return ranks


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_chunks_reach_the_right_neighbour_through_the_slots(world_size, monkeypatch):
    """The mailbox protocol: each byte lands where the receiver reads it, in both directions,
    over several generations of every slot. Here every rank's sends run before the receives,
    so an exchange takes at most SLOTS chunks (a larger one needs both ends at once, as on the
    GPUs: tests/gpu/test_peer_transport.py moves 9 slots' worth)."""
    monkeypatch.setattr(peer, "SLOT_BYTES", 64)
    ranks = _ranks(world_size)
    g = torch.Generator().manual_seed(0)
    for exchange, (reverse, sizes) in enumerate([(False, [100, 28]), (True, [256]), (False, [1, 64, 120]),
                                                  (True, [65]), (False, [256]), (True, [190, 3])]):
        direction = int(reverse)
        sends = [[torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes] for _ in ranks]
        recvs = [[torch.empty(n, dtype=torch.uint8) for n in sizes] for _ in ranks]
        for t, send in zip(ranks, sends):
            for data in send:
                t._send(0, direction, data)
        for t, recv in zip(ranks, recvs):
            for data in recv:
                t._receive(0, direction, data)
        for r, recv in enumerate(recvs):
            source = (r + 1) % world_size if reverse else (r - 1) % world_size
            for got, sent in zip(recv, sends[source]):
                assert torch.equal(got, sent), (exchange, r)


def test_released_flags_pass_every_wait():
    """release() writes a value the driver's cyclic comparison puts ahead of any generation
    (0xFFFFFFFF would read as -1: behind all of them)."""
    flags = _Flags()
    flags.write(0, 0, peer._RELEASED)
    for generation in (1, 2, 1000, 1 << 29):
        flags.wait(0, 0, generation)
    flags.write(0, 0, 0xFFFFFFFF)
    with pytest.raises(AssertionError):
        flags.wait(0, 0, 1)
