"""Turns a ``score_mod`` / ``mask_mod`` into a small expression graph that kernels can lower.

A mod is traced with ``make_fx`` on one-element tensors (score float32, indices int32, as
flex_attention passes them) into ATen ops, which are mapped onto the few operations a fused
attention kernel can evaluate per score element (arithmetic, comparisons, logic, where, a
handful of unary functions and lookups of captured tensors). Anything else raises
``UnsupportedModError`` naming the op. The graph can be evaluated in torch (to check the
tracer against the mod itself), differentiated w.r.t. the score (a kernel's backward needs
the score_mod's derivative) and fingerprinted (kernels cache compiled graphs by it). A new
closure of a mod traced before (same code, captured values and tensor shapes) takes that
graph with its own tensors instead of a new trace (``_traced``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction
from types import CodeType
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import captured, config
from .cache import remember

aten = torch.ops.aten

SCORE_INPUTS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_INPUTS = ("b", "h", "q_idx", "kv_idx")


class UnsupportedModError(ValueError):
    """A score_mod / mask_mod uses an operation that ringflex cannot trace or lower."""


@dataclass(eq=False)
class Node:
    """One operation. ``op`` is an input name (``score``, ``b``, ``h``, ``q_idx``, ``kv_idx``,
    ``grad``), ``const``, ``tensor`` (a captured tensor) or an operation from ``OPS``
    (``index`` is a lookup into a captured tensor)."""

    op: str
    args: Tuple["Node", ...] = ()
    value: object = None  # const: the Python number; tensor: the Tensor; cast: the dtype
    dtype: torch.dtype = torch.float32
    deps: FrozenSet[str] = field(default=frozenset())

    def __repr__(self) -> str:
        return f"Node({self.op}, {self.dtype})"


# Element-wise operations of the graph, with their torch evaluation.
_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "floor": torch.floor, "not": torch.logical_not,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"), "mod": torch.remainder,
    "minimum": torch.minimum, "maximum": torch.maximum, "pow": torch.pow,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "and": torch.logical_and, "or": torch.logical_or,
    # Derivatives, written the way cuDNN names them: (upstream gradient, forward input).
    "tanh_backward": lambda g, x: g * (1 - torch.tanh(x) ** 2),
    "sigmoid_backward": lambda g, x: g * torch.sigmoid(x) * (1 - torch.sigmoid(x)),
}
OPS = frozenset(_UNARY) | frozenset(_BINARY) | {"where", "cast", "index"}
COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})


@dataclass(eq=False)
class ModGraph:
    """The traced expression of one mod: ``nodes`` in topological order, ``output`` last."""

    kind: str  # "score_mod", "mask_mod" or "score_grad"
    inputs: Tuple[str, ...]
    nodes: List[Node]

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    @property
    def deps(self) -> FrozenSet[str]:
        """Which of the inputs (``score``, ``b``, ``h``, ``q_idx``, ``kv_idx``) the result depends on."""
        return self.output.deps

    def evaluate(self, *args: Tensor) -> Tensor:
        """The graph evaluated with torch on (broadcastable) tensors, in the mod's argument order."""
        if len(args) != len(self.inputs):
            raise TypeError(f"{self.kind} graph takes {len(self.inputs)} arguments {self.inputs}, got {len(args)}")
        return evaluate(self.output, dict(zip(self.inputs, args)))

    __call__ = evaluate

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of what the graph computes, captured tensors by identity, shape and dtype."""
        return _digest(self.nodes, identity=True)

    @functools.cached_property
    def structure(self) -> str:
        """Like ``fingerprint`` but captured tensors by shape and dtype only: two mods with the
        same structure lower to the same kernel graph, whatever their tensors hold."""
        return _digest(self.nodes, identity=False)

    def tensors(self) -> List[Tensor]:
        """The captured tensors the graph reads, each once."""
        seen = {}
        for n in self.nodes:
            if n.op == "tensor":
                seen.setdefault(id(n.value), n.value)
        return list(seen.values())


# --------------------------------------------------------------------------- building nodes

def _dtype_of(value) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.float32


def const(value, dtype: Optional[torch.dtype] = None) -> Node:
    if not isinstance(value, (bool, int, float)):
        raise UnsupportedModError(f"unsupported constant {value!r} of type {type(value).__name__}")
    return Node("const", value=value, dtype=dtype or _dtype_of(value))


def _promote(name: str, args: Sequence[Node]) -> torch.dtype:
    """The result dtype of an operation built here (traced operations take the traced dtype)."""
    if name in COMPARISONS or name in ("and", "or", "not"):
        return torch.bool
    values = args[1:] if name == "where" else args
    floats = [a.dtype for a in values if a.dtype.is_floating_point]
    if floats:
        return floats[0]
    ints = [a.dtype for a in values if a.op != "const" and a.dtype != torch.bool]
    return ints[0] if ints else values[0].dtype


def op(name: str, *args: Node, dtype: Optional[torch.dtype] = None) -> Node:
    """A new operation node on ``args``."""
    if name not in OPS:
        raise ValueError(f"unknown operation {name!r}")
    deps = frozenset().union(*(a.deps for a in args))
    return Node(name, tuple(args), dtype=dtype or _promote(name, args), deps=deps)


def leaf(name: str, dtype: torch.dtype) -> Node:
    return Node(name, dtype=dtype, deps=frozenset({name}))


# --------------------------------------------------------------------------- tracing

def _as_node(x, env: Dict[object, Node]) -> Node:
    if isinstance(x, torch.fx.Node):
        return env[x]
    return const(x)


def _cast(x: Node, dtype: torch.dtype) -> Node:
    return x if x.dtype == dtype else Node("cast", (x,), value=dtype, dtype=dtype, deps=x.deps)


def _lookup(table: Node, indices: Sequence, dtype) -> Node:
    if table.op != "tensor":
        raise UnsupportedModError(
            "only captured tensors can be indexed, with one subscript per dimension (t[i, j], not t[i][j])")
    if len(indices) != table.value.dim() or any(i is None for i in indices):
        raise UnsupportedModError(
            f"a captured tensor of shape {tuple(table.value.shape)} must be indexed with one subscript per "
            f"dimension (t[i, j], not t[i][j]), got {len(indices)}")
    return op("index", table, *indices, dtype=dtype)


_BINARY_ATEN = {
    aten.add: "add", aten.sub: "sub", aten.mul: "mul", aten.floor_divide: "floordiv",
    aten.remainder: "mod", aten.minimum: "minimum", aten.maximum: "maximum", aten.pow: "pow",
    aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le", aten.gt: "gt", aten.ge: "ge",
    aten.logical_and: "and", aten.logical_or: "or", aten.bitwise_and: "and", aten.bitwise_or: "or",
    aten.logical_xor: "ne", aten.bitwise_xor: "ne",
}
_LOGICAL = {aten.logical_and, aten.logical_or, aten.bitwise_and, aten.bitwise_or, aten.logical_xor,
            aten.bitwise_xor, aten.logical_not, aten.bitwise_not}
_UNARY_ATEN = {
    aten.neg: "neg", aten.abs: "abs", aten.exp: "exp", aten.log: "log", aten.sqrt: "sqrt",
    aten.tanh: "tanh", aten.sigmoid: "sigmoid", aten.floor: "floor",
    aten.logical_not: "not", aten.bitwise_not: "not",
}
_IDENTITY_ATEN = {aten.clone, aten.alias, aten.lift_fresh_copy, aten.expand, aten.contiguous}
_CAST_ATEN = {aten._to_copy, aten.to}
_FILL_ATEN = {aten.full_like: None, aten.full: None, aten.zeros_like: 0, aten.ones_like: 1, aten.scalar_tensor: None,
              aten.new_zeros: 0, aten.new_ones: 1, aten.zeros: 0, aten.ones: 1}  # and_masks starts from new_ones


def _convert(gm: torch.fx.GraphModule, inputs: Sequence[str], kind: str) -> ModGraph:
    env: Dict[torch.fx.Node, Node] = {}
    placeholders = iter(inputs)
    result = val = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            name = next(placeholders)
            env[n] = leaf(name, torch.float32 if name == "score" else torch.int32)
        elif n.op == "get_attr":
            t = getattr(gm, n.target)
            env[n] = Node("tensor", value=t, dtype=t.dtype)
        elif n.op == "call_function":
            env[n] = _convert_call(n, env)
        elif n.op == "output":
            out = n.args[0]
            out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
            result = _as_node(out, env) if isinstance(out, (torch.fx.Node, bool, int, float)) else None
            # the traced shape: a constant result (``torch.ones(5)``) is one number once converted
            val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
    if result is None or (result.op == "tensor" and result.value.numel() != 1):
        raise UnsupportedModError(f"{kind} must return one value per score element, computed from its arguments")
    nodes = _topological(result)
    for n in nodes:
        for i, a in enumerate(n.args):
            if a.op == "tensor" and a.value.numel() != 1 and not (n.op == "index" and i == 0):
                raise UnsupportedModError(
                    f"a captured tensor of shape {tuple(a.value.shape)} is used without indexing it by "
                    "b, h, q_idx or kv_idx")
    error = isinstance(val, Tensor) and result_shape_error(kind, val.shape, (1,))
    if error:
        raise ValueError(error)
    return ModGraph(kind, tuple(inputs), nodes)


def result_shape_error(kind: str, shape: Sequence[int], grid: Sequence[int]) -> Optional[str]:
    """Why a mod's result of ``shape`` is not one value per score element, for arguments that
    broadcast to ``grid``, or None. flex_attention refuses such a result: the trace would fold
    a constant one into a single number, and the kernels would broadcast others over the keys."""
    if len(shape) <= len(grid) and all(n in (1, g) for n, g in zip(reversed(shape), reversed(grid))):
        return None
    return (f"{kind} returned a tensor of shape {tuple(shape)} for arguments of shape {tuple(grid)}: it must return "
            "one value per score element (a scalar, or a tensor of its arguments' broadcast shape)")


def _convert_call(n: torch.fx.Node, env) -> Node:
    packet = getattr(n.target, "overloadpacket", None)
    a, kw = n.args, n.kwargs
    val = n.meta.get("val")
    dtype = val.dtype if isinstance(val, Tensor) else None

    def arg(i):
        return _as_node(a[i], env)

    if packet in _LOGICAL:
        operands = [arg(i) for i in range(len(a))]
        if any(x.dtype != torch.bool for x in operands):
            raise UnsupportedModError(f"{packet.__name__} is supported on booleans only, got "
                                      f"{', '.join(str(x.dtype) for x in operands)}")
    if packet in _IDENTITY_ATEN:
        return arg(0)
    if packet is aten.detach:  # the same values; a captured tensor read so takes no gradient
        x = arg(0)
        return Node("tensor", value=x.value.detach(), dtype=x.dtype) if x.op == "tensor" else x
    if packet in _BINARY_ATEN:
        y = arg(1) if kw.get("alpha", 1) == 1 else op("mul", arg(1), const(kw["alpha"]))
        return op(_BINARY_ATEN[packet], arg(0), y, dtype=dtype)
    if packet is aten.rsub:
        y = arg(0) if kw.get("alpha", 1) == 1 else op("mul", arg(0), const(kw["alpha"]))
        return op("sub", arg(1), y, dtype=dtype)
    if packet is aten.div:
        mode = kw.get("rounding_mode")
        if mode == "trunc":
            raise UnsupportedModError("torch.div(..., rounding_mode='trunc') is not supported; use // (floor)")
        return op("floordiv" if mode == "floor" else "div", arg(0), arg(1), dtype=dtype)
    if packet in _UNARY_ATEN:
        return op(_UNARY_ATEN[packet], arg(0), dtype=dtype)
    if packet is aten.reciprocal:
        return op("div", const(1.0), arg(0), dtype=dtype)
    if packet is aten.rsqrt:
        return op("div", const(1.0), op("sqrt", arg(0), dtype=dtype), dtype=dtype)
    if packet is aten.where:
        return op("where", arg(0), arg(1), arg(2), dtype=dtype)
    if packet is aten.masked_fill:
        return op("where", arg(1), arg(2), arg(0), dtype=dtype)
    if packet in (aten.clamp, aten.clamp_min, aten.clamp_max):
        lo = a[1] if len(a) > 1 else kw.get("min")
        hi = a[2] if len(a) > 2 else kw.get("max")
        if packet is aten.clamp_max:
            lo, hi = None, lo
        x = arg(0)
        for name, bound in (("maximum", lo), ("minimum", hi)):
            if bound is not None:  # marked: at the bound itself clamp passes x its whole gradient
                x = dataclasses.replace(op(name, x, _as_node(bound, env), dtype=dtype), value="clamp")
        return x
    if packet in _CAST_ATEN:
        return _cast(arg(0), dtype) if dtype is not None else arg(0)
    if packet in _FILL_ATEN:
        fill = _FILL_ATEN[packet]
        fill = a[0] if packet is aten.scalar_tensor else a[1] if fill is None else fill
        return const(_number(fill, dtype), dtype)
    if packet is aten.index:
        return _lookup(arg(0), [None if i is None else _as_node(i, env) for i in a[1]], dtype)
    if packet is aten.select and a[1] == 0 and arg(0).op == "tensor" and arg(0).value.dim() == 1:
        return _lookup(arg(0), [const(int(a[2]))], dtype)
    return _unsupported(n)


def _number(x, dtype):
    if dtype is torch.bool:
        return bool(x)
    return float(x) if dtype is not None and dtype.is_floating_point else int(x)


def _unsupported(n: torch.fx.Node):
    name = getattr(n.target, "__name__", str(n.target))
    raise UnsupportedModError(
        f"operation {name} is not supported in score_mod / mask_mod (supported: + - * / // % **, "
        "comparisons, & | ~, torch.where, tanh, sigmoid, exp, log, abs, sqrt, min/max/clamp, casts, "
        "constants and captured tensors indexed by b, h, q_idx, kv_idx)")


def _topological(out: Node) -> List[Node]:
    order, seen = [], set()
    stack = [(out, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return order


class _HostReads(TorchFunctionMode):
    """Notes whether a mod being traced reads tensor values on the host (``tolist``, ``numpy``,
    ...): what it computes from them is baked into the trace, which then holds for those
    values only. (``make_fx`` itself refuses ``item()`` and ``bool()`` of traced values.)"""

    NAMES = frozenset({"tolist", "numpy", "__array__", "item", "__int__", "__float__", "__complex__", "__bool__",
                       "__index__", "__repr__", "__str__", "__format__", "data_ptr", "storage", "untyped_storage"})

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen = self.seen or getattr(func, "__name__", None) in self.NAMES
        return func(*args, **(kwargs or {}))


def _trace(fn: Callable, inputs: Sequence[str], kind: str, device) -> Tuple[ModGraph, bool]:
    """The graph of ``fn``, and whether tracing read captured values on the host."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if not callable(fn):
        raise TypeError(f"{kind} must be callable, got {type(fn).__name__}")
    example = [torch.zeros(1, device=device, dtype=torch.float32 if name == "score" else torch.int32)
               for name in inputs]
    reads = _HostReads()

    def watched(*args):
        with reads:
            return fn(*args)

    try:
        gm = make_fx(watched, tracing_mode="real")(*example)
    except UnsupportedModError:
        raise
    except Exception as e:  # data-dependent Python control flow, wrong arity, ...
        raise UnsupportedModError(f"{kind} could not be traced: {type(e).__name__}: {e}") from e
    return _convert(gm, inputs, kind), reads.seen


# A mod made anew with new tensors (``mods.document(ids)`` at every training step) is traced
# once per signature: later ones take that graph with their own tensors (``_rebound``).
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # mod -> {state: graph}
_TEMPLATES: "OrderedDict[tuple, Tuple[ModGraph, Dict[int, int]]]" = OrderedDict()  # signature -> graph, slots
_MAX_TEMPLATES = 32


def _signature(parts) -> Optional[tuple]:
    """What a trace of a mod depends on: its code, its captured values, and its tensors by
    shape, dtype, device and which of them are one object. None where it captured an object
    of another kind, which could hold anything."""
    first: Dict[int, int] = {}
    signature = []
    for p in parts:
        if isinstance(p, Tensor):
            signature.append(("tensor", tuple(p.shape), p.dtype, p.device, first.setdefault(id(p), len(first))))
        elif isinstance(p, captured.PLAIN):
            signature.append((type(p), p))  # 1, 1.0 and True trace apart
        elif isinstance(p, (tuple, CodeType)):
            signature.append(p)
        else:
            return None
    return tuple(signature)


def _slots(graph: ModGraph, tensors: List[Tensor]) -> Optional[Dict[int, int]]:
    """For each captured-tensor node of ``graph``, the index of its tensor among the mod's
    ``tensors``; None if a node holds another tensor (one computed while tracing)."""
    index: Dict[int, int] = {}
    for i, t in enumerate(tensors):
        index.setdefault(id(t), i)
    slots = {id(n): index.get(id(n.value)) for n in graph.nodes if n.op == "tensor"}
    return None if None in slots.values() else slots


def _rebound(graph: ModGraph, slots: Dict[int, int], tensors: List[Tensor]) -> ModGraph:
    """``graph`` with its captured-tensor nodes reading ``tensors`` (by ``slots``)."""
    new: Dict[int, Node] = {}
    for n in graph.nodes:
        if n.op == "tensor":
            new[id(n)] = Node("tensor", value=tensors[slots[id(n)]], dtype=n.dtype)
        else:
            new[id(n)] = dataclasses.replace(n, args=tuple(new[id(a)] for a in n.args))
    return ModGraph(graph.kind, graph.inputs, [new[id(n)] for n in graph.nodes])


def _traced(fn, parts, inputs, kind, device, where: str) -> ModGraph:
    """The graph of ``fn``: an earlier mod's of the same signature, with this one's tensors,
    or a fresh trace, kept to serve later mods where it can (``_slots``)."""
    signature = _signature(parts)
    key = None if signature is None else (kind, where, signature)
    tensors = [p for p in parts if isinstance(p, Tensor)]
    if key in _TEMPLATES:
        _TEMPLATES.move_to_end(key)
        graph = _rebound(*_TEMPLATES[key], tensors)
        if config.debugging():  # the shortcut checked against a trace of this very mod
            fresh, _ = _trace(fn, inputs, kind, device)
            if fresh.fingerprint != graph.fingerprint:
                raise RuntimeError(f"ringflex: a {kind} reused the trace of an earlier one of the same code and "
                                   "captured values, but its own trace differs; please report this")
        return graph
    graph, host_reads = _trace(fn, inputs, kind, device)
    slots = None if key is None or host_reads else _slots(graph, tensors)
    if slots is not None:
        remember(_TEMPLATES, key, (graph, slots), _MAX_TEMPLATES)
    return graph


def _cached(fn, inputs, kind, device) -> ModGraph:
    parts = captured.parts(fn)
    where = str(torch.device(device)) if device is not None else "cpu"
    # a write into a captured tensor is a new key: a trace may have read its values on the host
    # (``int(window)``); where it read none, the mod takes its template again (``_traced``)
    key = (kind, where, captured.state(parts))
    try:
        per_fn = _CACHE.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: trace every time
        return _traced(fn, parts, inputs, kind, device, where)
    if key not in per_fn:
        per_fn.clear()
        per_fn[key] = _traced(fn, parts, inputs, kind, device, where)
    return per_fn[key]


def trace_score_mod(score_mod: Callable, device=None) -> ModGraph:
    """The graph of ``score_mod(score, b, h, q_idx, kv_idx)``; captured tensors must be on ``device``."""
    graph = _cached(score_mod, SCORE_INPUTS, "score_mod", device)
    if not graph.output.dtype.is_floating_point:
        raise UnsupportedModError(f"score_mod must return a floating-point score, got {graph.output.dtype}")
    return graph


def tensors_requiring_grad(score_mod: Optional[Callable], device=None) -> Tuple[Tensor, ...]:
    """The captured tensors ``score_mod`` reads that require grad (a learnable bias table or
    slopes), where grad mode is on: their gradients flow as flex_attention's do. Found in its
    graph; a mod that cannot be traced is evaluated at one point, and raises if it reads one."""
    if score_mod is None or not torch.is_grad_enabled():
        return ()
    try:
        graph = trace_score_mod(score_mod, device)
    except UnsupportedModError as e:
        zero = torch.zeros((), dtype=torch.int32, device=device)
        if torch.as_tensor(score_mod(torch.zeros((), device=device), zero, zero, zero, zero)).requires_grad:
            raise UnsupportedModError(f"score_mod reads a tensor that requires grad, and ringflex finds such "
                                      f"tensors only in mods it can trace: {e}") from e
        return ()
    return tuple(t for t in graph.tensors() if t.requires_grad)


def trace_mask_mod(mask_mod: Callable, device=None) -> ModGraph:
    """The graph of ``mask_mod(b, h, q_idx, kv_idx)``; captured tensors must be on ``device``."""
    return _cached(mask_mod, MASK_INPUTS, "mask_mod", device)


# --------------------------------------------------------------------------- evaluation

def evaluate(out: Node, env: Dict[str, Tensor]) -> Tensor:
    """``out`` evaluated with torch; ``env`` maps input names to (broadcastable) tensors."""
    memo: Dict[int, Tensor] = {}
    for n in _topological(out):
        args = [memo[id(a)] for a in n.args]
        if n.op in env:
            v = torch.as_tensor(env[n.op])
        elif n.op == "const":
            # A 0-dim CPU tensor promotes like a Python number, and mixes with tensors on any
            # device without a host-device copy (which would wait for the device).
            v = torch.tensor(n.value, dtype=n.dtype)
        elif n.op == "tensor":
            v = n.value
        elif n.op == "index":
            idx = tuple(torch.broadcast_tensors(*(i.long() for i in args[1:])))
            v = args[0][idx]
        elif n.op == "cast":
            v = args[0].to(n.value)
        elif n.op == "where":
            v = torch.where(*args)
        elif n.op in _UNARY:
            v = _UNARY[n.op](args[0])
        elif n.op in _BINARY:
            v = _BINARY[n.op](*args)
        else:
            raise KeyError(f"input {n.op!r} was not given")
        memo[id(n)] = v
    return memo[id(out)]


def subscripts(graph: ModGraph) -> Iterator[Tuple[Tuple[int, ...], int, ModGraph]]:
    """Every subscript of a lookup into a captured tensor: (the tensor's shape, the size of the
    dimension it indexes, the subscript's graph)."""
    for n in graph.nodes:
        if n.op == "index":
            shape = tuple(n.args[0].value.shape)
            for size, subscript in zip(shape, n.args[1:]):
                yield shape, size, ModGraph(graph.kind, graph.inputs, _topological(subscript))


def subscripts_read_tensors(graph: ModGraph) -> bool:
    """Whether a lookup's subscript itself reads a captured tensor (``t[ids[q_idx]]``): then
    whether the lookups stay in bounds depends on tensor values, not only on their shapes."""
    return any(n.op == "tensor" for _, _, subscript in subscripts(graph) for n in subscript.nodes)


def read_outside(subscript: ModGraph, size: int, values: Dict[str, Tensor]) -> Optional[Tuple[int, Dict[str, int]]]:
    """The first index outside a dimension of ``size`` that ``subscript`` takes at any
    combination of the ``values`` (1-D, by input name) of the inputs it reads, and those
    inputs' values there; None where it takes none. Negative indices count from the end, as
    torch reads them."""
    grid = {name: values[name].view([-1 if other == name else 1 for other in MASK_INPUTS]) for name in subscript.deps}
    at = evaluate(subscript.output, grid).long()
    bad = ((at >= size) | (at < -size)).nonzero()
    if not len(bad):
        return None
    first = bad[0].tolist()
    return int(at[tuple(first)]), {name: int(values[name][first[MASK_INPUTS.index(name)]])
                                    for name in MASK_INPUTS if name in subscript.deps}


def lookup_message(kind: str, shape: Tuple[int, ...], index: int, at: Dict[str, int]) -> str:
    """The refusal of a ``kind`` that reads ``index`` of a captured tensor of ``shape`` at the inputs ``at``."""
    where = f" (at {', '.join(f'{name} = {value}' for name, value in at.items())})" if at else ""
    positions = at.keys() & {"q_idx", "kv_idx"}
    if len(positions) == 2:
        why = ("a tensor a mod indexes by q_idx and kv_idx together must cover every pair of the global sequence's "
               "positions (for q_idx - kv_idx, every distance), not one rank's shard")
    elif positions:
        why = "a tensor a mod indexes by position must cover every position of the global sequence, not one rank's shard"
    else:
        why = "it must have an entry for every batch element and head of the call"
    return f"{kind} reads index {index} of a captured tensor of shape {shape}{where}: {why}"


def lookup_error(graph: ModGraph, values: Dict[str, Tensor]) -> Optional[str]:
    """What ``graph`` reads outside a captured tensor, or None. Every lookup whose subscript
    depends on one input at most is evaluated at all of that input's ``values`` (the positions,
    batches and heads of a call): on a GPU such a read would end the process's CUDA context
    with a device-side assert. Subscripts of several inputs take too many values to evaluate
    at each: ``bounds.ranged_lookup_error`` checks them on ranges."""
    for shape, size, subscript in subscripts(graph):
        if len(subscript.deps) <= 1 and subscript.deps <= values.keys():
            found = read_outside(subscript, size, values)
            if found:
                return lookup_message(graph.kind, shape, *found)
    return None


# --------------------------------------------------------------------------- derivative

def _zero() -> Node:
    return const(0.0, torch.float32)


def _add(x: Optional[Node], y: Optional[Node]) -> Optional[Node]:
    return y if x is None else x if y is None else op("add", x, y)


def _mul(g: Node, x: Node) -> Node:
    if x.op == "const" and x.value == 1:
        return g
    return op("mul", g, x)


def _vjp(n: Node, g: Node) -> List[Optional[Node]]:
    """Gradients of ``n``'s arguments given the gradient ``g`` of ``n``."""
    a = n.args
    if n.op == "add":
        return [g, g]
    if n.op == "sub":
        return [g, op("neg", g)]
    if n.op == "mul":
        return [_mul(g, a[1]), _mul(g, a[0])]
    if n.op == "div":
        return [op("div", g, a[1]), op("neg", op("div", op("mul", g, n), a[1]))]
    if n.op == "neg":
        return [op("neg", g)]
    if n.op == "exp":
        return [op("mul", g, n)]
    if n.op == "log":
        return [op("div", g, a[0])]
    if n.op == "sqrt":
        return [op("div", g, op("mul", const(2.0), n))]
    if n.op == "tanh":
        return [op("tanh_backward", g, a[0])]
    if n.op == "sigmoid":
        return [op("sigmoid_backward", g, a[0])]
    if n.op == "abs":
        zero = _zero()
        return [op("where", op("gt", a[0], zero), g, op("where", op("lt", a[0], zero), op("neg", g), zero))]
    if n.op == "pow":
        if a[1].deps:
            raise UnsupportedModError("x ** y is differentiable w.r.t. the score only for a constant exponent y")
        return [op("mul", g, op("mul", a[1], op("pow", a[0], op("sub", a[1], const(1)))))]
    if n.op in ("minimum", "maximum"):
        win = op("lt" if n.op == "minimum" else "gt", a[0], a[1])
        lose = op("lt" if n.op == "minimum" else "gt", a[1], a[0])
        zero = _zero()
        if n.value == "clamp":  # x = a[0] takes the gradient unless it lies beyond the bound
            return [op("where", lose, zero, g), op("where", lose, g, zero)]
        half = op("mul", g, const(0.5))
        # torch splits the gradient evenly between equal operands.
        return [op("where", win, g, op("where", lose, zero, half)),
                op("where", lose, g, op("where", win, zero, half))]
    if n.op == "where":
        zero = _zero()
        return [None, op("where", a[0], g, zero), op("where", a[0], zero, g)]
    if n.op == "mod":
        return [g, op("neg", op("mul", g, op("floordiv", a[0], a[1])))]
    if n.op == "cast":
        return [g if n.dtype.is_floating_point and a[0].dtype.is_floating_point else None]
    return [None] * len(a)  # comparisons, logic, floor, floordiv, lookups: zero gradient


def score_grad(graph: ModGraph) -> ModGraph:
    """The graph of ``grad * d score_mod / d score`` with inputs (grad, score, b, h, q_idx, kv_idx).

    Built backwards from the output, so a kernel's backward can reuse the forward's
    intermediate values (e.g. the pre-tanh score of a softcap).
    """
    if graph.kind != "score_mod":
        raise ValueError(f"score_grad needs a score_mod graph, got a {graph.kind} graph")
    grad = leaf("grad", torch.float32)
    grads: Dict[int, Node] = {id(graph.output): grad}
    for n in reversed(graph.nodes):
        g = grads.get(id(n))
        if g is None or not n.args:
            continue
        for x, gx in zip(n.args, _vjp(n, g)):
            if gx is not None and "score" in x.deps and x.dtype.is_floating_point:
                grads[id(x)] = _add(grads.get(id(x)), gx)
    score = next((n for n in graph.nodes if n.op == "score"), None)
    result = grads.get(id(score)) if score is not None else None
    if result is None:
        result = op("mul", grad, _zero())
    return ModGraph("score_grad", ("grad",) + SCORE_INPUTS, _topological(result))


# --------------------------------------------------------------------------- fingerprint

def _digest(nodes: Sequence[Node], identity: bool) -> str:
    index = {id(n): i for i, n in enumerate(nodes)}
    h = hashlib.sha1()
    for n in nodes:
        if n.op == "const":
            value = float(n.value).hex() if isinstance(n.value, float) else repr(n.value)
        elif n.op == "tensor":
            t = n.value
            value = (tuple(t.shape), str(t.dtype), t.device.type) + ((id(t),) if identity else ())
        else:
            value = str(n.value) if n.value is not None else ""
        h.update(repr((n.op, str(n.dtype), value, tuple(index[id(a)] for a in n.args))).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- diagonal bands

# Casts that keep an integer affine form's values: between integer types, and to a float type
# where they stay within its integers (``_cast_exact``).
_INTEGER_CASTS = (torch.int32, torch.int64)
_FLOAT_CASTS = (torch.float32, torch.float64)
_MAX_POSITION = 2 ** 31  # positions are int32


def _cast_exact(form: Tuple[int, int, int], dtype: torch.dtype) -> bool:
    """Whether ``form``'s values (a * q_idx + b * kv_idx + c) stay exact as ``dtype``: float64
    holds every integer up to 2**53; float32 up to 2**24, taken for a position, or a distance,
    plus an offset (``(q_idx - kv_idx).float()``): exact below 2**24 - 2**20 positions (15.7M tokens)."""
    a, b, c = form
    scale = max(abs(a), abs(b)) if a * b <= 0 else abs(a) + abs(b)  # |value| <= scale * position + |c|
    if dtype == torch.float64:
        return scale * _MAX_POSITION + abs(c) < 2 ** 53
    return scale <= 1 and abs(c) <= 2 ** 20


def _affine(n: Node) -> Optional[Tuple[int, int, int]]:
    """(a, b, c) with n == a * q_idx + b * kv_idx + c in exact integers, or None if n is not
    affine in them. Integer arithmetic only, as torch computes it: ``(q_idx * 0.7)`` rounds in
    float32 (so does ``q_idx * 1e8``, past 2**24) and ``.long()`` of it truncates, so a band
    derived from exact arithmetic would be off by a row."""
    if n.op in ("add", "sub", "neg", "mul") and n.dtype.is_floating_point:
        return None
    if n.op == "q_idx":
        return 1, 0, 0
    if n.op == "kv_idx":
        return 0, 1, 0
    if n.op == "const" and not isinstance(n.value, bool) and float(n.value).is_integer():
        return 0, 0, int(n.value)
    if n.op == "cast" and n.dtype in _INTEGER_CASTS + _FLOAT_CASTS:
        x = _affine(n.args[0])
        exact = n.args[0].dtype in _INTEGER_CASTS + _FLOAT_CASTS and (
            n.dtype in _INTEGER_CASTS or (x is not None and _cast_exact(x, n.dtype)))
        return x if exact else None
    if n.op in ("add", "sub"):
        x, y = _affine(n.args[0]), _affine(n.args[1])
        if x is None or y is None:
            return None
        s = 1 if n.op == "add" else -1
        return x[0] + s * y[0], x[1] + s * y[1], x[2] + s * y[2]
    if n.op == "neg":
        x = _affine(n.args[0])
        return None if x is None else (-x[0], -x[1], -x[2])
    if n.op == "mul":
        x, y = _affine(n.args[0]), _affine(n.args[1])
        if x is None or y is None:
            return None
        if x[:2] == (0, 0):
            x, y = y, x
        if y[:2] != (0, 0):
            return None
        return x[0] * y[2], x[1] * y[2], x[2] * y[2]
    return None


def _atom_bounds(n: Node) -> Optional[Tuple[float, float]]:
    """Bounds (lo, hi) on q_idx - kv_idx that a comparison states, or None."""
    if n.op == "const" and n.dtype == torch.bool:
        return (-math.inf, math.inf) if n.value else (math.inf, -math.inf)
    if n.op not in ("lt", "le", "gt", "ge", "eq"):
        return None
    x, y = _affine(n.args[0]), _affine(n.args[1])
    if x is None or y is None:
        return None
    a, b, c = x[0] - y[0], x[1] - y[1], x[2] - y[2]  # a*q + b*kv + c (op) 0
    if a == 0 or a != -b:
        return None
    cmp = n.op
    if a < 0:  # divide by a < 0 flips the comparison
        cmp = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}[cmp]
    t = Fraction(-c, a)  # delta (op) t with delta = q_idx - kv_idx, an integer
    lo, hi = -math.inf, math.inf
    if cmp in ("ge", "eq"):
        lo = math.ceil(t)
    if cmp == "gt":
        lo = math.floor(t) + 1
    if cmp in ("le", "eq"):
        hi = math.floor(t)
    if cmp == "lt":
        hi = math.ceil(t) - 1
    return lo, hi


def diagonal_band(mask: ModGraph) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """(lo, hi) if the mask is exactly ``lo <= q_idx - kv_idx <= hi`` (None: unbounded), else None.

    Recognises conjunctions of affine comparisons of q_idx and kv_idx (causal, sliding
    window, ...), which kernels can run with a native diagonal-band mask that skips tiles.
    """
    if mask.kind != "mask_mod" or not mask.deps <= {"q_idx", "kv_idx"}:
        return None

    def bounds(n: Node):
        if n.op == "and":
            x, y = bounds(n.args[0]), bounds(n.args[1])
            return None if x is None or y is None else (max(x[0], y[0]), min(x[1], y[1]))
        return _atom_bounds(n)

    result = bounds(mask.output)
    if result is None or result[0] > result[1]:  # no band, or no pair at all (a False conjunct)
        return None
    lo, hi = result
    return (None if lo == -math.inf else int(lo)), (None if hi == math.inf else int(hi))
