"""The shared-memory board that carries the argument check's records between the ranks of one host."""
import mmap
import random
import subprocess
import time

import pytest
import torch.distributed as dist

from ringflex.parallel import agreement, board
from support.harness import run_world


def _exchanges(rank, world_size, count):
    """``count`` exchanges in a row, ranks arriving at random moments; what each returned."""
    rng = random.Random(rank)
    seen = []
    for i in range(count):
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.003)
        seen.append(agreement.exchange(None, [rank, i, -i, 2 ** 62], None, "a test exchange"))
    return board.of(agreement.control_group(dist.group.WORLD)) is not None, seen


@pytest.mark.parametrize("world_size", [2, 4])
def test_records_arrive_whole_and_in_rank_order(world_size):
    for on_board, seen in run_world(world_size, _exchanges, 200, timeout=120):
        assert on_board
        assert seen == [[[r, i, -i, 2 ** 62] for r in range(world_size)] for i in range(200)]


def _one_rank_fails(rank, world_size):
    try:
        agreement.exchange(None, [rank], "rank 1's own reason" if rank == 1 else None, "a test exchange")
    except ValueError as e:
        return str(e), agreement.exchange(None, [rank], None, "the next exchange")
    return None


def test_an_error_reaches_every_rank_and_the_board_stays_usable():
    for message, after in run_world(3, _one_rank_fails, timeout=120):
        assert message == "ring_flex_attention: rank 1: rank 1's own reason"
        assert after == [[0], [1], [2]]


def _gloo_on_rank(rank, world_size, asks_gloo, other_host):
    import os
    if rank == asks_gloo:
        os.environ["RINGFLEX_AGREEMENT"] = "gloo"
    if rank == other_host:
        board._host = lambda: "another host"
    return _exchanges(rank, world_size, 20)


@pytest.mark.parametrize("asks_gloo, other_host", [(1, None), (None, 2)], ids=["gloo asked", "another host"])
def test_gloo_carries_the_records_on_every_rank_where_one_rank_needs_it(asks_gloo, other_host):
    for on_board, seen in run_world(3, _gloo_on_rank, asks_gloo, other_host, timeout=120):
        assert not on_board
        assert seen == [[[r, i, -i, 2 ** 62] for r in range(3)] for i in range(20)]


def _local_board(pids):
    """A board over anonymous memory, as rank 0 of len(pids) ranks with those process ids."""
    memory = mmap.mmap(-1, board._PIDS.size * len(pids) + 2 * len(pids) * board.SLOT_BYTES)
    for r, pid in enumerate(pids):
        board._PIDS.pack_into(memory, r * board._PIDS.size, pid)
    return board.Board(memory, 0, len(pids))


def test_a_slot_caught_half_written_is_read_again():
    here = _local_board([0, 0])
    writer = board.Board(here.memory, 1, 2)
    writer.post(b"12345678")
    assert here.read(1, 0) == b"12345678"
    at = here._slot(1, 0) + board._HEAD.size
    here.memory[at:at + 1] = b"x"  # the record changed, its CRC not yet
    assert here.read(1, 0) is None


def test_a_rank_two_exchanges_ahead_is_an_error():
    here = _local_board([0, 0])
    writer = board.Board(here.memory, 1, 2)
    for _ in range(3):
        writer.post(b"")
    with pytest.raises(RuntimeError, match="rank 1 has reached exchange 2 of the board while this rank waits in "
                                           "exchange 0"):
        here.read(1, 0)


def test_a_wait_for_a_rank_whose_process_ended_raises(monkeypatch):
    ended = subprocess.Popen(["true"])
    ended.wait()
    monkeypatch.setattr(board, "_LOOK_AT_PROCESSES_S", 0.01)
    gathering = _local_board([0, ended.pid]).post(b"mine")
    with pytest.raises(RuntimeError, match=f"rank 1's process \\(pid {ended.pid}\\) has ended"):
        gathering.wait()
