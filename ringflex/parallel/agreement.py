"""The agreement among the ranks of a ring, before any point-to-point transfer.

A rank that rejects a call must not leave its neighbours waiting in a transfer, so every
rank first checks its own arguments and plans its part of the ring (the plan evaluates the
user's mask_mod, which may raise on one rank only), keeping what went wrong as a message;
then all ranks exchange one small record (``_FIELDS``: shapes, dtypes, layout, mod
fingerprints, whether backward will run, and any rank's error, with the ints each shares of
its plan), through shared memory where the ranks share a host (``board``), else over a CPU
(gloo) control group, and raise the same ``CallRejected`` together.

The exchange runs in the background (``Agreement``): the ring computes on the rank's own
K/V block meanwhile and waits for the agreement only before its first transfer, so the
check costs a round trip of host time only where there is nothing to compute. ``exchange``
is the same all_gather, waited for at once, for the other collective checks (unshard, the
training helpers, the debug mode).
"""
from __future__ import annotations

import struct
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import config
from ..kernels import BACKENDS
from ..kernels.base import DTYPES
from ..mod.fingerprint import fingerprint
from ..plan import layout as layouts
from . import board, comm, fault

_MESSAGE_BYTES = 400  # a multiple of 8: packed into int64s


_CONTROL_GROUPS = {}


def control_group(group):
    """A group with the same ranks that can move CPU tensors (gloo), made once per group."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    if group not in _CONTROL_GROUPS:
        ranks = dist.get_process_group_ranks(group)
        _CONTROL_GROUPS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _CONTROL_GROUPS[group]


class _Exchange:
    """An all_gather of every rank's record, under way: on the host's shared-memory board
    where the group has one (``board``), else over gloo."""

    def __init__(self, group, values: Sequence[int], error: Optional[str], what: str, error_type,
                 caller: Optional[str] = "ring_flex_attention"):
        self.group, self.what, self.error_type, self.count = group, what, error_type, len(values)
        self.prefix = f"{caller}: " if caller else ""
        values = list(values) if error is None else [0] * len(values)
        message = (error or "").encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
        record = struct.pack(f"<{1 + len(values)}q", int(error is not None), *values) + message
        self.control = control_group(group)
        shared = board.of(self.control)
        if shared is not None:
            self.work = shared.post(record)
        else:
            mine = torch.frombuffer(bytearray(record), dtype=torch.int64)
            self.gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            self.work = dist.all_gather(self.gathered, mine, group=self.control, async_op=True)
        self.stragglers = fault.Stragglers(group, what)

    def result(self) -> List[List[int]]:
        fault.wait_collective(self.work, self.control, self.what, ring_group=self.group, stragglers=self.stragglers)
        records = self.work.records if isinstance(self.work, board.Gathering) else \
            [t.numpy().tobytes() for t in self.gathered]
        values = struct.Struct(f"<{1 + self.count}q")
        for rank, record in enumerate(records):
            if values.unpack_from(record)[0]:
                text = record[values.size:].rstrip(b"\0").decode(errors="replace")
                raise self.error_type(f"{self.prefix}rank {rank}: {text}")
        return [list(values.unpack_from(record)[1:]) for record in records]


def exchange(group, values: Sequence[int], error: Optional[str], what: str, error_type=ValueError,
             caller: Optional[str] = "ring_flex_attention") -> List[List[int]]:
    """Every rank's ``values`` (ints below 2**63), gathered over the control group of the ring
    ``group`` (None: the default group). If any rank had an ``error``, every rank raises the
    same ``error_type``, naming the rank (and the ``caller``, where the error does not)."""
    return _Exchange(group if group is not None else dist.group.WORLD, values, error, what, error_type,
                     caller).result()


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


def _device_code(device: torch.device) -> int:
    return int.from_bytes(device.type.encode()[:7].ljust(7, b"\0"), "little")


def _device_name(code: int) -> str:
    return code.to_bytes(7, "little").rstrip(b"\0").decode(errors="replace")


def _kernel_code(name: str) -> int:
    """A kernel's name as its backend's index (``len(BACKENDS)`` for any other kernel)."""
    return BACKENDS.index(name) if name in BACKENDS else len(BACKENDS)


# What every rank must agree on: (name, value on this rank, how a value reads in a message).
_Field = Tuple[str, Callable, Callable[[int], str]]
_FIELDS: Tuple[_Field, ...] = (
    ("batch size", lambda a: a["q"].shape[0], str),
    ("query heads", lambda a: a["q"].shape[1], str),
    ("key/value heads", lambda a: a["k"].shape[1], str),
    ("local query length", lambda a: a["q"].shape[2], str),
    ("local key/value length", lambda a: a["k"].shape[2], str),
    ("head dim", lambda a: a["q"].shape[3], str),
    ("value head dim", lambda a: a["v"].shape[3], str),
    ("dtype", lambda a: DTYPES.index(a["q"].dtype), lambda n: str(DTYPES[n])),
    ("device type", lambda a: _device_code(a["q"].device), _device_name),
    ("backend", lambda a: BACKENDS.index(a["backend"]), lambda n: repr(BACKENDS[n])),
    ("kernel", lambda a: _kernel_code(a["kernel"]),  # "auto" may choose differently per rank
     lambda n: repr(BACKENDS[n]) if n < len(BACKENDS) else "another kernel"),
    ("enable_gqa", lambda a: int(bool(a["enable_gqa"])), lambda n: str(bool(n))),
    ("sinks", lambda a: int(a["sinks"] is not None), lambda n: "given" if n else "None"),
    ("scale", lambda a: -1 if a["scale"] is None else _bits(float(a["scale"])),
     lambda n: "None" if n == -1 else repr(_from_bits(n))),
    ("score_mod", lambda a: fingerprint(a["score_mod"], a["debug"]), lambda n: f"fingerprint {n:016x}"),
    ("mask_mod", lambda a: fingerprint(a["mask_mod"], a["debug"]), lambda n: f"fingerprint {n:016x}"),
    # after the mods: a call left in the default layout runs in the sharding its mask chooses
    ("layout", lambda a: layouts.code(a["layout"]), layouts.text),
    ("gradient tracking (whether backward will run the ring)", lambda a: int(a["grad"]), lambda n: str(bool(n))),
    ("RINGFLEX_DEBUG mode", lambda a: int(a["debug"]), lambda n: str(bool(n))),
    ("RINGFLEX_TRANSPORT", lambda a: _transport(), lambda n: repr(_TRANSPORTS[n])),
    ("CUDA-graph capture", lambda a: int(comm.capturing(a["q"])), lambda n: "capturing" if n else "not capturing"),
    ("return_lse", lambda a: int(a["return_lse"]), lambda n: str(bool(n))),
)


_TRANSPORTS = ("auto", "copy-engine", "nccl")


def _transport() -> int:
    """RINGFLEX_TRANSPORT as an index into ``_TRANSPORTS`` (a bad value is refused before this)."""
    return _TRANSPORTS.index(config.TRANSPORT.value())


class Agreement:
    """The agreement on one call, under way: ``wait()`` returns once every rank has agreed,
    or raises the same ``fault.CallRejected`` on every rank. After ``wait()``, ``shared[r]``
    holds the ints rank r shared of its plan (``start``)."""

    def __init__(self, error: Optional[str] = None, cause=None, exchange: Optional[_Exchange] = None,
                 shared: Optional[List[List[int]]] = None):
        self.error, self.cause, self.exchange, self.shared = error, cause, exchange, shared

    @property
    def failed_here(self) -> bool:
        """This rank cannot run the call (the others learn it from the exchange)."""
        return self.error is not None

    def wait(self) -> None:
        if self.exchange is None:
            if self.error:
                self._raise_interruption()
                raise fault.CallRejected(f"ring_flex_attention: {self.error}") from self.cause
            return
        exchange, self.exchange = self.exchange, None
        try:
            records = exchange.result()
        except fault.CallRejected as e:
            if self.cause is None:
                raise
            self._raise_interruption()
            raise e from self.cause
        for i, (name, _, show) in enumerate(_FIELDS):
            seen = [rec[i] for rec in records]
            if len(set(seen)) > 1:
                detail = ", ".join(f"rank {r}: {show(s)}" for r, s in enumerate(seen))
                raise fault.CallRejected(f"ring_flex_attention: the ranks disagree on the {name} ({detail}); "
                                         "every rank of the ring must make the same call")
        self.shared = [rec[len(_FIELDS):] for rec in records]

    def _raise_interruption(self) -> None:
        """An interruption (KeyboardInterrupt, SystemExit) while planning stays itself on this
        rank, once the others have learnt of it: the caller's handlers of it must see it."""
        if self.cause is not None and not isinstance(self.cause, Exception):
            raise self.cause


def planning_error(e: BaseException) -> str:
    """The message of an exception raised while this rank planned a call (by its mask_mod, say)."""
    return f"{type(e).__name__}: {e} (while planning the ring, before any transfer)"


def start(group, call: Optional[dict], shares: Sequence[int], error: Optional[str], cause=None) -> Agreement:
    """Starts the agreement of the ranks of ``group`` on a call. ``call``: this rank's
    arguments, by the names ``_FIELDS`` read (None where ``error``); ``shares``: the ints of
    its plan that every rank learns (as many on every rank, zeros where it has none), so each
    knows how far the ring must run, which rows of a block any rank still needs, and what
    work the ranks have; ``error``: what this rank found wrong, with the exception ``cause``
    it came from. No rank may start a transfer before ``wait()`` on the result."""
    if group is None or dist.get_world_size(group) == 1:
        return Agreement(error, cause, shared=[list(shares)])
    values = [0] * len(_FIELDS) if error else [get(call) for _, get, _ in _FIELDS]
    return Agreement(error, cause, _Exchange(group, values + list(shares), error, "the argument check",
                                             fault.CallRejected))


def reject(group, error: str, no_shares: Sequence[int]):
    """Raises ``error`` as ``CallRejected`` on every rank of ``group``, as the agreement on a
    bad call does: for a call this rank refuses before it reaches the agreement (a model's
    attention call that cannot be routed, which may depend on this rank's tokens), while the
    other ranks' calls wait in theirs. ``no_shares``: as a rank's shares, so the records match."""
    raise_if_failed_before(group)
    start(group, None, no_shares, error).wait()


def raise_if_failed_before(group) -> None:
    """Raises ``RingFailure`` where a ring on ``group`` failed earlier: its ranks may be at
    different points of their programs, and no new call can pair them."""
    failed = fault.failure(group)
    if failed:
        raise fault.RingFailure(f"ringflex: the ring on this process group failed earlier ({failed}); "
                                "create a new process group")
