"""Heads x ring: context parallelism over a 2-D DeviceMesh.

``group=mesh``, where ``mesh`` is a 2-D DeviceMesh whose dimensions are named "heads" and
"ring" (sizes a x r), runs attention in two stages. Each rank holds [B, H, S/(a*r), D]: all
heads of its tokens. An all-to-all over "heads" (``parallel.heads``) turns that into
[B, H/a, S/r, D]: a slice of the heads, for the tokens of its whole heads group, which are
exactly the ring layout's segment of the rank's ring coordinate; the ring runs over "ring";
an all-to-all brings the output (and the LSE) back.

Token order (``positions``): the ring layout's segment of ring rank j (of r), split in a
contiguous pieces; the rank at heads coordinate i holds piece i.

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
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from . import config, validate
from .cache import remember
from .parallel import fault, heads as alltoall, layout as layouts
from .parallel.groups import process_group, rank_and_size, ring_of

DIMS = ("heads", "ring")


class HeadsRing:
    """A heads x ring DeviceMesh as this rank sees it."""

    def __init__(self, mesh: DeviceMesh):
        names = list(mesh.mesh_dim_names)
        if mesh.get_coordinate() is None:
            raise ValueError(f"group does not include this process (global rank {dist.get_rank()}): only the ranks of "
                             "the mesh may call ringflex with it")
        self.mesh = mesh
        self.heads_group, self.ring_group = mesh.get_group("heads"), mesh.get_group("ring")
        self.heads, self.ring = mesh.size(names.index("heads")), mesh.size(names.index("ring"))
        self.head_rank, self.ring_rank = mesh.get_local_rank("heads"), mesh.get_local_rank("ring")
        self._flat = None

    @property
    def size(self) -> int:
        return self.heads * self.ring

    @property
    def flat(self):
        """A process group of every rank of the mesh (for the argument check, ``unshard`` and
        the training helpers' sums), made at first use by every rank of the mesh."""
        if self._flat is None:
            if self.heads == 1:
                self._flat = self.ring_group
            elif self.ring == 1:
                self._flat = self.heads_group
            else:
                ranks = sorted(self.mesh.mesh.flatten().tolist())
                self._flat = dist.new_group(ranks, backend=dist.get_backend(self.heads_group),
                                            use_local_synchronization=True)
        return self._flat

    def coordinates(self) -> Dict[int, Tuple[int, int]]:
        """Global rank -> (heads coordinate, ring coordinate)."""
        names = list(self.mesh.mesh_dim_names)
        grid = self.mesh.mesh if names == list(DIMS) else self.mesh.mesh.t()
        return {int(grid[i, j]): (i, j) for i in range(self.heads) for j in range(self.ring)}

    def groups(self):
        return [g for g in dict.fromkeys((self.heads_group, self.ring_group, self._flat)) if g is not None]

    def failure(self) -> Optional[str]:
        return next((f for f in map(fault.failure, self.groups()) if f), None)

    def fail(self, message: str) -> None:
        """Marks every group of the mesh failed, here and (in their stores) for every rank."""
        for group in self.groups():
            fault.fail(group, message)

    def raised(self, error: BaseException, where: str) -> None:
        """Fails the mesh for ``error``, raised on this rank in ``where``. A ``RingFailure`` passes
        on what failed first; the ring's own text counts its ranks along "ring", which says so."""
        message = f"rank {dist.get_rank()} raised in {where}: {type(error).__name__}: {error}"
        if isinstance(error, fault.RingFailure):
            mesh_wide = next((f for f in map(fault.failure, self.groups()[::-1]) if f), None)
            ring = fault.failure(self.ring_group)
            if mesh_wide is not None and mesh_wide != ring:
                message = mesh_wide
            elif ring is not None:
                message = f"in the ring at heads coordinate {self.head_rank} (ranks counted along \"ring\"), {ring}"
        self.fail(message)


_MESHES: "OrderedDict[tuple, HeadsRing]" = OrderedDict()


def describe(group) -> Optional[HeadsRing]:
    """The ``HeadsRing`` of ``group`` where it is a 2-D DeviceMesh of dimensions "heads" and
    "ring" (in either order), else None (the 1-D ring's ``group``)."""
    if not isinstance(group, DeviceMesh) or group.ndim != 2 or sorted(group.mesh_dim_names or ()) != sorted(DIMS):
        return None
    heads_group, ring_group = group.get_group("heads"), group.get_group("ring")
    key = (id(heads_group), id(ring_group))
    found = _MESHES.get(key)
    if found is None or found.heads_group is not heads_group or found.ring_group is not ring_group:
        found = remember(_MESHES, key, HeadsRing(group), 16)
    return found


def group_or_mesh(group):
    """What a wrapper keeps of its ``group`` argument: a heads x ring mesh as it is, else its
    ProcessGroup (``process_group``, which refuses other meshes and objects)."""
    return group if describe(group) is not None else process_group(group)


def ring_key(group):
    """Equal for two ``group`` arguments that name the same ring (or heads x ring mesh)."""
    described = describe(group)
    return ring_of(group) if described is None else ("heads x ring", described.heads_group, described.ring_group)


def world_size(group) -> int:
    """How many ranks share the sequence: a x r over a heads x ring mesh."""
    described = describe(group)
    return rank_and_size(group)[1] if described is None else described.size


def flat(group):
    """The ProcessGroup over which a value summed over the sequence's ranks is summed (the
    loss, the parameters' gradients): every rank of a heads x ring mesh, else ``group``'s."""
    described = describe(group)
    return process_group(group) if described is None else described.flat


# --------------------------------------------------------------------------- token order

def divisor(layout: str, group) -> int:
    """A global length must be a multiple of this for ``layout`` over ``group``."""
    described = describe(group)
    if described is None:
        return layouts.divisor(layout, rank_and_size(group)[1])
    return math.lcm(layouts.divisor(layout, described.ring), described.size)


def positions(layout: str, seq_len: int, group, device=None, coordinate: Optional[Tuple[int, int]] = None) -> Tensor:
    """Global positions of the tokens of the rank at ``coordinate`` (heads, ring; default this
    rank's) of a heads x ring mesh ``group``: piece ``heads`` of the ring layout's segment of
    ring rank ``ring``."""
    described = describe(group)
    d = divisor(layout, group)
    if seq_len % d:
        raise ValueError(f"sequence length {seq_len} does not fit layout {layout!r} on a {described.heads} x "
                         f"{described.ring} heads x ring mesh: it must be a multiple of {d}")
    i, j = (described.head_rank, described.ring_rank) if coordinate is None else coordinate
    ring = layouts.positions(layout, seq_len, described.ring, j, device)
    piece = ring.numel() // described.heads
    return ring[i * piece:(i + 1) * piece]


def shard(x: Tensor, dim: int, mesh: HeadsRing, layout: str) -> Tensor:
    from .parallel.shard import _dim_error
    error = _dim_error("shard", x, dim) or ("" if layout in layouts.LAYOUTS else
                                            f"shard: layout must be one of {layouts.LAYOUTS}, got {layout!r}")
    if error:
        raise ValueError(error)
    return x.index_select(dim, positions(layout, x.shape[dim], mesh.mesh, x.device))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, mesh: HeadsRing, layout):
        from .parallel.shard import _check_same_shards
        group = mesh.flat
        _check_same_shards(x, dim, layout, group)
        parts = [torch.empty_like(x) for _ in range(mesh.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full_len = x.shape[dim] * mesh.size
        where = mesh.coordinates()
        order = torch.cat([positions(layout, full_len, mesh.mesh, x.device, where[r])
                           for r in dist.get_process_group_ranks(group)])
        ctx.dim, ctx.index = dim, positions(layout, full_len, mesh.mesh, x.device)
        return torch.cat(parts, dim).index_select(dim, torch.argsort(order))

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.dim, ctx.index), None, None, None


def unshard(x: Tensor, dim: int, mesh: HeadsRing, layout: str) -> Tensor:
    if mesh.size == 1:
        return shard(x, dim, mesh, layout)  # checks the arguments; the whole sequence
    return _Gather.apply(x, dim, mesh, layout)


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
    return validate.digest(repr(value).encode())


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
        error = validate.local_error(*given, score_mod, mask_mod, layout, scale, enable_gqa, backend,
                                     mesh.ring_group, self.sinks)
        if error:
            return error
        from .plan import check_lookups
        from .trace import tensors_requiring_grad
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
                       validate.fingerprint(score_mod, debugging), validate.fingerprint(mask_mod, debugging),
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
    records = validate.exchange(mesh.flat, values, error, "the heads x ring mesh's argument check",
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


def attention(mesh: HeadsRing, q, k, v, *, score_mod, mask_mod, layout, scale, enable_gqa, return_lse, backend,
              sinks):
    """``ring_flex_attention`` over a heads x ring mesh (see the module's docstring)."""
    from .api import ring_flex_attention
    _raise_if_failed(mesh)
    call = _Call(mesh, q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, sinks, return_lse)
    _agree(mesh, call.values, call.error)
    if call.repeat > 1:
        k, v = (t.repeat_interleave(call.repeat, dim=1) for t in (k, v))
    q, k, v = (alltoall.to_sequence(t, mesh, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))

    def run(q, k, v, sinks):
        return ring_flex_attention(q, k, v, score_mod=call.score_mod, mask_mod=call.mask_mod, group=mesh.ring_group,
                                   layout=layout, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                   backend=backend, sinks=sinks)

    if call.grad:
        result = _Ring.apply(mesh, run, q, k, v, call.sinks, *call.tensors)
    else:
        result = _guarded(mesh, "forward", run, q, k, v, call.sinks)
    if not return_lse:
        return alltoall.to_heads(result[0] if isinstance(result, tuple) else result, mesh, "the output")
    out, lse = result
    return alltoall.to_heads(out, mesh, "the output"), alltoall.to_heads(lse, mesh, "the LSE")
