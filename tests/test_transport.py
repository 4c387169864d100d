"""The copy-engine transport's bookkeeping, on CPU (tests/gpu/test_peer_transport.py moves bytes)."""
import pytest

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
