"""The cuDNN hop kernel: cuDNN's fused SDPA with the user's mods compiled into the graph.

``score_mod`` / ``mask_mod`` are traced (``ringflex.trace``) and lowered into cuDNN's
score_mod callback. ``q_idx`` / ``kv_idx`` are generated indices plus the hop's global
offsets (and times the stride of striped layouts); offsets are pass-by-value scalars, so one
built graph serves every hop. Lookups of captured tensors (``doc[q_idx]``, ``slopes[h]``) are
computed in torch for the hop's positions and enter as broadcast tensors: cuDNN has no gather.
A mask becomes a select of -inf after the score modification. The backward's
``score_mod_bprop`` is the traced derivative (``trace.score_grad``).

A block is planned as one or more calls (``_Run``): without mask, plain SDPA; a mask that is
a diagonal band of ``q_idx - kv_idx`` (causal, sliding window) gets cuDNN's native band mask,
which skips tiles, once rows and columns that see nothing are cut off; other masks without a
score_mod are planned from the exact mask (keys every row sees unmasked, native bands where
the mask is one); with a score_mod, cuDNN takes no native mask, so the block is cut into row
chunks that skip empty key tiles (``SPLIT_DEPTH``). Calls that share a native mask (or none) and
no rows or columns (packed documents) run as one ragged batch (``_Batch``). docs/cudnn.md has
the measurements.
"""
from __future__ import annotations

import atexit
import functools
import gc
import math
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..cache import remember
from ..parallel.merge import RowMerge, RowSum, rows
from ..extents import row_extents
from ..plan import BlockKind, Segment, around, block_kinds
from ..trace import ModGraph, Node, UnsupportedModError, diagonal_band, evaluate, score_grad, trace_mask_mod, trace_score_mod
from . import _warn_once
from .base import Extent, Mods
from .reference import ReferenceKernel

# A masked block with a score_mod runs as 2**SPLIT_DEPTH row chunks (measured best: docs/cudnn.md).
SPLIT_DEPTH = 2
_TILE = 64  # sub-block sizes are multiples of cuDNN's tile
_MIN_CUDNN = 90600  # score_mod arrived in cuDNN 9.6
# Built graphs kept (LRU). Every distinct call shape needs its own: packed documents that
# cannot batch give one per document length, fwd and bwd, so a long packed sequence needs hundreds.
_MAX_GRAPHS = int(os.environ.get("RINGFLEX_CUDNN_GRAPHS", 2048))
_MAX_PLANS = 256


def _cudnn():
    import cudnn  # optional dependency: imported on first use only

    return cudnn


# --------------------------------------------------------------------------- handles and caches

_HANDLES: Dict[int, object] = {}
_GRAPHS: "OrderedDict[tuple, _Graph]" = OrderedDict()
_PLANS: "OrderedDict[tuple, List[_Run]]" = OrderedDict()
_LOWERINGS: "OrderedDict[tuple, _Lowering]" = OrderedDict()


def clear_cache() -> None:
    """Frees every built graph and handle (done at exit: live graphs make nanobind report leaks)."""
    _GRAPHS.clear()
    _PLANS.clear()
    _batched.cache_clear()
    _LOWERINGS.clear()
    _BANDS.clear()
    gc.collect()
    cudnn = sys.modules.get("cudnn")
    for handle in _HANDLES.values():
        cudnn.destroy_handle(handle)
    _HANDLES.clear()


atexit.register(clear_cache)


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    cudnn = _cudnn()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn.create_handle()
    handle = _HANDLES[index]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
    return handle


# --------------------------------------------------------------------------- what a call computes

@dataclass(frozen=True)
class _Program:
    """The traced mods of a call; ``mask`` is None when the block needs no mask."""

    score: Optional[ModGraph]
    mask: Optional[ModGraph]


def _program(mods: Mods, masked: bool, device) -> _Program:
    score = trace_score_mod(mods.score_mod, device) if mods.score_mod is not None else None
    mask = trace_mask_mod(mods.mask_mod, device) if masked and mods.mask_mod is not None else None
    return _Program(score, mask)


def _in_graph(n: Node) -> bool:
    """Whether ``n`` needs per-element work: it reads the score (or its gradient) or both indices."""
    return bool(n.deps & {"score", "grad"}) or {"q_idx", "kv_idx"} <= n.deps


def _needs_torch(n: Node, memo: Dict[int, bool]) -> bool:
    """Whether ``n`` reads a captured tensor or b / h: cuDNN cannot gather, and per-batch or
    per-head values are cheapest as a small input."""
    if id(n) not in memo:
        memo[id(n)] = n.op in ("index", "tensor") or bool(n.deps & {"b", "h"}) or any(_needs_torch(a, memo) for a in n.args)
    return memo[id(n)]


class _Lowering:
    """Splits the mods into cuDNN's per-element graph and its inputs: constants, the hop's
    offsets for the generated indices, and sub-expressions computed in torch (``hoisted``).
    Arithmetic on one index (``q_idx // width``) stays in the graph: cheaper than a load."""

    def __init__(self, score: Optional[ModGraph], mask: Optional[ModGraph], backward: bool):
        self.score, self.mask = score, mask
        self.grad = score_grad(score) if backward and score is not None else None
        self.consts = {0.0, 1.0, -math.inf}
        self.indices = set()
        self.hoisted: List[Node] = []
        seen, memo = set(), {}
        for graph in (score, mask, self.grad):
            if graph is not None:
                self._visit(graph.output, seen, memo)
        self.hoisted_ids = {id(n) for n in self.hoisted}
        self.key = (score and score.structure, mask and mask.structure, backward)

    def is_input(self, n: Node) -> bool:
        """Whether ``n`` enters the graph as an input value (constant or hoisted)."""
        return n.op == "const" or id(n) in self.hoisted_ids

    def _visit(self, n: Node, seen: set, memo: Dict[int, bool]) -> None:
        if id(n) in seen:
            return
        seen.add(id(n))
        if n.op == "const":
            self.consts.add(float(n.value))
            return
        if n.op in ("q_idx", "kv_idx"):
            self.indices.add(n.op)
            return
        if not _in_graph(n) and _needs_torch(n, memo):
            self.hoisted.append(n)
            return
        if n.op == "index":
            raise UnsupportedModError(
                "a captured tensor indexed by both q_idx and kv_idx (or by the score) cannot run in cuDNN, "
                "which has no gather; index it by q_idx or kv_idx alone")
        if n.op == "cast" and n.dtype.is_floating_point and n.dtype != torch.float32:
            raise UnsupportedModError(f"casting to {n.dtype} inside the mod is not supported by the cuDNN kernel")
        if n.op == "cast" and n.args[0].dtype.is_floating_point and not n.dtype.is_floating_point and n.dtype != torch.bool:
            raise UnsupportedModError("casting a float to an integer inside the mod is not supported by the cuDNN kernel")
        for a in n.args:
            self._visit(a, seen, memo)


def lowering_error(mods: Mods, device=None) -> Optional[str]:
    """Why the cuDNN kernel cannot compile these mods, or None."""
    try:
        program = _program(mods, True, device)
        _lowering(program.score, program.mask, backward=True)
    except UnsupportedModError as e:
        return str(e)
    return None


class _Emitter:
    """Emits the lowered mods into a cuDNN graph inside its score_mod callbacks.

    Two limits of cuDNN's fused kernel shape this. Its logical operations do not compile,
    so conditions are never combined into booleans: ``a & b ? t : f`` becomes
    ``a ? (b ? t : f) : f`` and so on, one select per comparison. And it rejects a graph
    input (constant, offset, hoisted tensor) in the first port of comparisons and selects,
    so operands are swapped or the comparison negated where that helps, and otherwise the
    input is first added to a computed zero.
    """

    def __init__(self, lowering: _Lowering, inputs: "_Inputs"):
        self.lowering, self.inputs = lowering, inputs
        self.memo: Dict[object, object] = {}
        self.g = self.base = self.zero = None

    def forward(self, g, score):
        self.g, self.base, self.zero, self.memo = g, score, None, {}
        out = score
        if self.lowering.score is not None:
            self.memo[id(self._leaf(self.lowering.score, "score"))] = score
            out = self._number(self.lowering.score.output)
        if self.lowering.mask is not None:
            out = self._choose(self.lowering.mask.output, out, self._const(-math.inf))
        return out

    def backward(self, g, grad):
        if self.lowering.grad is None:
            return grad
        self.g, self.base = g, grad
        self.memo[id(self._leaf(self.lowering.grad, "grad"))] = grad
        return self._number(self.lowering.grad.output)

    def release(self) -> None:
        """Drops the references to cuDNN objects once the graph is built."""
        self.g = self.base = self.zero = None
        self.memo = {}

    @staticmethod
    def _leaf(graph: ModGraph, name: str) -> Node:
        return next((n for n in graph.nodes if n.op == name), Node(name))

    # Values are FLOAT (numbers), INT32 (indices) or BOOLEAN (comparisons) cuDNN tensors.
    def _typed(self, t, dtype: str):
        t.set_data_type(getattr(_cudnn().data_type, dtype))
        return t

    def _const(self, value: float):
        return self.inputs.use(self.inputs.consts[float(value)])

    def _computed(self, t):
        """``t`` as a tensor computed inside the graph (see the class docstring)."""
        if not self.inputs.is_input(t):
            return t
        if self.zero is None:
            index = self._typed(self.g.gen_index(input=self.base, axis=3), "INT32")
            self.zero = self._op("sub", index, index)
        return self._op("add", self.zero, t)

    def _op(self, name: str, x, y=None):
        """One pointwise operation, with a computed tensor in its first port."""
        if y is not None and self.inputs.is_input(x):
            if name in _SWAPPED and not self.inputs.is_input(y):
                name, x, y = _SWAPPED[name], y, x
            else:
                x = self._computed(x)
        ports = _PORTS.get(name, ("input",))
        args = dict(zip(ports, (x, y) if y is not None else (x,)))
        t = getattr(self.g, name)(**args, compute_data_type=_cudnn().data_type.FLOAT)
        return self._typed(t, "BOOLEAN" if name.startswith("cmp") else "FLOAT")

    def _number(self, n: Node):
        """``n`` as a FLOAT tensor (booleans as 1.0 / 0.0)."""
        if n.dtype != torch.bool:
            return self._emit(n)
        key = ("number", id(n))
        if key not in self.memo:
            self.memo[key] = self._choose(n, self._const(1.0), self._const(0.0))
        return self.memo[key]

    def _choose(self, n: Node, t, f):
        """``n ? t : f`` for a boolean node ``n``."""
        computed = not self.lowering.is_input(n)
        if computed and n.op == "and":
            return self._choose(n.args[0], self._choose(n.args[1], t, f), f)
        if computed and n.op == "or":
            return self._choose(n.args[0], t, self._choose(n.args[1], t, f))
        if computed and n.op == "not":
            return self._choose(n.args[0], f, t)
        negate = self.inputs.is_input(t) and not self.inputs.is_input(f)
        if negate:
            t, f = f, t
        select = self.g.binary_select(input0=self._computed(t), input1=f, mask=self._condition(n, negate))
        return self._typed(select, "FLOAT")

    def _condition(self, n: Node, negate: bool):
        """A BOOLEAN tensor of ``n`` (of ``not n`` if ``negate``), ``n`` not an and / or / not."""
        key = ("condition", id(n), negate)
        if key in self.memo:
            return self.memo[key]
        if not self.lowering.is_input(n) and n.op in _CMP_CUDNN:
            name = _NEGATED[n.op] if negate else n.op
            t = self._op(_CMP_CUDNN[name], self._number(n.args[0]), self._number(n.args[1]))
        else:
            if self.lowering.is_input(n):
                value = self._emit(n)  # hoisted and constant conditions arrive as 1.0 / 0.0
            elif n.op == "where":
                value = self._choose(n.args[0], self._number(n.args[1]), self._number(n.args[2]))
            else:  # a cast to bool
                value = self._number(n.args[0])
            t = self._op("cmp_eq" if negate else "cmp_neq", value, self._const(0.0))
        self.memo[key] = t
        return t

    def _emit(self, n: Node):
        if id(n) not in self.memo:
            self.memo[id(n)] = self._lower(n)
        return self.memo[id(n)]

    def _lower(self, n: Node):
        if n.op == "const":
            return self._const(float(n.value))
        if id(n) in self.inputs.hoisted_index:
            return self.inputs.use(self.inputs.hoisted[self.inputs.hoisted_index[id(n)]])
        if n.op in ("q_idx", "kv_idx"):  # global position = start + stride * local index
            I = _cudnn().data_type.INT32
            index = self._typed(self.g.gen_index(input=self.base, axis=2 if n.op == "q_idx" else 3), "INT32")
            stride = self.inputs.strides.get(n.op)
            if stride is not None:
                index = self._typed(self.g.mul(a=index, b=self.inputs.use(stride), compute_data_type=I), "INT32")
            start = self.inputs.use(self.inputs.starts[n.op])
            return self._typed(self.g.add(a=index, b=start, compute_data_type=I), "INT32")
        op, a = n.op, n.args
        if op in _UNARY_CUDNN:
            return self._op(op, self._number(a[0]))
        if op in _BINARY_CUDNN:
            return self._op(_BINARY_CUDNN[op], self._number(a[0]), self._number(a[1]))
        if op in ("floordiv", "mod"):
            x, y = self._number(a[0]), self._number(a[1])
            floor = self._op("floor", self._op("div", x, y))
            return floor if op == "floordiv" else self._op("sub", x, self._op("mul", y, floor))  # Python's sign
        if op == "where":
            return self._choose(a[0], self._number(a[1]), self._number(a[2]))
        if op == "cast":
            return self._number(a[0])  # numbers are fp32 inside the graph
        raise UnsupportedModError(f"operation {op} cannot be lowered to cuDNN")


_UNARY_CUDNN = {"neg", "abs", "exp", "log", "sqrt", "tanh", "sigmoid", "floor"}
_BINARY_CUDNN = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "minimum": "min", "maximum": "max",
                 "pow": "pow", "tanh_backward": "tanh_backward", "sigmoid_backward": "sigmoid_backward"}
_CMP_CUDNN = {"eq": "cmp_eq", "ne": "cmp_neq", "lt": "cmp_lt", "le": "cmp_le", "gt": "cmp_gt", "ge": "cmp_ge"}
_NEGATED = {"eq": "ne", "ne": "eq", "lt": "ge", "ge": "lt", "le": "gt", "gt": "le"}
_PORTS = {
    **{name: ("a", "b") for name in ("add", "sub", "mul", "div")},
    **{name: ("input0", "input1") for name in ("min", "max", "pow")},
    **{name: ("input", "comparison") for name in _CMP_CUDNN.values()},
    "tanh_backward": ("loss", "input"), "sigmoid_backward": ("loss", "input"),
}
# x op y == y op' x
_SWAPPED = {"add": "add", "mul": "mul", "min": "min", "max": "max", "cmp_eq": "cmp_eq", "cmp_neq": "cmp_neq", "cmp_lt": "cmp_gt",
            "cmp_gt": "cmp_lt", "cmp_le": "cmp_ge", "cmp_ge": "cmp_le"}


class _Inputs:
    """The graph inputs a lowering may need, created before the graph is frozen. The
    callbacks record which they ``use``; ``order`` lists those once the graph is built."""

    def __init__(self, g, lowering: _Lowering, shapes: Dict[str, int], strided: Dict[str, bool], backward: bool):
        cudnn = _cudnn()
        F, I = cudnn.data_type.FLOAT, cudnn.data_type.INT32
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True)
        self.consts = {v: g.tensor(name=f"const{i}", data_type=F, **scalar) for i, v in enumerate(sorted(lowering.consts))}
        self.starts = {k: g.tensor(name=f"{k}_start", data_type=I, **scalar) for k in sorted(lowering.indices)}
        self.strides = {k: g.tensor(name=f"{k}_stride", data_type=I, **scalar) for k in sorted(lowering.indices) if strided[k]}
        # By position in ``lowering.hoisted``: a cached graph serves every mod of the same
        # structure, and each call binds the values of its own mod's nodes.
        self.hoisted: List[object] = []
        self.hoisted_dims: List[List[int]] = []
        self.hoisted_index: Dict[int, int] = {}
        full = [shapes[d] for d in ("b", "h", "q_idx", "kv_idx")]
        for i, n in enumerate(lowering.hoisted):
            dims = [size if d in n.deps else 1 for size, d in zip(full, ("b", "h", "q_idx", "kv_idx"))]
            dim, stride = _hoisted_layout(dims, full, backward)
            self.hoisted.append(g.tensor(name=f"hoisted{i}", dim=dim, stride=stride, data_type=F))
            self.hoisted_dims.append(dims)
            self.hoisted_index[id(n)] = i
        self.ids = {id(t) for t in [*self.consts.values(), *self.starts.values(), *self.strides.values(), *self.hoisted]}
        self.used = set()
        self.order: List[object] = []

    def is_input(self, t) -> bool:
        return id(t) in self.ids

    def use(self, t):
        self.used.add(id(t))
        return t

    def freeze(self) -> None:
        self.consts = {v: t for v, t in self.consts.items() if id(t) in self.used}
        self.starts = {k: t for k, t in self.starts.items() if id(t) in self.used}
        self.strides = {k: t for k, t in self.strides.items() if id(t) in self.used}
        self.hoisted_used = [i for i, t in enumerate(self.hoisted) if id(t) in self.used]
        self.order = [*self.consts.values(), *self.starts.values(), *self.strides.values(),
                      *(self.hoisted[i] for i in self.hoisted_used)]

    def buffers(self, q: Tensor, q_seg: Segment, kv_seg: Segment, lowering: _Lowering) -> List:
        """This call's values, in ``order``."""
        segs = {"q_idx": q_seg, "kv_idx": kv_seg}
        values = [_scalar(v, torch.float32) for v in self.consts]
        values += [_scalar(segs[k].start, torch.int32) for k in self.starts]
        values += [_scalar(segs[k].stride, torch.int32) for k in self.strides]
        if self.hoisted_used:
            env = _index_env(q.shape[0], q.shape[1], q_seg, kv_seg, q.device)
            for i in self.hoisted_used:
                value = evaluate(lowering.hoisted[i], env)
                values.append(torch.broadcast_to(value, self.hoisted_dims[i]).to(torch.float32).contiguous())
        return values


def _hoisted_layout(dims: List[int], full: List[int], backward: bool) -> Tuple[List[int], List[int]]:
    """The descriptor of a compact hoisted tensor of broadcast shape ``dims``.

    Described as ``dims`` itself (e.g. [1, 1, S_q, 1]), cuDNN's backward reads per-token
    values wrong, so there it gets the score's full shape with stride 0 along the broadcast
    axes; the forward reads both right, and the compact form faster (measured: docs/cudnn.md).
    """
    compact = _contiguous_strides(dims)
    if backward and (dims[2] > 1 or dims[3] > 1):
        return list(full), [0 if d == 1 else stride for d, stride in zip(dims, compact)]
    return dims, compact


_SCALARS: Dict[tuple, Tensor] = {}


def _scalar(value, dtype: torch.dtype) -> Tensor:
    """A pass-by-value scalar; cached, since cuDNN reads its value when a call is enqueued."""
    key = (value, dtype)
    if key not in _SCALARS:
        if len(_SCALARS) > 4096:
            _SCALARS.clear()
        _SCALARS[key] = torch.full((1, 1, 1, 1), value, dtype=dtype)
    return _SCALARS[key]


def _contiguous_strides(dims: List[int]) -> List[int]:
    strides, acc = [], 1
    for d in reversed(dims):
        strides.append(acc)
        acc *= d
    return strides[::-1]


# --------------------------------------------------------------------------- graphs

@dataclass
class _Graph:
    """A built cuDNN graph and how to bind its tensors (by uid, in a fixed order)."""

    graph: object
    names: Tuple[str, ...]  # the attention tensors, first in the order
    inputs: Optional[_Inputs]
    workspace: int
    uids: List[int]

    def execute(self, tensors: Dict[str, Tensor], q_seg: Optional[Segment], kv_seg: Optional[Segment],
                lowering: Optional[_Lowering]) -> None:
        q = tensors["q"]
        buffers = [tensors[name] for name in self.names]
        if self.inputs is not None:
            buffers += self.inputs.buffers(q, q_seg, kv_seg, lowering)
        workspace = torch.empty(max(1, self.workspace), dtype=torch.uint8, device=q.device)
        self.graph.execute(buffers, workspace, handle=_handle(q.device), tensor_uids=self.uids)


def _index_env(batch: int, heads: int, q_seg: Segment, kv_seg: Segment, device) -> Dict[str, Tensor]:
    """(b, h, q_idx, kv_idx) of a hop as broadcastable int32 tensors, as flex_attention passes them."""
    return {
        "b": torch.arange(batch, device=device, dtype=torch.int32).view(-1, 1, 1, 1),
        "h": torch.arange(heads, device=device, dtype=torch.int32).view(1, -1, 1, 1),
        "q_idx": q_seg.positions(device).view(1, 1, -1, 1),
        "kv_idx": kv_seg.positions(device).view(1, 1, 1, -1),
    }


_FORWARD_INPUTS = ("q", "k", "v")
_BACKWARD_INPUTS = ("q", "k", "v", "out", "dout", "lse")
_RAGGED_AXIS = {**dict.fromkeys(("q", "out", "lse", "dout", "dq"), "q"), **dict.fromkeys(("k", "v", "dk", "dv"), "kv")}
_DTYPES = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT"}


def _layout(t: Tensor, ragged: bool) -> tuple:
    """What a graph bakes in of ``t``. A ragged graph reads its rows through offsets and
    lengths (``_Ragged``): only heads, head_dim and the strides between them count."""
    if ragged:
        return t.shape[1], t.shape[3:], t.stride()[1:], t.dtype
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _band_kwargs(band: Tuple[Optional[int], Optional[int]]) -> dict:
    left, right = band
    if left is None and right == 0:
        return dict(use_causal_mask=True)
    kwargs = dict(diagonal_alignment=_cudnn().diagonal_alignment.TOP_LEFT)
    if right is not None:
        kwargs["diagonal_band_right_bound"] = right
    if left is not None:
        kwargs["diagonal_band_left_bound"] = left
    return kwargs


def _graph(backward: bool, tensors: Dict[str, Tensor], scale: float, band, lowering: Optional[_Lowering],
           strided: Dict[str, bool], ragged: Optional["_Ragged"] = None) -> _Graph:
    """The built graph for this call's layouts and mods, from the cache when it was built before."""
    q = tensors["q"]
    key = (backward, q.device, scale, band, lowering and lowering.key,
           tuple(sorted(strided.items())) if lowering and lowering.indices else None, ragged,
           tuple((name, _layout(t, ragged is not None)) for name, t in sorted(tensors.items())))
    if key in _GRAPHS:
        _GRAPHS.move_to_end(key)
        return _GRAPHS[key]
    if len(_GRAPHS) >= _MAX_GRAPHS:
        _warn_once(f"ringflex: the cuDNN graph cache is full ({_MAX_GRAPHS} graphs): older graphs are dropped and "
                   "rebuilt when needed again (0.1 to 1.5 s each); raise RINGFLEX_CUDNN_GRAPHS if this "
                   "workload has that many call shapes")
    return remember(_GRAPHS, key, _build(backward, tensors, scale, band, lowering, strided, ragged), _MAX_GRAPHS)


def _build(backward: bool, tensors: Dict[str, Tensor], scale: float, band, lowering: Optional[_Lowering],
           strided: Dict[str, bool], ragged: Optional["_Ragged"]) -> _Graph:
    cudnn = _cudnn()
    F = cudnn.data_type.FLOAT
    q = tensors["q"]
    g = cudnn.pygraph(io_data_type=getattr(cudnn.data_type, _DTYPES[q.dtype]), intermediate_data_type=F,
                      compute_data_type=F, handle=_handle(q.device))
    io, offsets = {}, {}
    if ragged is not None:  # int32 inputs: each sequence's element offset per tensor, and its lengths
        scalars = dict(stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        offsets = {name: g.tensor(name=f"{name}_offsets", dim=[ragged.count + 1, 1, 1, 1], **scalars)
                   for name in tensors if name in _RAGGED_AXIS}
        io.update({f"{name}_offsets": t for name, t in offsets.items()})
        io.update({name: g.tensor(name=name, dim=[ragged.count, 1, 1, 1], **scalars) for name in ("seq_q", "seq_kv")})

    def describe(name: str, t: Tensor) -> dict:
        if ragged is None:
            return dict(dim=list(t.shape), stride=list(t.stride()))
        n = ragged.max_q if _RAGGED_AXIS[name] == "q" else ragged.max_kv
        return dict(dim=[ragged.count, t.shape[1], n, t.shape[3]], stride=[n * t.stride(2), *t.stride()[1:]])

    io.update({name: g.tensor(name=name, data_type=getattr(cudnn.data_type, _DTYPES[t.dtype]), **describe(name, t),
                              **({"ragged_offset": offsets[name]} if ragged is not None else {}))
               for name, t in tensors.items() if name in (_BACKWARD_INPUTS if backward else _FORWARD_INPUTS)})
    kwargs = dict(attn_scale=scale)
    if band is not None:
        kwargs.update(_band_kwargs(band))
    if ragged is not None:
        kwargs.update(use_padding_mask=True, seq_len_q=io["seq_q"], seq_len_kv=io["seq_kv"])
        if backward:  # bounds the workspace, which is sized for count x max lengths otherwise
            kwargs.update(max_total_seq_len_q=ragged.total_q, max_total_seq_len_kv=ragged.total_kv)
    inputs = emitter = None
    callbacks = []
    if lowering is not None:
        shapes = {"b": q.shape[0], "h": q.shape[1], "q_idx": q.shape[2], "kv_idx": tensors["k"].shape[2]}
        inputs = _Inputs(g, lowering, shapes, strided, backward)
        emitter = _Emitter(lowering, inputs)
        callbacks.append(_Callback(emitter.forward))
        kwargs["score_mod"] = callbacks[-1]
        if backward:
            callbacks.append(_Callback(emitter.backward))
            kwargs["score_mod_bprop"] = callbacks[-1]
    if backward:
        outs = g.sdpa_backward(q=io["q"], k=io["k"], v=io["v"], o=io["out"], dO=io["dout"], stats=io["lse"],
                               name="sdpa_backward", **kwargs)
        names = ("dq", "dk", "dv")
    else:
        outs = g.sdpa(q=io["q"], k=io["k"], v=io["v"], generate_stats=True, name="sdpa", **kwargs)
        names = ("out", "lse")
    for name, t in zip(names, outs):
        ref, layout = tensors[name], describe(name, tensors[name])
        t.set_output(True).set_dim(layout["dim"]).set_stride(layout["stride"])
        t.set_data_type(getattr(cudnn.data_type, _DTYPES[ref.dtype]))
        if ragged is not None:
            t.set_ragged_offset(offsets[name])
        io[name] = t
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    order = [io[name] for name in io]
    for callback in callbacks:
        callback.release()
    if emitter is not None:
        emitter.release()
        inputs.freeze()
        order += inputs.order
    return _Graph(g, tuple(io), inputs, g.get_workspace_size(), [t.get_uid() for t in order])


class _Callback:
    """A score_mod callback as handed to the frontend, which lets go of what it reaches once
    the graph is built. The frontend (1.32) wraps a callback in a closure over its lowering,
    whose closure holds the C++ graph, which holds the wrapper: a cycle through C++ that
    Python's collector cannot see, so every such graph would outlive the cache (and nanobind
    would report it leaked at exit). Emptying the callback and the lowering's closure (kept
    from the graph wrapper the frontend passes in) breaks the cycle."""

    def __init__(self, fn):
        self.fn, self.lowerings = fn, []

    def __call__(self, graph, tensor):
        lowering = getattr(graph, "_lower", None)  # the frontend's wrapper around the C++ graph
        if lowering is not None:
            self.lowerings.append(lowering)
        return self.fn(graph, tensor)

    def release(self) -> None:
        for lowering in self.lowerings:
            for cell in getattr(lowering, "__closure__", None) or ():
                cell.cell_contents = None
        self.fn, self.lowerings = None, []


# --------------------------------------------------------------------------- planning a block

@dataclass(frozen=True)
class _Run:
    """One cuDNN call inside a block: local rows x columns, with the mask as a select
    (``masked``), as cuDNN's native band ``(left_bound, right_bound)``, or without mask."""

    rows: Tuple[int, int]
    cols: Tuple[int, int]
    masked: bool = False
    band: Optional[Tuple[Optional[int], Optional[int]]] = None

    @property
    def row_spans(self) -> Tuple[Tuple[int, int], ...]:  # as a ``_Batch`` has them
        return (self.rows,)

    @property
    def col_spans(self) -> Tuple[Tuple[int, int], ...]:
        return (self.cols,)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_MIN_FULL = 4 * _TILE  # narrowest column range worth its own call


def band_runs(band: Tuple[Optional[int], Optional[int]], q_seg: Segment, kv_seg: Segment) -> Optional[List[_Run]]:
    """The block as calls with cuDNN's native band mask (at most two), or None where it cannot be.

    The mask keeps ``lo <= q_pos - kv_pos <= hi`` with ``pos = start + stride * i``, that is
    local columns ``j`` in ``[i + a, i + b]``. cuDNN's band must contain the diagonal
    (``a <= 0 <= b``), so rows before the band starts or columns after it ends, which see
    nothing, are cut off first.
    """
    if q_seg.stride != kv_seg.stride:
        return None
    lo, hi = band
    t, d = q_seg.stride, q_seg.start - kv_seg.start
    a = None if hi is None else -((hi - d) // t)  # i - j <= floor((hi - d) / t)
    b = None if lo is None else -_ceil_div(lo - d, t)  # i - j >= ceil((lo - d) / t)
    n_q, n_k = q_seg.length, kv_seg.length
    if a is not None and b is not None and a > b:
        return []
    r0 = max(0, -b) if b is not None else 0
    c0 = max(0, a) if a is not None else 0
    r1 = min(n_q, n_k - a) if a is not None else n_q
    c1 = min(n_k, n_q + b) if b is not None else n_k
    if r0 >= r1 or c0 >= c1:
        return []
    a = None if a is None or a + r0 - c0 <= -(r1 - r0 - 1) else a + r0 - c0
    b = None if b is None or b + r0 - c0 >= c1 - c0 - 1 else b + r0 - c0
    if a is None and b is None:
        return [_Run((r0, r1), (c0, c1))]
    if a is not None and r1 - r0 > c1 - c0:  # cuDNN's sliding window needs s_q <= s_kv
        return None
    if b is not None and _MIN_FULL <= b + 1 < c1 - c0:
        # A right bound off the diagonal (a window's queries against their own and the
        # previous block of keys; a document that began in an earlier block): cuDNN's
        # backward takes 1.2x (right bound only) to 1.9x (both) as long per pair as with the
        # right bound on the diagonal (H200, scripts/band_probe.py). Keys up to c0 + b meet
        # only the left bound, if any; on the rest the right bound is the diagonal.
        split = c0 + b + 1
        left = band_runs(band, q_seg, kv_seg.slice(0, split))
        right = band_runs(band, q_seg, kv_seg.slice(split, n_k))
        if left is not None and right is not None:
            return left + [_Run(r.rows, (split + r.cols[0], split + r.cols[1]), band=r.band) for r in right]
    return [_Run((r0, r1), (c0, c1), band=(None if a is None else 1 - a, b))]


def _plan_key(mask: ModGraph, *rest) -> tuple:
    """A plan depends on the mask's values: its captured tensors by identity and version."""
    return (mask.fingerprint, tuple((id(t), t._version) for t in mask.tensors())) + rest


def split_runs(mods: Mods, mask: ModGraph, batch: int, heads: int, q_seg: Segment, kv_seg: Segment,
               depth: int, device) -> List[_Run]:
    """The block cut into 2**depth row chunks, each one call over the key tiles (of the same
    size) from its first to its last non-empty one: empty tiles around it are skipped, and
    no partial results need merging. Masked unless every tile in the span is full."""
    n = 1 << depth
    block_q = _TILE * _ceil_div(_ceil_div(q_seg.length, n), _TILE)
    block_kv = _TILE * _ceil_div(_ceil_div(kv_seg.length, n), _TILE)
    batch, heads = (batch if "b" in mask.deps else 1), (heads if "h" in mask.deps else 1)
    key = _plan_key(mask, "split", batch, heads, q_seg, kv_seg, block_q, block_kv, str(device))
    if key in _PLANS:
        return _PLANS[key]
    runs = []
    for i, row in enumerate(block_kinds(mods.mask_mod, batch, heads, q_seg, kv_seg, block_q, block_kv, device).tolist()):
        tiles = [j for j, kind in enumerate(row) if kind != BlockKind.EMPTY]
        if tiles:
            span = row[tiles[0]:tiles[-1] + 1]
            runs.append(_Run((i * block_q, min(q_seg.length, (i + 1) * block_q)),
                             (tiles[0] * block_kv, min(kv_seg.length, (tiles[-1] + 1) * block_kv)),
                             masked=any(kind != BlockKind.FULL for kind in span)))
    return remember(_PLANS, key, runs, _MAX_PLANS)


# Row groups and calls of an exact plan. Groups whose runs join one ragged batch (packed
# documents) cost planning time alone (H100, documents of ~1024 tokens: up to 64 groups made
# rank 1's hops at 64k tokens 10.9 -> 5.7 ms per fwd+bwd, where 16 left its block to quadrants);
# calls that stay single (a fragmented mask) cost host time at every call.
_MAX_GROUPS = 64
_MAX_SINGLE_CALLS = 16


def exact_runs(mods: Mods, mask: ModGraph, q_seg: Segment, kv_seg: Segment, device) -> Optional[List[_Run]]:
    """The block from its exact mask, for masks that are the same for every batch and head:
    query rows grouped by their first visible key (a packed document, say); in each group the
    keys every row sees run unmasked, and the rest with cuDNN's native band mask where the mask
    is a band there (causal inside a document), else masked. None where that is too fragmented
    (or too large to evaluate: ``extents.row_extents``)."""
    if mask.deps & {"b", "h"}:
        return None
    key = _plan_key(mask, "exact", q_seg, kv_seg, str(device))
    if key in _PLANS:
        return _PLANS[key]
    extents = row_extents(mods.mask_mod, mask, q_seg, kv_seg, device)
    return remember(_PLANS, key, None if extents is None else _grouped_runs(extents), _MAX_PLANS)


def _grouped_runs(extents: Tensor) -> Optional[List[_Run]]:
    """The runs of a block from its ``extents.row_extents``: one group of rows per first
    visible key; None beyond ``_MAX_GROUPS`` of them, or ``_MAX_SINGLE_CALLS`` calls outside a
    ragged batch (``_batched``)."""
    first = extents[0]
    starts = torch.nonzero(torch.diff(first, prepend=first.new_full((1,), -2))).flatten().tolist()
    if len(starts) > 2 * _MAX_GROUPS:
        return None
    groups = [(r0, r1) for r0, r1 in zip(starts, starts[1:] + [len(first)]) if first[r0] >= 0]
    if len(groups) > _MAX_GROUPS:
        return None
    runs = [run for r0, r1 in groups for run in _group_runs(extents[:, r0:r1], r0)]
    singles = sum(not isinstance(call, _Batch) for call in _batched(tuple(runs), True))
    return runs if singles <= _MAX_SINGLE_CALLS else None


def _group_runs(extents: Tensor, r0: int) -> List[_Run]:
    """Runs for the rows from r0 on that ``extents`` (``extents.row_extents``) describe, which all
    see their first key at the same c0: native band calls where the rows' keys form a band (a
    document that began in an earlier block: every key from c0 to the diagonal, see
    ``band_runs``), else the leading keys all of them see unmasked, then the rest as a native
    band where it is one, else masked."""
    first, last, run_end, count = extents
    c0, c1, r1 = int(first[0]), int(last.max()) + 1, r0 + extents.shape[1]
    ends = last - c0  # the last key each row sees, from c0; it sees all before it if contiguous
    contiguous = bool((count == last - first + 1).all())
    whole = _band_of(ends, c1 - c0) if contiguous else None
    if whole is not None:
        return [_shifted(r, r0, c0) for r in whole]
    full = min(int(run_end.min()), c1) - c0  # the keys every row sees
    if full < max(_MIN_FULL, (c1 - c0) // 8):  # a narrow call and a merge cost more than they save
        full = 0
    runs = [_Run((r0, r1), (c0, c0 + full))] if full else []
    if full == c1 - c0:
        return runs
    band = _band_of(ends - full, c1 - c0 - full) if contiguous else None
    if band is None:
        return runs + [_Run((r0, r1), (c0 + full, c1), masked=True)]
    return runs + [_shifted(r, r0, c0 + full) for r in band]


def _band_of(ends: Tensor, cols: int) -> Optional[List[_Run]]:
    """Rows that each see keys 0 to ``ends[i]`` of ``cols`` (none where it is negative) as
    native band calls, or None where they form no band."""
    n = len(ends)
    i = torch.arange(n)
    seen = ends >= 0
    # The band that keeps keys [i + a, i + b] of row i, from the rows that see keys: each of
    # them then starts at key 0 and sees some, so the band is theirs where each row's last key
    # is i + b (or the last column) and the rows that see none are outside it.
    a, b = -int(torch.where(seen, i, -1).max()), int(torch.where(seen, ends - i, -n - cols).max())
    hi = (i + b).clamp(max=cols - 1)
    if not torch.equal(torch.where((i + a).clamp(min=0) <= hi, hi, -1), torch.where(seen, ends, -1)):
        return None
    return band_runs((-b, -a), Segment(0, 1, n), Segment(0, 1, cols))


def _shifted(run: _Run, r0: int, c0: int) -> _Run:
    return _Run((r0 + run.rows[0], r0 + run.rows[1]), (c0 + run.cols[0], c0 + run.cols[1]), band=run.band)


def _area(runs: List[_Run]) -> int:
    return sum((r.rows[1] - r.rows[0]) * (r.cols[1] - r.cols[0]) for r in runs)


@dataclass(frozen=True)
class _Ragged:
    """What a ragged graph is built for: sequences, their longest rows and columns, and the
    rows and columns in all, rounded up to powers of two, so that a few graphs serve every
    layout of documents. On the query side both are the rows of the whole block the queries
    are cut from (``_query_rows``): every cut of one block shares them. The tensors' heads are
    as many rows apart (``_padded_empty``; keys: ``ring.widened``)."""

    count: int
    max_q: int
    max_kv: int
    total_q: int
    total_kv: int


class _Batch:
    """Runs of a block computed by one cuDNN call, as the sequences of a ragged batch: each
    starts at its own offset into the block's tensors and has its own lengths (cuDNN's padding
    mask). They share one native mask and no rows or columns, so every output and gradient row
    has one writer. Packed documents: one call per hop instead of one per document. Its rows
    and columns are merged as the spans they form (``row_spans``, ``col_spans``), not per run."""

    def __init__(self, runs: Tuple[_Run, ...]):
        self.runs, self.band = runs, runs[0].band
        self.spans = {"q": [r.rows for r in runs], "kv": [r.cols for r in runs]}
        self.row_spans, self.col_spans = _joined(self.spans["q"]), _joined(self.spans["kv"])
        self._int32s: Dict[tuple, Tensor] = {}

    def inputs(self, tensors: Dict[str, Tensor]) -> Tuple[_Ragged, Dict[str, Tensor]]:
        """The ragged description over these tensors, and its int32 inputs: per tensor the
        element offset of each sequence, and the sequences' lengths (made once per layout).
        The batch is padded with empty sequences to a power of two, so that packed batches
        with any number of documents share a few graphs (each new one takes 0.1 to 1.5 s)."""
        q, k = tensors["q"], tensors["k"]
        padding = _power_of_two(len(self.runs)) - len(self.runs)
        inputs = {f"seq_{axis}": self._values((axis, q.device), [e - b for b, e in spans] + [0] * padding)
                  for axis, spans in self.spans.items()}
        for name, t in tensors.items():
            axis = _RAGGED_AXIS.get(name)
            if axis is not None:
                step, spans = t.stride(2), self.spans[axis]
                inputs[f"{name}_offsets"] = self._values(
                    (axis, step, t.device), [b * step for b, _ in spans] + [spans[-1][1] * step] * (padding + 1))
        longest_kv = max(e - b for b, e in self.spans["kv"])
        q_rows = _query_rows(q)
        ragged = _Ragged(len(self.runs) + padding, q_rows, _bucket(longest_kv, k.shape[2]), q_rows,
                         _power_of_two(k.shape[2]))
        return ragged, inputs

    def _values(self, key: tuple, values: List[int]) -> Tensor:
        if key not in self._int32s:
            self._int32s[key] = torch.tensor(values, dtype=torch.int32).view(-1, 1, 1, 1).to(key[-1])
        return self._int32s[key]


def _empty_for(calls, rows: Optional[int] = None) -> Callable:
    """How a block's results are allocated: where a ragged batch writes them, with heads
    ``rows`` (else a power of two) rows apart (see ``_padded_empty``)."""
    if any(isinstance(c, _Batch) for c in calls):
        return functools.partial(_padded_empty, rows=rows)
    return torch.empty


def _query_rows(q: Tensor) -> int:
    """The query rows a ragged graph is built for: those of the block ``q``'s rows are cut
    from (its head stride in rows; ``q`` itself if it has none), rounded up to a power of two.
    On an H100 that cost no time against the cut's own rows (``scripts/new_documents_probe.py``),
    and a ring over packed documents that change every call built 22 graphs where it built 54
    (16k tokens), and 38 where it built 112 (64k tokens, 100 calls)."""
    return _power_of_two(max(q.shape[2], q.stride(1) // q.stride(2)))


def _joined(spans: List[Tuple[int, int]]) -> Tuple[Tuple[int, int], ...]:
    """Ascending spans with each run of adjoining ones joined into one."""
    joined = [spans[0]]
    for begin, end in spans[1:]:
        joined[-1:] = [(joined[-1][0], end)] if begin == joined[-1][1] else [joined[-1], (begin, end)]
    return tuple(joined)


_BATCHED_BANDS = (None, (None, 0))  # unmasked and causal: the ragged forms measured (docs/cudnn.md)


def _batchable(run: _Run) -> bool:
    return not run.masked and run.band in _BATCHED_BANDS and _area([run]) > 1


@functools.lru_cache(maxsize=_MAX_PLANS)
def _batched(runs: Tuple[_Run, ...], alone: bool) -> Tuple[object, ...]:
    """The calls for a block's runs: runs with the same native mask (or none) whose rows
    and columns both follow one another become one ``_Batch`` (with ``alone``, a run with no
    such neighbour too); the rest stay single calls. A one-pair run stays single: cuDNN's
    backward rejects it (see ``_backward_call``)."""
    calls, groups = [], {}
    for run in runs:
        if _batchable(run):
            groups.setdefault(run.band, []).append(run)
        else:
            calls.append(run)
    for members in groups.values():
        members.sort(key=lambda r: r.rows)
        apart = all(a.rows[1] <= b.rows[0] and a.cols[1] <= b.cols[0] for a, b in zip(members, members[1:]))
        calls += [_Batch(tuple(members))] if apart and (alone or len(members) > 1) else members
    return tuple(calls)


def _power_of_two(n: int) -> int:
    """The least power of two >= n (n > 0)."""
    return 1 << (n - 1).bit_length()


def _bucket(n: int, rows: int) -> int:
    """The length a ragged graph is built for, for a longest sequence of ``n`` of ``rows`` rows."""
    return min(_power_of_two(rows), max(_TILE, _power_of_two(n)))


def _ragged_applies(q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor] = None, dout: Optional[Tensor] = None) -> bool:
    """Whether a ragged batch computes right over these tensors (the forward's, or with ``out``
    and ``dout`` the backward's): one batch (the runs are per batch), int32 offsets over rows of
    ``head_dim`` elements (``_head_dim_rows``), and in the backward no grouped key/value heads,
    with which cuDNN 9.19 got dK/dV wrong (H100, docs/cudnn.md)."""
    tensors = [t for t in (q, k, v, out, dout) if t is not None]
    if not all(t.shape[0] == 1 and t.shape[2] * t.shape[3] < 2 ** 31 for t in tensors):
        return False
    return out is None or k.shape[1] == q.shape[1]


def _head_dim_rows(t: Tensor) -> Tensor:
    """``t`` with its rows ``head_dim`` elements apart, copied where they are not ([B, S, H, D]
    strides): the only layout ragged batches were measured right in. cuDNN 9.19's backward
    indexes its fp32 dQ accumulator from the query offsets as if query rows were so (dQ was
    wrong otherwise, H100); a copy costs less than a call per document."""
    return t if t.stride(2) == t.shape[3] else _padded_copy(t)


def _recurring(t: Tensor) -> bool:
    """Whether ``t``'s row count is one of a few whatever the documents: a power of two (a
    zigzag chunk, a received block), or all the rows of its memory (its rows span its head or
    batch stride: a whole block in [B, H, S, D] or [B, S, H, D] memory, not rows cut from one)."""
    n = t.shape[2]
    return n == _power_of_two(n) or n * t.stride(2) in (t.stride(0), t.stride(1))


def _padded_empty(shape, dtype: torch.dtype, device, rows: Optional[int] = None) -> Tensor:
    """An empty [B, H, n, ...] tensor whose heads are ``rows`` (>= n; default: n rounded up to
    a power of two) rows apart. A ragged graph bakes in the head stride (``_layout``): tensors
    allocated so serve one graph for any n up to ``rows``."""
    rows = rows or _power_of_two(shape[2])
    return torch.empty((*shape[:2], rows, *shape[3:]), dtype=dtype, device=device)[:, :, :shape[2]]


def _padded_copy(t: Tensor, rows: Optional[int] = None) -> Tensor:
    """``t`` copied into rows of its last dims, heads ``rows`` rows apart (``_padded_empty``)."""
    return _padded_empty(t.shape, t.dtype, t.device, rows).copy_(t)


def _packed_stats(stats: Tensor, rows: int) -> Tensor:
    """The backward's [B, H, n, 1] stats with rows packed and heads ``rows`` rows apart, copied
    where they are not (cuDNN wants them packed; ``_padded_empty`` says why the heads so)."""
    return stats if stats.stride()[1:] == (rows, 1, 1) else _padded_copy(stats, rows)


_BANDS: "OrderedDict[int, tuple]" = OrderedDict()


def _band(mask: ModGraph):
    cached = _BANDS.get(id(mask))
    if cached is None or cached[0] is not mask:
        cached = remember(_BANDS, id(mask), (mask, diagonal_band(mask)), _MAX_PLANS)
    return cached[1]


def _sub(seg: Optional[Segment], r: Tuple[int, int]) -> Optional[Segment]:
    return None if seg is None else seg.slice(*r)


# --------------------------------------------------------------------------- the kernel

class CudnnKernel:
    """HopKernel on cuDNN's fused SDPA (see the module docstring)."""

    name = "cudnn"

    def __init__(self, split_depth: int = SPLIT_DEPTH):
        self.split_depth = split_depth

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # cuDNN writes dk/dv in the input dtype; calls of one hop that share key rows are
        # summed in fp32 and rounded once into it
        return dtype

    def plans_within(self, mask_mod, has_score_mod: bool, q_seg: Segment, kv_seg: Segment,
                     device) -> Optional[Extent]:
        # Native band calls (see ``_runs``) skip the tiles outside the band (a window of 4096
        # over 16k tokens: 80 us per million pairs in the backward, causal 76; H200,
        # scripts/band_probe.py); the exact plan's calls are unmasked or native bands over
        # visible keys only.
        if has_score_mod or mask_mod is None:
            return None
        masked = Mods(None, mask_mod)
        mask = _program(masked, True, device).mask
        band = _band(mask)
        runs = band_runs(band, q_seg, kv_seg) if band is not None else exact_runs(masked, mask, q_seg, kv_seg, device)
        if not runs:
            return None
        return around(r.rows for r in runs), around(r.cols for r in runs)

    def _runs(self, program: _Program, mods: Mods, q: Tensor, k: Tensor, q_seg, kv_seg) -> List[_Run]:
        full = _Run((0, q.shape[2]), (0, k.shape[2]))
        if program.mask is None:
            return [full]
        if q_seg is None or kv_seg is None:
            raise ValueError("a masked block needs its q_seg and kv_seg")
        band = _band(program.mask)
        if band is not None and program.score is None:
            runs = band_runs(band, q_seg, kv_seg)
            if runs is not None:
                return runs
        exact = exact_runs(mods, program.mask, q_seg, kv_seg, q.device)
        if exact is not None and program.score is None:  # unmasked and native-band calls: no per-element mask
            return exact
        split = [_Run(full.rows, full.cols, masked=True)]
        if self.split_depth > 0:
            split = split_runs(mods, program.mask, q.shape[0], q.shape[1], q_seg, kv_seg, self.split_depth, q.device)
        if exact is not None and _area(exact) < _area(split):
            # With a score_mod every call pays per element alike, and cuDNN takes no native
            # mask beside a score_mod: the plan that computes less wins, its bands as selects.
            return [_Run(r.rows, r.cols, masked=r.masked or r.band is not None) for r in exact]
        return split

    def _call(self, backward: bool, run: _Run, program: _Program, tensors: Dict[str, Tensor], scale: float,
              q_seg, kv_seg) -> None:
        mask = program.mask if run.masked else None
        lowering = None
        q_seg, kv_seg = _sub(q_seg, run.rows), _sub(kv_seg, run.cols)
        if program.score is not None or mask is not None:
            if q_seg is None or kv_seg is None:
                raise ValueError("a score_mod needs the block's q_seg and kv_seg")
            lowering = _lowering(program.score, mask, backward)
        strided = {"q_idx": q_seg is not None and q_seg.stride != 1, "kv_idx": kv_seg is not None and kv_seg.stride != 1}
        _graph(backward, tensors, scale, run.band, lowering, strided).execute(tensors, q_seg, kv_seg, lowering)

    def forward(self, q, k, v, q_seg: Optional[Segment], kv_seg: Optional[Segment], mods: Mods, scale: float,
                masked: bool) -> Tuple[Tensor, Tensor]:
        q, k, v = (_inner_contiguous(t) for t in (q, k, v))
        program = _program(mods, masked, q.device)
        calls = self._calls(program, self._runs(program, mods, q, k, q_seg, kv_seg), q, k, v)
        shape, lse_shape = (*q.shape[:3], v.shape[-1]), q.shape[:3]
        if len(calls) == 1 and isinstance(calls[0], _Run) and calls[0].rows == (0, q.shape[2]):
            out, lse = q.new_empty(shape), q.new_empty(lse_shape, dtype=torch.float32)  # one call writes all
            self._forward_call(calls[0], program, q, k, v, out, lse, scale, q_seg, kv_seg)
            return out, lse
        merged = RowMerge(shape, q.dtype, torch.float32, q.device, [span for c in calls for span in c.row_spans],
                          _empty_for(calls, _query_rows(q)))
        for call in calls:
            if isinstance(call, _Batch):
                self._forward_batch(call, q, k, v, merged, scale)
                continue
            # The result's own rows where no call wrote yet; else computed aside, then merged.
            n = call.rows[1] - call.rows[0]
            o, lse = merged.destination(call.rows) or (q.new_empty(*shape[:2], n, shape[3]),
                                                       q.new_empty(*shape[:2], n, dtype=torch.float32))
            self._forward_call(call, program, q, k, v, o, lse, scale, q_seg, kv_seg)
            merged.add(call.rows, o, lse)
        return merged.result()

    @staticmethod
    def _calls(program: _Program, runs: List[_Run], *tensors: Tensor) -> Tuple[object, ...]:
        """The block's runs as cuDNN calls: batched where they can be (see ``_Batch``). The
        exact plan's runs (masks that are no band: packed documents) batch even alone: their
        shapes follow the documents, and a graph of exact shapes would be built for every new
        length (0.1 to 1.5 s each), where ragged graphs are built for a few sizes (``_Ragged``).
        So does a run over the whole block where the block's shape follows the documents (the
        ring cuts a hop to a document that straddles two ranks); where it recurs (``_recurring``)
        the run stays a plain call, which costs less (H100: fwd 0.89 against 0.96 ms, bwd 2.61
        against 2.84 ms, one document over 8192 rows, docs/cudnn.md)."""
        q, k = tensors[:2]
        exact = program.mask is not None and _band(program.mask) is None
        whole = len(runs) == 1 and (runs[0].rows, runs[0].cols) == ((0, q.shape[2]), (0, k.shape[2]))
        if (program.score is not None or (len(runs) < 2 and not exact) or (whole and _recurring(q) and _recurring(k))
                or not _ragged_applies(*tensors)):
            return tuple(runs)
        return _batched(tuple(runs), exact)

    def _forward_batch(self, batch: _Batch, q, k, v, merged: RowMerge, scale: float) -> None:
        """The batch's runs in one call, into the result itself where no call wrote their rows yet."""
        (out, lse), parts = merged.targets(batch.row_spans)
        q, k, v = (_head_dim_rows(t) for t in (q, k, v))
        self._batch_call(False, batch, dict(q=q, k=k, v=v, out=out, lse=lse.unsqueeze(-1)), scale)
        for span, part in zip(batch.row_spans, parts):
            merged.add(span, *part)

    def _batch_call(self, backward: bool, batch: _Batch, tensors: Dict[str, Tensor], scale: float) -> None:
        ragged, inputs = batch.inputs(tensors)
        tensors = {**tensors, **inputs}
        _graph(backward, tensors, scale, batch.band, None, {}, ragged).execute(tensors, None, None, None)

    def _forward_call(self, run: _Run, program: _Program, q, k, v, out, lse, scale, q_seg, kv_seg) -> None:
        tensors = dict(q=rows(q, run.rows), k=rows(k, run.cols), v=rows(v, run.cols), out=out, lse=lse.unsqueeze(-1))
        self._call(False, run, program, tensors, scale, q_seg, kv_seg)

    def backward(self, q, k, v, out, lse, dout, q_seg: Optional[Segment], kv_seg: Optional[Segment], mods: Mods,
                 scale: float, masked: bool, tensors=()) -> Tuple[Tensor, Tensor, Tensor]:
        if tensors:  # ``select_kernel`` takes flex_attention (or the reference kernel) for such calls
            raise ValueError("the cuDNN kernel gives no gradient for the tensors a score_mod reads")
        q, k, v, out, dout = (_inner_contiguous(t) for t in (q, k, v, out, dout))
        program = _program(mods, masked, q.device)
        runs = self._runs(program, mods, q, k, q_seg, kv_seg)
        stats = lse.float()
        if program.score is not None or any(run.masked for run in runs):
            # A row that sees no key anywhere has lse -inf, which cuDNN's backward turns into NaN;
            # +inf makes its probabilities exp(s - inf) = 0. Only a per-element mask or a score_mod
            # can hide every key of a row: each row of an unmasked or native-band call sees a key.
            stats = torch.nan_to_num(stats, nan=math.nan, posinf=math.inf, neginf=math.inf)
        stats = stats.unsqueeze(-1)
        shared = (program, mods, q, k, v, out, lse, stats, dout, scale, q_seg, kv_seg)
        calls = self._calls(program, runs, q, k, v, out, dout)
        whole = (0, q.shape[2]), (0, k.shape[2])
        if len(calls) == 1 and isinstance(calls[0], _Run) and (calls[0].rows, calls[0].cols) == whole:
            grads = [torch.empty_like(t) for t in (q, k, v)]  # one call writes the whole result
            self._backward_call(calls[0], *shared, grads)
            return tuple(grads)
        # Calls write in place where no earlier call wrote those rows; elsewhere they are
        # summed in fp32, and every gradient is rounded once.
        dq_sum = RowSum([q.shape], q.dtype, torch.float32, q.device, [span for c in calls for span in c.row_spans],
                        _empty_for(calls, _query_rows(q)))
        kv_sum = RowSum([k.shape, v.shape], k.dtype, torch.float32, k.device, [span for c in calls for span in c.col_spans],
                        _empty_for(calls))
        for call in calls:
            if isinstance(call, _Batch):
                self._backward_batch(call, q, k, v, out, stats, dout, scale, dq_sum, kv_sum)
                continue
            grads = (dq_sum.destination(call.rows) or [q.new_empty(rows(q, call.rows).shape)]) + (
                kv_sum.destination(call.cols) or [k.new_empty(rows(k, call.cols).shape), v.new_empty(rows(v, call.cols).shape)])
            self._backward_call(call, *shared, grads)
            dq_sum.add(call.rows, grads[0])
            kv_sum.add(call.cols, *grads[1:])
        (dq,), (dk, dv) = dq_sum.result(), kv_sum.result()
        return dq, dk, dv

    def _backward_batch(self, batch: _Batch, q, k, v, out, stats, dout, scale: float, dq_sum: RowSum,
                        kv_sum: RowSum) -> None:
        """The batch's runs in one call, into the sums themselves where no call wrote their rows yet."""
        (dq,), dq_parts = dq_sum.targets(batch.row_spans)
        (dk, dv), kv_parts = kv_sum.targets(batch.col_spans)
        stats = _packed_stats(stats, _query_rows(q))
        q, k, v, out, dout = (_head_dim_rows(t) for t in (q, k, v, out, dout))
        tensors = dict(q=q, k=k, v=v, out=out, dout=dout, lse=stats, dq=dq, dk=dk, dv=dv)
        self._batch_call(True, batch, tensors, scale)
        for span, part in zip(batch.row_spans, dq_parts):
            dq_sum.add(span, *part)
        for span, part in zip(batch.col_spans, kv_parts):
            kv_sum.add(span, *part)

    def _backward_call(self, run: _Run, program: _Program, mods: Mods, q, k, v, out, lse, stats, dout, scale,
                       q_seg, kv_seg, grads: List[Tensor]) -> None:
        """One call's dq, dk, dv into ``grads``."""
        tensors = dict(q=rows(q, run.rows), k=rows(k, run.cols), v=rows(v, run.cols), out=rows(out, run.rows),
                       dout=rows(dout, run.rows), lse=rows(stats, run.rows).contiguous(),  # cuDNN wants it packed
                       dq=grads[0], dk=grads[1], dv=grads[2])
        if run.rows[1] - run.rows[0] == 1 and run.cols[1] - run.cols[0] == 1:
            # cuDNN's backward rejects s_q = s_kv = 1 (a one-token document, say)
            tensors["lse"] = rows(lse, run.rows)
            got = ReferenceKernel().backward(*(tensors[n] for n in ("q", "k", "v", "out", "lse", "dout")),
                                             _sub(q_seg, run.rows), _sub(kv_seg, run.cols), mods, scale,
                                             run.masked or run.band is not None)
            for grad, value in zip(grads, got):
                grad.copy_(value)
        else:
            self._call(True, run, program, tensors, scale, q_seg, kv_seg)


def _lowering(score: Optional[ModGraph], mask: Optional[ModGraph], backward: bool) -> _Lowering:
    key = (id(score), id(mask), backward)
    cached = _LOWERINGS.get(key)
    if cached is None or cached.score is not score or cached.mask is not mask:
        cached = remember(_LOWERINGS, key, _Lowering(score, mask, backward), _MAX_PLANS)
    return cached


def _inner_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def cudnn_unavailable_reason(q: Tensor, k: Tensor, v: Tensor, mods: Mods) -> Optional[str]:
    """Why ``CudnnKernel`` cannot run this call, or None if it can."""
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the cuDNN kernel needs float16 or bfloat16 inputs, got {q.dtype}"
    try:
        cudnn = _cudnn()
    except ImportError as e:
        return f"nvidia-cudnn-frontend is not installed ({e}); pip install 'ringflex[cudnn]'"
    if cudnn.backend_version() < _MIN_CUDNN:
        return f"cuDNN {cudnn.backend_version_string()} is too old: score_mod needs cuDNN 9.6 or newer"
    if torch.cuda.get_device_capability(q.device) < (9, 0):
        return "the cuDNN kernel needs a Hopper (sm_90) or newer GPU"
    for name, dim in (("q/k", q.shape[-1]), ("v", v.shape[-1])):
        if dim % 8 or dim > 128:
            return f"the {name} head dim must be a multiple of 8 and at most 128 for cuDNN, got {dim}"
    if q.shape[1] % k.shape[1]:
        return f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
    return lowering_error(mods, q.device)
