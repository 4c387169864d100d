"""Tracing: a ``score_mod`` / ``mask_mod`` becomes an expression graph (``graph.ModGraph``).

A mod is traced with ``make_fx`` on one-element tensors (score float32, indices int32, as
flex_attention passes them) into ATen ops, which are mapped onto the few operations a fused
attention kernel can evaluate per score element (arithmetic, comparisons, logic, where, a
handful of unary functions and lookups of captured tensors). Anything else raises
``UnsupportedModError`` naming the op. A new closure of a mod traced before (same code,
captured values and tensor shapes) takes that graph with its own tensors instead of a new
trace (``_traced``).
"""
from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from types import CodeType
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .. import config
from ..cache import remember
from . import captured
from .graph import MASK_INPUTS, SCORE_INPUTS, ModGraph, Node, UnsupportedModError, const, leaf, op, topological

aten = torch.ops.aten


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
    nodes = topological(result)
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
    """The graph of ``fn``, once per ``captured.one_walk`` (a ring call's pass asks for it at
    every hop, and nothing the mod reads changes within one): else as ``_looked_up`` finds it."""
    return captured.kept(fn, ("trace", kind, device), lambda: _looked_up(fn, inputs, kind, device))


def _looked_up(fn, inputs, kind, device) -> ModGraph:
    parts = captured.parts(fn)
    if device is None:  # where its tensors live: a mod's traces are kept for one device, so every caller agrees
        device = captured.device_of(fn, parts)
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
