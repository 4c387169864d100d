"""A shared-memory board for the ranks of one host: the argument check's exchange without gloo.

Every ring call's ranks exchange one small record before their first transfer
(``agreement``). gloo's all_gather passes it through W - 1 steps, each of which wakes a
thread of another process, and a call bound by its host waits for that round trip. Where
every rank of a group runs on one host, each rank instead writes its record into a slot of
its own in a shared-memory file and reads the others' slots, which takes microseconds.

- Two slots a rank, by the exchange's parity. A rank is at most one exchange ahead of
  another: it cannot finish exchange n + 1 without that rank's record of n + 1, which that
  rank writes only once it is done with n. So no slot a reader still needs is rewritten.
- A slot holds the exchange's number, the record's length, the record and a CRC of them: a
  reader that catches a slot half written (in any memory order) sees a wrong CRC and reads
  it again.
- A rank whose process is gone never writes: a reader that waits says so instead of waiting
  on (every rank records its process id; the board needs one process namespace).

``of(group)`` makes the board when a group is first used (a collective, once), or returns
None where gloo must carry the records: ranks on several hosts, no ``/dev/shm``, or
``RINGFLEX_AGREEMENT=gloo`` on any rank.
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
import time
import uuid
import zlib
from typing import Dict, List, Optional

import torch.distributed as dist

from .. import config
from .groups import gather_objects

SLOT_BYTES = 4096  # a record of up to 500 ints: the argument check's is about 100
_HEAD = struct.Struct("<qq")  # the exchange's number, the record's length in bytes
_TAIL = struct.Struct("<Q")  # the CRC of head and record
_PIDS = struct.Struct("<q")  # each rank's process id, ahead of the slots

_LOOK_AT_PROCESSES_S = 0.1  # a wait this long looks whether the ranks it waits for still run

_BOARDS: Dict[object, Optional["Board"]] = {}


class Board:
    """The slots of the ranks of one group, mapped into this process."""

    def __init__(self, memory: mmap.mmap, rank: int, world_size: int):
        self.memory, self.rank, self.world_size = memory, rank, world_size
        self.count = 0  # exchanges made on this board
        self.pids = [_PIDS.unpack_from(memory, r * _PIDS.size)[0] for r in range(world_size)]

    def _slot(self, rank: int, number: int) -> int:
        return _PIDS.size * self.world_size + (2 * rank + number % 2) * SLOT_BYTES

    def post(self, record: bytes) -> "Gathering":
        """Writes this rank's ``record`` for the next exchange; the others' come with ``Gathering``."""
        if len(record) > SLOT_BYTES - _HEAD.size - _TAIL.size:
            raise ValueError(f"a record of {len(record)} bytes does not fit a slot of the board")
        number, self.count = self.count, self.count + 1
        head = _HEAD.pack(number, len(record))
        at = self._slot(self.rank, number)
        self.memory[at:at + _HEAD.size + len(record) + _TAIL.size] = \
            head + record + _TAIL.pack(zlib.crc32(head + record))
        return Gathering(self, number, record)

    def read(self, rank: int, number: int) -> Optional[bytes]:
        """``rank``'s record of exchange ``number``, or None while it is not (wholly) there."""
        at = self._slot(rank, number)
        found, length = _HEAD.unpack_from(self.memory, at)
        if found != number or not 0 <= length <= SLOT_BYTES - _HEAD.size - _TAIL.size:
            if found > number:  # two exchanges ahead: the ranks' exchanges no longer pair
                raise RuntimeError(f"rank {rank} has reached exchange {found} of the board while this rank waits "
                                   f"in exchange {number}: the ranks made different collective calls")
            return None
        body = self.memory[at:at + _HEAD.size + length + _TAIL.size]
        if zlib.crc32(body[:-_TAIL.size]) != _TAIL.unpack_from(body, len(body) - _TAIL.size)[0]:
            return None  # caught while being written
        found, _ = _HEAD.unpack_from(body)
        return body[_HEAD.size:-_TAIL.size] if found == number else None


class Gathering:
    """One exchange under way, in the shape of a gloo collective's work (what
    ``fault.wait_collective`` polls): ``records`` holds every rank's record once complete."""

    def __init__(self, board: Board, number: int, record: bytes):
        self.board, self.number = board, number
        self.records: List[Optional[bytes]] = [None] * board.world_size
        self.records[board.rank] = record
        self.look_at_processes = time.monotonic() + _LOOK_AT_PROCESSES_S

    def is_completed(self) -> bool:
        for rank, record in enumerate(self.records):
            if record is None:
                self.records[rank] = self.board.read(rank, self.number)
        done = all(r is not None for r in self.records)
        if not done and time.monotonic() >= self.look_at_processes:  # a rank whose process is gone never writes
            self.look_at_processes = time.monotonic() + _LOOK_AT_PROCESSES_S
            gone = [r for r, record in enumerate(self.records) if record is None and not _alive(self.board.pids[r])]
            if gone:
                raise RuntimeError(f"rank {gone[0]}'s process (pid {self.board.pids[gone[0]]}) has ended")
        return done

    def wait(self) -> None:
        while not self.is_completed():
            pass


def of(group) -> Optional[Board]:
    """The board of the gloo ``group``'s ranks, made on its first use (a collective of the
    group, so every rank must reach it in the same call), or None where gloo carries the records."""
    if group not in _BOARDS:
        _BOARDS[group] = _make(group)
    return _BOARDS[group]


def _make(group) -> Optional[Board]:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    try:
        wanted = config.AGREEMENT.value() == "auto"
    except ValueError:  # the argument check refuses the call with the setting's error
        wanted = False
    here = (_host(), wanted)
    everyone = gather_objects(group, here)
    if not all(wanted for _, wanted in everyone) or len({host for host, _ in everyone}) > 1:
        return None
    path = None
    if rank == 0:
        path = f"/dev/shm/ringflex-{uuid.uuid4().hex}"
        try:
            with open(path, "wb") as f:
                f.truncate(_PIDS.size * world_size + 2 * world_size * SLOT_BYTES)
        except OSError:
            path = None
    path = gather_objects(group, path)[0]
    memory = None
    if path is not None:
        try:
            with open(path, "r+b") as f:
                memory = mmap.mmap(f.fileno(), 0)
            memory[rank * _PIDS.size:(rank + 1) * _PIDS.size] = _PIDS.pack(os.getpid())
        except (OSError, ValueError):
            memory = None
    opened = gather_objects(group, memory is not None)  # also: every rank has written its process id
    if rank == 0 and path is not None:
        os.unlink(path)  # the mappings stay; nothing is left behind when the processes end
    if not all(opened):
        return None
    return Board(memory, rank, world_size)


def _host() -> str:
    """What ranks that may share a board have in common: the machine's boot and the process
    namespace (process ids are compared across ranks)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{socket.gethostname()}/{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux: no board
        return f"{socket.gethostname()}/{os.getpid()}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an ended process its parent has not yet reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
