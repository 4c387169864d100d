"""Deciding a block's kind from the mask's formula, without evaluating it on every pair.

The mask's traced graph (``ringflex.trace``) is evaluated on *ranges*: q_idx over the
block's query positions, kv_idx over its key positions, b and h over all batches and heads.
If the result is True for the whole range the block is FULL, if False it is EMPTY. Anything
the ranges cannot decide (an op without a rule, a range that straddles the answer) gives
None, and the planner evaluates the block densely, so the answer is always exact. Causal,
sliding-window, prefix-LM, document and 2-D masks are decided in microseconds however long
the sequence.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .trace import UnsupportedModError, trace_mask_mod


class Undecided(Exception):
    """The ranges cannot decide this op; the caller falls back to dense evaluation."""


@dataclass(frozen=True)
class Range:
    """All values a scalar may take lie in [lo, hi] (bools as False < True)."""

    lo: float
    hi: float


def _as_range(x) -> Range:
    if isinstance(x, Range):
        return x
    if isinstance(x, (bool, int, float)):
        return Range(x, x)
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return Range(x.item(), x.item())
    raise Undecided(f"operand {type(x).__name__}")


def _corners(op, a: Range, b: Range) -> Range:
    values = [op(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return Range(min(values), max(values))


def _add(a, b):
    return Range(a.lo + b.lo, a.hi + b.hi)


def _sub(a, b):
    return Range(a.lo - b.hi, a.hi - b.lo)


def _floordiv(a, b):
    if b.lo <= 0 <= b.hi:
        raise Undecided("division by a range that holds 0")
    return _corners(lambda x, y: x // y, a, b)


def _remainder(a, b):
    if b.lo != b.hi or b.lo <= 0:
        raise Undecided("remainder by a range")
    m = b.lo
    if math.floor(a.lo / m) == math.floor(a.hi / m):
        return Range(a.lo % m, a.hi % m)
    return Range(0, m - 1) if isinstance(m, int) else Range(0, m)


def _abs(a):
    if a.lo >= 0:
        return a
    if a.hi <= 0:
        return Range(-a.hi, -a.lo)
    return Range(0, max(-a.lo, a.hi))


def _compare(strict, flip=False):
    """a < b (strict) or a <= b, with the operands swapped for > and >=."""
    def rule(a, b):
        if flip:
            a, b = b, a
        less = operator.lt if strict else operator.le
        return Range(bool(less(a.hi, b.lo)), bool(less(a.lo, b.hi)))
    return rule


def _eq(a, b):
    if a.lo == a.hi == b.lo == b.hi:
        return Range(True, True)
    return Range(False, not (a.hi < b.lo or b.hi < a.lo))


def _ne(a, b):
    e = _eq(a, b)
    return Range(not e.hi, not e.lo)


def _and(a, b):
    return Range(bool(a.lo and b.lo), bool(a.hi and b.hi))


def _or(a, b):
    return Range(bool(a.lo or b.lo), bool(a.hi or b.hi))


def _not(a):
    return Range(not a.hi, not a.lo)


def _where(c, x, y):
    if c.lo:
        return x
    if not c.hi:
        return y
    return Range(min(x.lo, y.lo), max(x.hi, y.hi))


def _index(table, indices):
    """table[i] for i in a range: the min and max of the table over that range."""
    if not isinstance(table, torch.Tensor) or table.dim() != 1 or len(indices) != 1 or indices[0] is None:
        raise Undecided("lookup other than a 1-D table indexed once")
    i = _as_range(indices[0])
    lo, hi = max(0, int(i.lo)), min(table.numel() - 1, int(i.hi))
    if lo > hi or i.lo < 0:
        raise Undecided("lookup out of range or with negative indices")
    part = table[lo:hi + 1]
    both = torch.stack([part.min(), part.max()]).tolist()
    return Range(*both)


def _monotone(fn, lowest=-math.inf):
    """An increasing function, defined above ``lowest``."""
    def rule(a):
        if a.lo < lowest:
            raise Undecided(f"{fn.__name__} of a range reaching below its domain")
        return Range(fn(a.lo), fn(a.hi))
    return rule


def _cast(a: Range, dtype: torch.dtype) -> Range:
    if dtype == torch.bool:
        return _ne(a, Range(0, 0))
    if dtype.is_floating_point:
        return a
    return Range(math.trunc(a.lo), math.trunc(a.hi))  # truncation is monotone


def _div(a, b):
    if b.lo <= 0 <= b.hi:
        raise Undecided("division by a range that holds 0")
    return _corners(operator.truediv, a, b)


_BINARY = {
    "add": _add, "sub": _sub, "mul": lambda a, b: _corners(operator.mul, a, b), "div": _div,
    "floordiv": _floordiv, "mod": _remainder,
    "minimum": lambda a, b: Range(min(a.lo, b.lo), min(a.hi, b.hi)),
    "maximum": lambda a, b: Range(max(a.lo, b.lo), max(a.hi, b.hi)),
    "lt": _compare(True), "le": _compare(False), "gt": _compare(True, flip=True), "ge": _compare(False, flip=True),
    "eq": _eq, "ne": _ne, "and": _and, "or": _or,
}
_UNARY = {
    "abs": _abs, "neg": lambda a: Range(-a.hi, -a.lo), "not": _not, "floor": _monotone(math.floor),
    "exp": _monotone(math.exp), "tanh": _monotone(math.tanh),
    "sigmoid": _monotone(lambda x: 1 / (1 + math.exp(-x)) if x > -700 else 0.0),
    "sqrt": _monotone(math.sqrt, lowest=0), "log": _monotone(lambda x: math.log(x) if x > 0 else -math.inf, lowest=0),
}


def _ranges(graph, env, tables):
    """The range of every node of ``graph``, inputs given by ``env`` and captured tensors by
    ``tables`` (by node id); the output's range."""
    memo = {}
    for n in graph.nodes:
        args = [memo[id(a)] for a in n.args]
        if n.op in env:
            v = env[n.op]
        elif n.op == "const":
            v = Range(n.value, n.value)
        elif n.op == "tensor":
            v = tables[id(n)]
        elif n.op == "index":
            v = _index(args[0], args[1:])
        elif n.op == "cast":
            v = _cast(_as_range(args[0]), n.value)
        elif n.op == "where":
            v = _where(*(_as_range(a) for a in args))
        elif n.op in _UNARY:
            v = _UNARY[n.op](_as_range(args[0]))
        elif n.op in _BINARY:
            v = _BINARY[n.op](_as_range(args[0]), _as_range(args[1]))
        else:
            raise Undecided(f"no range rule for {n.op}")
        memo[id(n)] = v
    return _as_range(memo[id(graph.output)])


def block_decider(mask_mod: Callable, batch: int, heads: int, device=None) -> Optional[Callable]:
    """A function (q_seg, kv_seg) -> True (FULL) / False (EMPTY) / None (undecided), or
    None if the mask cannot be traced."""
    try:
        graph = trace_mask_mod(mask_mod, device)
    except UnsupportedModError:  # data-dependent Python control flow and the like: evaluate densely
        return None
    # Lookups read host copies of the captured tensors (document ids): one device-to-host
    # copy per plan, not a synchronisation with the GPU per lookup.
    tables = {id(n): n.value.detach().cpu() for n in graph.nodes if n.op == "tensor"}

    def decide(q_seg, kv_seg) -> Optional[bool]:
        env = {"b": Range(0, batch - 1), "h": Range(0, heads - 1),
               "q_idx": Range(q_seg.start, q_seg.start + q_seg.stride * (q_seg.length - 1)),
               "kv_idx": Range(kv_seg.start, kv_seg.start + kv_seg.stride * (kv_seg.length - 1))}
        try:
            result = _ranges(graph, env, tables)
        except Undecided:
            return None
        if result.lo:
            return True
        if not result.hi:
            return False
        return None

    return decide
