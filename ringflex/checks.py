"""The argument checks of a call on this rank: what is wrong with its own arguments, as a
message, not an exception (``local_error``). The caller raises it only once every rank of
the ring knows it (``parallel.agreement``), so no rank is left waiting in a transfer.
"""
from __future__ import annotations

import inspect
import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from . import config
from .kernels import BACKENDS
from .kernels.base import DTYPES
from .parallel import comm
from .plan.layout import divisor, layout_error

_ARITIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # inspect.signature is slow, at every call


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
    if layout_error(layout):
        return layout_error(layout)
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
