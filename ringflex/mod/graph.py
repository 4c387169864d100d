"""The expression graph of a mod, and its evaluation in torch.

A traced ``score_mod`` / ``mask_mod`` (``trace``) is a small graph of ``Node`` s: inputs
(``score``, ``b``, ``h``, ``q_idx``, ``kv_idx``), constants, captured tensors and the few
element-wise operations a fused attention kernel can evaluate per score element (``OPS``).
Kernels lower it, the planner ranges it (``ranges``), and it is evaluated here to check the
tracer against the mod itself. Its hash (``ModGraph.fingerprint``) keys compiled graphs.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

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



def topological(out: Node) -> List[Node]:
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


# --------------------------------------------------------------------------- evaluation

def evaluate(out: Node, env: Dict[str, Tensor]) -> Tensor:
    """``out`` evaluated with torch; ``env`` maps input names to (broadcastable) tensors."""
    memo: Dict[int, Tensor] = {}
    for n in topological(out):
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

