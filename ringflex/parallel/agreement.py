"""Argument checks, on this rank and across the ring, before any point-to-point transfer.

A rank that rejects its arguments must not leave its neighbours waiting in a transfer, so
every rank first checks its own arguments and prepares its part of the ring (the plan
evaluates the user's mask_mod, which may raise on one rank only), then all ranks exchange
one small record (shapes, dtypes, layout, mod fingerprints, whether backward will run, and
any local error) over a CPU (gloo) group and raise the same error together.

The exchange runs in the background (``Agreement``): the ring computes on the rank's own
K/V block meanwhile and waits for the agreement only before its first transfer, so the
check costs a round trip of host time only where there is nothing to compute.
"""
from __future__ import annotations

import hashlib
import inspect
import math
import struct
import types
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import captured, config
from .parallel import comm, fault
from .parallel.layout import LAYOUTS, divisor

BACKENDS = ("auto", "cudnn", "reference", "flex")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MESSAGE_BYTES = 400  # a multiple of 8: packed into int64s


_ARITIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # inspect.signature costs ~15 us a call


def _positional_arity(fn) -> Optional[int]:
    try:
        return _ARITIES[fn]
    except (KeyError, TypeError):  # not seen yet, or not weakly referable
        pass
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    arity = None
    if not any(p.kind == p.VAR_POSITIONAL for p in params):
        arity = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)
    try:
        _ARITIES[fn] = arity
    except TypeError:
        pass
    return arity


def _tensor_error(name, t) -> Optional[str]:
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.layout != torch.strided:
        return f"{name} must be a dense (strided) tensor, got layout {t.layout}"
    if t.dim() != 4:
        return f"{name} must be 4-D [batch, heads, local_seq_len, head_dim], got shape {tuple(t.shape)}"
    if t.dtype not in DTYPES:
        return f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
    if t.shape[1] == 0 or t.shape[3] == 0:
        return f"{name} must have at least one head and a head dim > 0, got shape {tuple(t.shape)}"
    return None


def local_error(q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, group,
                sinks=None) -> Optional[str]:
    """What is wrong with this rank's arguments on ``group`` (None: one rank), or None."""
    world_size = dist.get_world_size(group) if group is not None else 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        error = _tensor_error(name, t)
        if error:
            return error
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return f"q, k and v must have one batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        return f"k and v must have the same heads and length, got shapes {tuple(k.shape)} and {tuple(v.shape)}"
    if q.shape[-1] != k.shape[-1]:
        return f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}"
    if q.shape[1] % k.shape[1]:
        return f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
    if q.shape[1] != k.shape[1] and not enable_gqa:
        return (f"q has {q.shape[1]} heads and k/v have {k.shape[1]}: pass enable_gqa=True for "
                "grouped-query attention")
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if backend not in BACKENDS:
        return f"backend must be one of {BACKENDS}, got {backend!r}"
    capture = comm.capture_error(q, group)
    if capture:
        return capture
    settings = config.errors()
    if settings:
        return "; ".join(settings)
    per_rank = divisor(layout, world_size) // world_size
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] % per_rank:
            return (f"local length of {name} ({t.shape[2]}) does not fit layout {layout!r}: it must be a "
                    f"multiple of {per_rank}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        return f"scale must be a finite number or None, got {scale!r}"
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point()
                              or tuple(sinks.shape) != (q.shape[1],) or sinks.device != q.device):
        got = (f"{type(sinks).__name__}" if not isinstance(sinks, torch.Tensor)
               else f"{sinks.dtype} of shape {tuple(sinks.shape)} on {sinks.device}")
        return f"sinks must be a floating-point tensor of one logit per query head, [{q.shape[1]}] on {q.device}, got {got}"
    for name, fn, arity, sig in (("score_mod", score_mod, 5, "(score, b, h, q_idx, kv_idx)"),
                                 ("mask_mod", mask_mod, 4, "(b, h, q_idx, kv_idx)")):
        if fn is None:
            continue
        if not callable(fn):
            return f"{name} must be callable or None, got {type(fn).__name__}"
        n = _positional_arity(fn)
        if n is not None and n != arity:
            return f"{name} must take {arity} arguments {sig}, but it takes {n}"
    return None


def digest(data: bytes) -> int:
    """A 63-bit hash of ``data``, the same in every process: a record field that stands for
    something longer (a mod, a list of shapes, a dtype)."""
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "little") >> 1


def fingerprint(fn, contents: bool = False, parts: Optional[List[object]] = None) -> int:
    """A 63-bit hash of what a mod computes: its code, constants and captured values
    (``parts``: its ``captured.parts``, where the caller walked them already).

    Captured tensors count by shape and dtype, and by their values only with ``contents``
    (a device-to-host copy, so only debug mode asks for it).
    """
    if fn is None:
        return 0
    data = []
    for part in captured.parts(fn) if parts is None else parts:  # by content, never by address: every process agrees
        if isinstance(part, torch.Tensor):
            data.append(repr((tuple(part.shape), part.dtype)).encode())
            if contents:
                data.append(part.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(part, types.CodeType):  # the functions defined inside it are parts of their own
            consts = [c if isinstance(c, captured.PLAIN) else type(c).__qualname__ for c in part.co_consts]
            data.append(part.co_code + repr((part.co_names, consts)).encode())
        elif isinstance(part, captured.PLAIN + (tuple,)):  # values and the walk's markers
            data.append(repr(part).encode())
        else:
            data.append(type(part).__qualname__.encode())
    return digest(b"".join(data))


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
    """An all_gather of every rank's record, under way."""

    def __init__(self, group, values: Sequence[int], error: Optional[str], what: str, error_type,
                 caller: Optional[str] = "ring_flex_attention"):
        self.group, self.what, self.error_type, self.count = group, what, error_type, len(values)
        self.prefix = f"{caller}: " if caller else ""
        values = list(values) if error is None else [0] * len(values)
        # The message travels as bytes packed into int64s: a tensor of one int per byte takes
        # 35 to 65 us to build on an H100's host, for a message that is empty on every good call.
        message = bytearray((error or "").encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0"))
        mine = torch.cat([torch.tensor([int(error is not None)] + values, dtype=torch.int64),
                          torch.frombuffer(message, dtype=torch.int64)])
        self.records = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        self.control = control_group(group)
        self.work = dist.all_gather(self.records, mine, group=self.control, async_op=True)
        self.stragglers = fault.Stragglers(group, what)

    def result(self) -> List[List[int]]:
        fault.wait_collective(self.work, self.control, self.what, ring_group=self.group, stragglers=self.stragglers)
        n = self.count
        for rank, rec in enumerate(self.records):
            if rec[0]:
                text = rec[1 + n:].numpy().tobytes().rstrip(b"\0").decode(errors="replace")
                raise self.error_type(f"{self.prefix}rank {rank}: {text}")
        return [rec[1:1 + n].tolist() for rec in self.records]


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
    ("layout", lambda a: LAYOUTS.index(a["layout"]), lambda n: repr(LAYOUTS[n])),
    ("backend", lambda a: BACKENDS.index(a["backend"]), lambda n: repr(BACKENDS[n])),
    ("kernel", lambda a: _kernel_code(a["kernel"]),  # "auto" may choose differently per rank
     lambda n: repr(BACKENDS[n]) if n < len(BACKENDS) else "another kernel"),
    ("enable_gqa", lambda a: int(bool(a["enable_gqa"])), lambda n: str(bool(n))),
    ("sinks", lambda a: int(a["sinks"] is not None), lambda n: "given" if n else "None"),
    ("scale", lambda a: -1 if a["scale"] is None else _bits(float(a["scale"])),
     lambda n: "None" if n == -1 else repr(_from_bits(n))),
    ("score_mod", lambda a: fingerprint(a["score_mod"], a["debug"]), lambda n: f"fingerprint {n:016x}"),
    ("mask_mod", lambda a: fingerprint(a["mask_mod"], a["debug"]), lambda n: f"fingerprint {n:016x}"),
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
    """The argument check of one call: ``wait()`` returns what ``prepare()`` returned, once
    every rank has agreed, or raises the same ``fault.CallRejected`` on every rank. After
    ``wait()``, ``shared[r]`` holds the ints rank r shared of its plan (see ``check``)."""

    def __init__(self, result=None, error: Optional[str] = None, cause=None, exchange: Optional[_Exchange] = None,
                 shared: Optional[List[List[int]]] = None):
        self.result, self.error, self.cause, self.exchange = result, error, cause, exchange
        self.shared = shared

    @property
    def failed_here(self) -> bool:
        """This rank cannot run the call (the others learn it from the exchange)."""
        return self.error is not None

    def wait(self):
        if self.exchange is None:
            if self.error:
                self._raise_interruption()
                raise fault.CallRejected(f"ring_flex_attention: {self.error}") from self.cause
            return self.result
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
        return self.result

    def _raise_interruption(self) -> None:
        """An interruption (KeyboardInterrupt, SystemExit) while planning stays itself on this
        rank, once the others have learnt of it: the caller's handlers of it must see it."""
        if self.cause is not None and not isinstance(self.cause, Exception):
            raise self.cause


def check(q, k, v, *, score_mod, mask_mod, group, layout, scale, enable_gqa, backend, sinks=None,
          return_lse: bool = False, debug: bool = False, prepare: Optional[Callable] = None,
          shares: Optional[Callable[[Any], List[int]]] = None, no_shares: Sequence[int] = (),
          kernel_of: Optional[Callable[[Any], str]] = None,
          learned_of: Optional[Callable[[Any], Sequence[torch.Tensor]]] = None) -> Agreement:
    """Checks this rank's arguments, runs ``prepare()`` and starts comparing with the other
    ranks of ``group``. No rank may start a transfer before ``wait()`` on the result returned:
    it raises the same ValueError on every rank if any rank's arguments are bad, ``prepare()``
    raised on any rank, or the ranks disagree. ``shares(prepare())``: ints of this rank's plan
    that every rank learns (``no_shares`` where it has none: it failed), so each knows how far
    the ring must run, which rows of a block any rank still needs, and what work the ranks have.
    ``kernel_of(prepare())``: the name of the kernel chosen, which every rank must share;
    ``learned_of(prepare())``: the tensors the mods read that require grad (with q, k, v and
    ``sinks``, whether backward will run the ring)."""
    world_size = dist.get_world_size(group) if group is not None else 1
    _raise_if_failed_before(group)
    error = local_error(q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, group, sinks)
    result, cause = None, None
    if error is None and prepare is not None:
        try:
            result = prepare()
        except BaseException as e:  # noqa: BLE001 (reported to every rank, re-raised by wait())
            # a KeyboardInterrupt too: leaving before the exchange would pair the other ranks'
            # check with this rank's next call
            error, cause = f"{type(e).__name__}: {e} (while planning the ring, before any transfer)", e
    mine = list(shares(result)) if shares is not None and error is None else list(no_shares)
    if group is None or world_size == 1:
        return Agreement(result, error, cause, shared=[mine])
    learned = learned_of(result) if learned_of is not None and error is None else ()
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (q, k, v, sinks, *learned))
    args = dict(q=q, k=k, v=v, layout=layout, backend=backend, enable_gqa=enable_gqa, scale=scale,
                score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, return_lse=return_lse, grad=grad, debug=debug,
                kernel=kernel_of(result) if kernel_of is not None and error is None else "auto")
    values = [0] * len(_FIELDS) if error else [get(args) for _, get, _ in _FIELDS]
    return Agreement(result, error, cause, _Exchange(group, values + mine, error, "the argument check",
                                                     fault.CallRejected))


def reject(group, error: str, no_shares: Sequence[int]):
    """Raises ``error`` as ``CallRejected`` on every rank of ``group``, as ``check`` does for a
    bad call: for a call this rank refuses before it reaches ``check`` (a model's attention
    call that cannot be routed, which may depend on this rank's tokens), while the other
    ranks' calls wait in their check. ``no_shares``: as ``check``'s, so the records match."""
    _raise_if_failed_before(group)
    exchange = None
    if group is not None and dist.get_world_size(group) > 1:
        exchange = _Exchange(group, [0] * len(_FIELDS) + list(no_shares), error, "the argument check",
                             fault.CallRejected)
    Agreement(error=error, exchange=exchange).wait()


def _raise_if_failed_before(group) -> None:
    failed = fault.failure(group)
    if failed:
        raise fault.RingFailure(f"ringflex: the ring on this process group failed earlier ({failed}); "
                                "create a new process group")
