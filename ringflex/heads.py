"""Heads x ring: attention over a 2-D DeviceMesh (its description and token order: ``parallel.mesh``).

``group=mesh``, where ``mesh`` is a 2-D DeviceMesh whose dimensions are named "heads" and
"ring" (sizes a x r), runs attention in two stages. Each rank holds [B, H, S/(a*r), D]: all
heads of its tokens. An all-to-all over "heads" (``parallel.alltoall``) turns that into
[B, H/a, S/r, D]: a slice of the heads, for the tokens of its whole heads group, which are
exactly the ring layout's segment of the rank's ring coordinate; the ring runs over "ring";
an all-to-all brings the output (and the LSE) back.

Mods see GLOBAL heads: the local head h on heads rank i is global head i*(H/a) + h. The ring
is given, per mod and head offset, one wrapper that calls the user's mod with ``h + offset``
(``at_global_heads``): plans and traces are kept by mod object, so the wrapper is the same
object at every call; the ranks of a ring share one offset, so their fingerprints agree.
``sinks`` [H] is sliced to the local heads. K/V heads are repeated up to lcm(Hkv, a) where
the heads dimension does not divide them (MQA, a few KV heads over many ranks), which gives
every rank whole groups of query heads; their gradients sum back through the repeat.

Failing together: every rank checks its call (shapes, the ring's argument check on the
shapes it will have, the mods' lookups at its heads and positions) and the ranks of the mesh
compare their records over a CPU group of all of them BEFORE the first all-to-all, so a bad
call raises the same ``CallRejected`` everywhere. Past that point a rank that raises (in the
ring, forward or backward, or in an all-to-all) marks the mesh failed (its heads, ring and
whole-mesh groups, ``parallel.fault``); the all-to-alls' waits look for that mark, so ranks
of other rings raise ``RingFailure`` instead of waiting, and the mesh stays failed.
"""
from __future__ import annotations

import itertools
import math
import types
from collections import OrderedDict
from typing import Callable, List, Optional

import torch
from torch import Tensor

from . import checks, config
from .cache import remember
from .mod.fingerprint import digest, fingerprint
from .mod.trace import tensors_requiring_grad
from .parallel import agreement, alltoall, fault
from .parallel.mesh import HeadsRing
from .plan import layout as layouts
from .plan.blocks import check_lookups

# --------------------------------------------------------------------------- mods at global heads

_WRAPPED: "OrderedDict[tuple, tuple]" = OrderedDict()  # (kind, id(mod), offset) -> (mod, wrapper)
_CODES: "OrderedDict[tuple, types.CodeType]" = OrderedDict()  # (kind, the user's code) -> the wrapper's code
_NUMBERS = itertools.count()


def _wrap(mod: Callable, kind: str, offset: int) -> Callable:
    if kind == "mask_mod":
        def mask_mod_at_global_heads(b, h, q_idx, kv_idx):
            return mod(b, h + offset, q_idx, kv_idx)
        fn = mask_mod_at_global_heads
    else:
        def score_mod_at_global_heads(score, b, h, q_idx, kv_idx):
            return mod(score, b, h + offset, q_idx, kv_idx)
        fn = score_mod_at_global_heads
    # A code object per code of the user's mods: the flex_attention kernel compiles one function
    # per pair of mod codes (``kernels.flex.compiled_flex_attention``), and one code for every
    # wrapped mod would put them all in one.
    user_code = getattr(mod, "__code__", type(mod))
    code = _CODES.get((kind, user_code))
    if code is None:
        code = remember(_CODES, (kind, user_code), fn.__code__.replace(co_name=f"{fn.__name__}_{next(_NUMBERS)}"), 256)
    wrapped = types.FunctionType(code, fn.__globals__, code.co_name, None, fn.__closure__)
    wrapped.__qualname__ = fn.__qualname__
    return wrapped


def at_global_heads(mod: Optional[Callable], kind: str, offset: int) -> Optional[Callable]:
    """``mod`` (a ``kind``: "score_mod" or "mask_mod") called with the global head ``h + offset``:
    the same object for the same mod and offset (the ring keeps traces and plans by mod object)."""
    if mod is None or offset == 0:
        return mod
    key = (kind, id(mod), offset)
    entry = _WRAPPED.get(key)
    if entry is None or entry[0] is not mod:
        entry = remember(_WRAPPED, key, (mod, _wrap(mod, kind, offset)), 64)
    else:
        _WRAPPED.move_to_end(key)
    return entry[1]


# --------------------------------------------------------------------------- the argument check

# What every rank of the mesh must agree on before the first all-to-all; shown by value where
# the value reads as a number.
_FIELDS = ("batch size", "query heads", "key/value heads", "local query length", "local key/value length",
           "head dim", "value head dim", "dtype", "device type", "layout", "backend", "enable_gqa", "sinks", "scale",
           "return_lse", "score_mod", "mask_mod", "gradient tracking (whether backward will run)")
_NUMBERS_SHOWN = 7


def _code(value) -> int:
    return digest(repr(value).encode())


def _tensor(name: str, t) -> str:
    if not isinstance(t, Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.dim() != 4:
        return f"{name} must be 4-D [batch, heads, local_seq_len, head_dim], got shape {tuple(t.shape)}"
    return ""


def _stand_in(like: Tensor, shape) -> Tensor:
    """A tensor of ``like``'s dtype and device in ``shape``, holding one element: what the
    ring's argument check reads of the tensors it will be given."""
    return like.new_empty(()).expand(*shape)


class _Call:
    """This rank's side of a call: what is wrong with it, or how it runs."""

    def __init__(self, mesh: HeadsRing, q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, sinks,
                 return_lse):
        self.error: Optional[str] = None
        self.values = [0] * len(_FIELDS)
        try:
            self.error = self._check(mesh, q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, sinks,
                                     return_lse) or None
        except Exception as e:  # noqa: BLE001 (a mod that fails its check: reported to every rank)
            self.error = f"{type(e).__name__}: {e} (while checking the call, before any transfer)"

    def _check(self, mesh, q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, sinks, return_lse):
        a = mesh.heads
        for name, t in (("q", q), ("k", k), ("v", v)):
            error = _tensor(name, t)
            if error:
                return error
        hq, hkv = q.shape[1], k.shape[1]
        if hq % a:
            return (f"q has {hq} heads, which the mesh's \"heads\" dimension of {a} ranks cannot split: the query "
                    f"heads must be a multiple of {a} (or pick a mesh of fewer heads ranks)")
        if hkv == 0 or k.shape[1] != v.shape[1]:
            return (f"k and v must have the same number of heads (at least one), got shapes {tuple(k.shape)} and "
                    f"{tuple(v.shape)}")
        if hq % hkv:
            return f"query heads ({hq}) must be a multiple of key/value heads ({hkv}): k has {hkv} heads"
        if hq != hkv and not enable_gqa:
            return f"q has {hq} heads and k/v have {hkv}: pass enable_gqa=True for grouped-query attention"
        if sinks is not None and (not isinstance(sinks, Tensor) or tuple(sinks.shape) != (hq,)
                                  or not sinks.is_floating_point() or sinks.device != q.device):
            got = (type(sinks).__name__ if not isinstance(sinks, Tensor)
                   else f"{sinks.dtype} of shape {tuple(sinks.shape)} on {sinks.device}")
            return f"sinks must be a floating-point tensor of one logit per query head, [{hq}] on {q.device}, got {got}"
        kv_heads = math.lcm(hkv, a)  # K/V heads after the repeat: every rank holds whole groups
        self.repeat = kv_heads // hkv
        local_q, local_kv = hq // a, kv_heads // a
        self.offset = mesh.head_rank * local_q
        self.sinks = None if sinks is None else sinks[self.offset:self.offset + local_q]
        self.score_mod = at_global_heads(score_mod, "score_mod", self.offset)
        self.mask_mod = at_global_heads(mask_mod, "mask_mod", self.offset)
        batch, q_len, kv_len = q.shape[0], q.shape[2] * a, k.shape[2] * a  # the ring's local lengths
        # The ring's own check of its arguments, on the shapes it will be given.
        given = [_stand_in(t, (t.shape[0], heads, t.shape[2] * a, t.shape[3]))
                 for t, heads in ((q, local_q), (k, local_kv), (v, local_kv))]
        error = checks.local_error(*given, score_mod, mask_mod, layout, scale, enable_gqa, backend,
                                     mesh.ring_group, self.sinks)
        if error:
            return error
        r, j = mesh.ring, mesh.ring_rank
        q_segs = layouts.segments(layout, q_len * r, r, j)
        kv_segs = [layouts.segments(layout, kv_len * r, r, (j - step) % r) for step in range(r)]
        # Lookups depend on the heads offset and the positions, so they may fail on some rings
        # only: checked here, where every rank of the mesh learns of it before any transfer.
        for kind, mod in (("score_mod", self.score_mod), ("mask_mod", self.mask_mod)):
            try:
                if mod is not None:
                    check_lookups(mod, kind, batch, local_q, q_segs, kv_segs, q.device)
            except Exception as e:  # noqa: BLE001 (reported to every rank)
                return (f"{kind} failed at this rank's global heads {self.offset} to {self.offset + local_q - 1}: "
                        f"{type(e).__name__}: {e}")
        self.tensors = tensors_requiring_grad(self.score_mod, q.device)
        self.grad = torch.is_grad_enabled() and any(
            isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, sinks, *self.tensors))
        debugging = config.debugging()
        self.values = [batch, hq, hkv, q.shape[2], k.shape[2], q.shape[3], v.shape[3], _code(q.dtype),
                       _code(q.device.type), _code(layout), _code(backend), int(bool(enable_gqa)),
                       int(sinks is not None), _code(None if scale is None else float(scale)), int(bool(return_lse)),
                       fingerprint(score_mod, debugging), fingerprint(mask_mod, debugging),
                       int(self.grad)]
        return None


def _raise_if_failed(mesh: HeadsRing) -> None:
    failed = mesh.failure()
    if failed:
        mesh.fail(failed)  # every group of the mesh, so that no rank waits on one this rank leaves
        raise fault.RingFailure(f"ringflex: the heads x ring mesh failed earlier ({failed}); create a new mesh")


def _agree(mesh: HeadsRing, values: List[int], error: Optional[str]) -> None:
    """Every rank's record, compared: the same ``CallRejected`` on every rank of the mesh if any
    rank's call is bad or the ranks' calls differ."""
    records = agreement.exchange(mesh.flat, values, error, "the heads x ring mesh's argument check",
                                fault.CallRejected)
    for i, name in enumerate(_FIELDS):
        seen = [record[i] for record in records]
        if len(set(seen)) > 1:
            shown = i < _NUMBERS_SHOWN
            detail = " (" + ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen)) + ")" if shown else ""
            raise fault.CallRejected(f"ring_flex_attention: the ranks of the heads x ring mesh disagree on the "
                                     f"{name}{detail}; every rank of the mesh must make the same call")


def reject(mesh: HeadsRing, error: str) -> None:
    """Raises ``error`` as ``CallRejected`` on every rank of the mesh, whose other ranks wait in
    their calls' argument check (a call refused before ``ring_flex_attention``)."""
    _raise_if_failed(mesh)
    _agree(mesh, [0] * len(_FIELDS), error)


class _Ring(torch.autograd.Function):
    """The ring over the mesh's "ring" dimension, run in an autograd graph of its own, so that
    an exception in its backward (which may hit one ring of the mesh only) fails the mesh
    before it leaves this rank: the ranks of the other rings then stop waiting in the
    backward's all-to-all."""

    @staticmethod
    def forward(ctx, mesh, run, q, k, v, sinks, *tensors):
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, sinks)]
        with torch.enable_grad():
            result = _guarded(mesh, "forward", run, *leaves)
        outputs = result if isinstance(result, tuple) else (result,)
        ctx.mesh, ctx.leaves, ctx.outputs, ctx.tensors = mesh, leaves, outputs, tensors
        ctx.set_materialize_grads(False)  # a loss that does not read the LSE costs no LSE backward
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        given = [(o, g) for o, g in zip(ctx.outputs, grads) if g is not None]
        wanted = [t for t in ctx.leaves if t is not None and t.requires_grad] + list(ctx.tensors)
        found = iter([None] * len(wanted))
        if given and wanted:
            found = iter(_guarded(ctx.mesh, "backward", torch.autograd.grad, [o for o, _ in given], wanted,
                                  [g for _, g in given], retain_graph=True, allow_unused=True,
                                  create_graph=torch.is_grad_enabled()))
        leaves = [next(found) if t is not None and t.requires_grad else None for t in ctx.leaves]
        return (None, None, *leaves, *found)


def _guarded(mesh: HeadsRing, phase: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        mesh.raised(e, f"the ring's {phase}")
        raise


def attention(mesh: HeadsRing, ring: Callable, q, k, v, *, score_mod, mask_mod, layout, scale, enable_gqa, return_lse,
              backend, sinks):
    """``ring_flex_attention`` over a heads x ring mesh (see the module's docstring); ``ring`` is
    the 1-D ring's ``ring_flex_attention``, run over the mesh's "ring" dimension."""
    _raise_if_failed(mesh)
    call = _Call(mesh, q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, sinks, return_lse)
    _agree(mesh, call.values, call.error)
    if call.repeat > 1:
        k, v = (t.repeat_interleave(call.repeat, dim=1) for t in (k, v))
    q, k, v = (alltoall.to_sequence(t, mesh, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))

    def run(q, k, v, sinks):
        return ring(q, k, v, score_mod=call.score_mod, mask_mod=call.mask_mod, group=mesh.ring_group, layout=layout,
                    scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, backend=backend, sinks=sinks)

    if call.grad:
        result = _Ring.apply(mesh, run, q, k, v, call.sinks, *call.tensors)
    else:
        result = _guarded(mesh, "forward", run, q, k, v, call.sinks)
    if not return_lse:
        return alltoall.to_heads(result[0] if isinstance(result, tuple) else result, mesh, "the output")
    out, lse = result
    return alltoall.to_heads(out, mesh, "the output"), alltoall.to_heads(lse, mesh, "the LSE")
