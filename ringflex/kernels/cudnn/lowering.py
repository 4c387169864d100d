"""The user's mods as cuDNN's per-element score_mod graph: what runs inside the fused kernel
(``Emitter``), and what enters it as inputs (``Inputs``: constants, the hop's offsets, and
sub-expressions computed in torch, ``Lowering.hoisted``)."""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...cache import ByObjects, remember, tensor_versions
from ...mod.grad import score_grad
from ...mod.graph import ModGraph, Node, UnsupportedModError, evaluate
from ...mod.ranges import Range, node_ranges
from ...mod.trace import trace_mask_mod, trace_score_mod
from ...plan.layout import Segment
from ..base import Mods
from . import frontend
from .frontend import MAX_PLANS

_LOWERINGS: "OrderedDict[tuple, Lowering]" = OrderedDict()


@dataclass(frozen=True)
class Program:
    """The traced mods of a call; ``mask`` is None when the block needs no mask."""

    score: Optional[ModGraph]
    mask: Optional[ModGraph]


def traced(mods: Mods, masked: bool, device) -> Program:
    """The call's mods traced (``ringflex.mod.trace``), the mask only where the block needs one."""
    score = trace_score_mod(mods.score_mod, device) if mods.score_mod is not None else None
    mask = trace_mask_mod(mods.mask_mod, device) if masked and mods.mask_mod is not None else None
    return Program(score, mask)


def _in_graph(n: Node) -> bool:
    """Whether ``n`` needs per-element work: it reads the score (or its gradient) or both indices."""
    return bool(n.deps & {"score", "grad"}) or {"q_idx", "kv_idx"} <= n.deps


def _needs_torch(n: Node, memo: Dict[int, bool]) -> bool:
    """Whether ``n`` reads a captured tensor or b / h: cuDNN cannot gather, and per-batch or
    per-head values are cheapest as a small input."""
    if id(n) not in memo:
        memo[id(n)] = n.op in ("index", "tensor") or bool(n.deps & {"b", "h"}) or any(_needs_torch(a, memo) for a in n.args)
    return memo[id(n)]


_NARROW_INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32)


class Lowering:
    """Splits the mods into cuDNN's per-element graph and its inputs: constants, the hop's
    offsets for the generated indices, and sub-expressions computed in torch (``hoisted``).
    Arithmetic on one index (``q_idx // width``) stays in the graph: cheaper than a load."""

    def __init__(self, score: Optional[ModGraph], mask: Optional[ModGraph], backward: bool):
        self.score, self.mask = score, mask
        self.grad = score_grad(score) if backward and score is not None else None
        self.consts = {0.0, 1.0, -math.inf}
        self.indices = set()
        self.hoisted: List[Node] = []
        self.integers: List[Node] = []  # integer values the kernel holds in float32: computed or hoisted
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
        if not n.dtype.is_floating_point and n.dtype != torch.bool:
            self.integers.append(n)
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
        if n.op == "cast" and n.dtype in _NARROW_INTEGERS:
            raise UnsupportedModError(f"casting to {n.dtype} inside the mod (which wraps values it cannot hold) is not "
                                      "supported by the cuDNN kernel, which computes in float32")
        for a in n.args:
            self._visit(a, seen, memo)


def lowering_error(mods: Mods, device=None, lengths: Optional[Tuple[int, int]] = None, batch: int = 1,
                   heads: int = 1) -> Optional[str]:
    """Why the cuDNN kernel cannot compile these mods, or None; with ``lengths`` (the global
    query and key lengths) and the call's ``batch`` and ``heads``, also why it cannot hold
    their integers exactly (``_inexact_integers``)."""
    try:
        program = traced(mods, True, device)
        lowering = lowered(program.score, program.mask, backward=True)
    except UnsupportedModError as e:
        return str(e)
    return None if lengths is None else _inexact_integers(program, lowering, lengths, batch, heads)


_FLOAT32_INTEGERS = 2 ** 24  # every integer up to this is exact in float32
_INEXACT = ByObjects(64)  # by mods, their tensors' versions and the call's sizes: ``_inexact_integers``


def _inexact_integers(program: Program, lowering: "Lowering", lengths: Tuple[int, int], batch: int,
                      heads: int) -> Optional[str]:
    """Why the kernel cannot hold the mods' integers exactly, or None. It computes in float32
    (and takes what torch computes for it as float32 inputs), where integers past 2**24 round
    and compare equal, as torch's int32 and int64 do not: dataset-wide document ids merge, a
    hashed block pattern turns dense, positions past 16.7M tokens tie. Each integer is ranged
    from the mods' formulas over every position, batch and head (``bounds.node_ranges``): once
    per mods, versions of their tensors and sizes (lookups read a host copy of the tensors),
    never inside a CUDA-graph capture (a call that meets new mods there is refused as not
    planned before)."""
    tensors = [t for graph in (program.score, program.mask) if graph is not None for t in graph.tensors()]
    key = (lowering.key, tensor_versions(tensors), lengths, batch, heads)
    capturing = any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()
    try:
        return _INEXACT.get(key, tensors, None if capturing else lambda: _integer_error(lowering, lengths, batch, heads))
    except LookupError:
        return None


def _integer_error(lowering: "Lowering", lengths: Tuple[int, int], batch: int, heads: int) -> Optional[str]:
    env = {"b": Range(0, batch - 1), "h": Range(0, heads - 1), "q_idx": Range(0, lengths[0] - 1),
           "kv_idx": Range(0, lengths[1] - 1)}
    ranges = {}
    for graph in (lowering.score, lowering.mask, lowering.grad):
        if graph is not None:
            ranges.update(node_ranges(graph, env))
    for n in lowering.integers:
        r = ranges.get(id(n))
        largest = None if r is None else max(abs(r.lo), abs(r.hi))
        if largest is None or largest > _FLOAT32_INTEGERS:
            what = "cannot be bounded" if r is None else f"reaches {largest}"
            return (f"the cuDNN kernel computes the mods in float32, where integers past 2**24 round, and an integer "
                    f"{n.op} in them {what} over {lengths[0]} query and {lengths[1]} key positions: keep integers "
                    "within 2**24 (ids numbered from 0, small multipliers), or pass backend='flex'")
    return None


class Emitter:
    """Emits the lowered mods into a cuDNN graph inside its score_mod callbacks.

    Two limits of cuDNN's fused kernel shape this. Its logical operations do not compile,
    so conditions are never combined into booleans: ``a & b ? t : f`` becomes
    ``a ? (b ? t : f) : f`` and so on, one select per comparison. And it rejects a graph
    input (constant, offset, hoisted tensor) in the first port of comparisons and selects,
    so operands are swapped or the comparison negated where that helps, and otherwise the
    input is first added to a computed zero.
    """

    def __init__(self, lowering: Lowering, inputs: "Inputs"):
        self.lowering, self.inputs = lowering, inputs
        self.memo: Dict[object, object] = {}
        self.g = self.base = self.zero = None

    def forward(self, g, score):
        self.g, self.base, self.zero, self.memo = g, score, None, {}
        out = score
        if self.lowering.score is not None:
            self.memo[id(self._leaf(self.lowering.score, "score"))] = score
            # A score_mod that ignores the score may give a graph input (a constant, a hoisted
            # bias): the modified score must be computed from the score's, as cuDNN fuses it.
            out = self._computed(self._number(self.lowering.score.output))
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
        t.set_data_type(getattr(frontend.cudnn().data_type, dtype))
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
        t = getattr(self.g, name)(**args, compute_data_type=frontend.cudnn().data_type.FLOAT)
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
        op = _LOGICAL.get(n.op, n.op) if n.dtype == torch.bool else n.op
        if computed and op == "and":
            return self._choose(n.args[0], self._choose(n.args[1], t, f), f)
        if computed and op == "or":
            return self._choose(n.args[0], t, self._choose(n.args[1], t, f))
        if computed and n.op == "not":
            return self._choose(n.args[0], f, t)
        negate = self.inputs.is_input(t) and not self.inputs.is_input(f)
        if negate:
            t, f = f, t
        return self._select(self._condition(n, negate), t, f)

    def _select(self, mask, t, f):
        """``mask ? t : f`` for a BOOLEAN tensor ``mask`` (``t`` computed in the graph first)."""
        return self._typed(self.g.binary_select(input0=self._computed(t), input1=f, mask=mask), "FLOAT")

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
            elif n.op == "cast":  # to bool: whether its operand is nonzero
                value = self._number(n.args[0])
            else:  # a number as a condition (a mask of ints): whether it is nonzero
                value = self._number(n)
            t = self._op("cmp_eq" if negate else "cmp_neq", value, self._const(0.0))
        self.memo[key] = t
        return t

    def _integer_floor(self, x, y, divisor: Node):
        """floor(x / y) of integers, exact. cuDNN divides by multiplying with a rounded reciprocal,
        one too low at some exact multiples ((q - kv) % 41 == 0 missed every 41st key);
        the remainder says which way the quotient is off (|x| and |y| within 2**24, where float32
        holds every integer: ``_inexact_integers``)."""
        zero, one = self._const(0.0), self._computed(self._const(1.0))
        quotient = self._op("floor", self._op("div", x, y))
        rest = self._op("sub", x, self._op("mul", y, quotient))  # in [0, y) for y > 0, (y, 0] for y < 0

        def bit(comparison, u, v):
            return self._select(self._op(comparison, u, v), one, zero)

        def correction(positive: bool):  # +1 where the rest reached y, -1 where it has the wrong sign
            up, down = (bit("cmp_ge", rest, y), bit("cmp_lt", rest, zero)) if positive else \
                (bit("cmp_le", rest, y), bit("cmp_gt", rest, zero))
            return self._op("sub", up, down)

        if divisor.op == "const":
            fix = correction(divisor.value > 0)
        else:
            fix = self._select(self._op("cmp_gt", y, zero), correction(True), correction(False))
        return self._op("add", quotient, fix)

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
            I = frontend.cudnn().data_type.INT32
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
            integers = not any(v.dtype.is_floating_point for v in a)
            floor = self._integer_floor(x, y, a[1]) if integers else self._op("floor", self._op("div", x, y))
            return floor if op == "floordiv" else self._op("sub", x, self._op("mul", y, floor))  # Python's sign
        if op == "where":
            return self._choose(a[0], self._number(a[1]), self._number(a[2]))
        if op == "cast":
            return self._number(a[0])  # numbers are fp32 inside the graph
        raise UnsupportedModError(f"operation {op} cannot be lowered to cuDNN")


# booleans multiply as and, add as or (torch keeps them booleans), and so do their min and max
_LOGICAL = {"mul": "and", "minimum": "and", "add": "or", "maximum": "or"}
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


class Inputs:
    """The graph inputs a lowering may need, created before the graph is frozen. The
    callbacks record which they ``use``; ``order`` lists those once the graph is built."""

    def __init__(self, g, lowering: Lowering, shapes: Dict[str, int], strided: Dict[str, bool], backward: bool):
        cudnn = frontend.cudnn()
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

    def buffers(self, q: Tensor, q_seg: Segment, kv_seg: Segment, lowering: Lowering) -> List:
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
    values wrong, and both directions read per-batch values ([B, 1, 1, 1]) wrong where they
    are added or selected on (a mask ``(b == 0) | causal``, a score ``s + b``), so these get
    the score's full shape with stride 0 along the broadcast axes; the forward reads
    per-token values right, and the compact form faster (measured: docs/cudnn.md).
    """
    compact = packed_strides(dims)
    if dims[0] > 1 or (backward and (dims[2] > 1 or dims[3] > 1)):
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


def packed_strides(dims) -> List[int]:
    """The strides of a packed tensor of shape ``dims``, size-1 dims included."""
    strides, acc = [], 1
    for d in reversed(dims):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def _index_env(batch: int, heads: int, q_seg: Segment, kv_seg: Segment, device) -> Dict[str, Tensor]:
    """(b, h, q_idx, kv_idx) of a hop as broadcastable int32 tensors, as flex_attention passes them."""
    return {
        "b": torch.arange(batch, device=device, dtype=torch.int32).view(-1, 1, 1, 1),
        "h": torch.arange(heads, device=device, dtype=torch.int32).view(1, -1, 1, 1),
        "q_idx": q_seg.positions(device).view(1, 1, -1, 1),
        "kv_idx": kv_seg.positions(device).view(1, 1, 1, -1),
    }


def lowered(score: Optional[ModGraph], mask: Optional[ModGraph], backward: bool) -> Lowering:
    """The ``Lowering`` of these traced mods, made once."""
    key = (id(score), id(mask), backward)
    cached = _LOWERINGS.get(key)
    if cached is None or cached.score is not score or cached.mask is not mask:
        cached = remember(_LOWERINGS, key, Lowering(score, mask, backward), MAX_PLANS)
    return cached
