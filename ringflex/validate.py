"""Argument checks, on this rank and across the ring, before any point-to-point transfer.

A rank that rejects its arguments must not leave its neighbours waiting in a transfer, so
every rank first checks its own arguments, then all ranks exchange one small record (shapes,
dtypes, layout, mod fingerprints and any local error) over a CPU (gloo) group and raise
the same error together.
"""
from __future__ import annotations

import hashlib
import inspect
import math
from typing import Optional

import torch
import torch.distributed as dist

from .parallel.layout import LAYOUTS, divisor

BACKENDS = ("auto", "cudnn", "flex", "reference")
_MESSAGE_BYTES = 400
_FIELDS = ("batch size", "query heads", "key/value heads", "local query length", "local key/value length",
           "head dim", "value head dim", "dtype", "device type", "layout", "backend", "enable_gqa",
           "scale", "score_mod", "mask_mod")


def _positional_arity(fn) -> Optional[int]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def local_error(q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, world_size) -> Optional[str]:
    """What is wrong with this rank's arguments, or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must be 4-D [batch, heads, local_seq_len, head_dim], got shape {tuple(t.shape)}"
        if not t.is_floating_point():
            return f"{name} must be a floating-point tensor, got {t.dtype}"
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
    per_rank = divisor(layout, world_size) // world_size
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] % per_rank:
            return (f"local length of {name} ({t.shape[2]}) does not fit layout {layout!r}: it must be a "
                    f"multiple of {per_rank}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        return f"scale must be a finite number or None, got {scale!r}"
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


def _stable_hash(value) -> int:
    """A hash that is the same in every process (Python's own str hash is salted per process)."""
    return int.from_bytes(hashlib.sha1(repr(value).encode()).digest()[:8], "little") >> 1


def _feed(h, value, depth=0) -> None:
    """Hashes ``value`` by content, never by address, so every process agrees."""
    if depth > 8:
        return
    if isinstance(value, torch.Tensor):
        h.update(repr((tuple(value.shape), value.dtype)).encode())
    elif isinstance(value, (type(None), bool, int, float, complex, str, bytes)):
        h.update(repr(value).encode())
    elif isinstance(value, (tuple, list)):
        for item in value:
            _feed(h, item, depth + 1)
    elif hasattr(value, "co_code"):
        h.update(value.co_code)
        h.update(repr(value.co_names).encode())
        _feed(h, value.co_consts, depth + 1)
    elif hasattr(value, "__code__"):
        _feed(h, value.__code__, depth + 1)
        for cell in value.__closure__ or ():
            try:
                _feed(h, cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass
    elif hasattr(value, "func"):  # functools.partial
        _feed(h, (value.func, value.args, tuple(sorted(value.keywords.items()))), depth + 1)
    else:
        h.update(type(value).__qualname__.encode())


def fingerprint(fn) -> int:
    """A 63-bit hash of what a mod computes: its code, constants and captured values."""
    if fn is None:
        return 0
    h = hashlib.sha1()
    _feed(h, fn)
    return int.from_bytes(h.digest()[:8], "little") >> 1


_CONTROL_GROUPS = {}


def _control_group(group):
    """A group with the same ranks that can move CPU tensors (gloo), made once per group."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    if group not in _CONTROL_GROUPS:
        ranks = dist.get_process_group_ranks(group)
        _CONTROL_GROUPS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _CONTROL_GROUPS[group]


def _record(q, k, v, layout, backend, enable_gqa, scale, score_mod, mask_mod, error):
    values = [q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
              _stable_hash(q.dtype), _stable_hash(q.device.type), LAYOUTS.index(layout), BACKENDS.index(backend),
              int(enable_gqa), _stable_hash(scale), fingerprint(score_mod), fingerprint(mask_mod)] if error is None else [0] * len(_FIELDS)
    message = (error or "").encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    return torch.tensor([int(error is not None)] + values + list(message), dtype=torch.int64)


def check(q, k, v, *, score_mod, mask_mod, group, layout, scale, enable_gqa, backend) -> None:
    """Raises the same ValueError on every rank of ``group`` if any rank's arguments are bad
    or the ranks disagree; returns only when all agree."""
    world_size = dist.get_world_size(group) if group is not None else 1
    error = local_error(q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, world_size)
    if group is None or world_size == 1:
        if error:
            raise ValueError(f"ring_flex_attention: {error}")
        return
    mine = _record(q, k, v, layout, backend, enable_gqa, scale, score_mod, mask_mod, error)
    records = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(records, mine, group=_control_group(group))
    for rank, rec in enumerate(records):
        if rec[0]:
            text = bytes(rec[1 + len(_FIELDS):].tolist()).rstrip(b"\0").decode(errors="replace")
            raise ValueError(f"ring_flex_attention: rank {rank}: {text}")
    for i, field in enumerate(_FIELDS):
        seen = [int(rec[1 + i]) for rec in records]
        if len(set(seen)) > 1:
            detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen)) if i < 7 else "values differ"
            raise ValueError(f"ring_flex_attention: the ranks disagree on the {field} ({detail}); "
                             "every rank of the ring must make the same call")
