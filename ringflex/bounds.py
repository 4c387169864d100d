"""Deciding a block's kind from the mask's formula, without evaluating it on every pair.

The mask is traced once (make_fx) into a graph of aten ops, and the graph is evaluated on
*ranges*: q_idx over the block's query positions, kv_idx over its key positions, b and h
over all batches and heads. If the result is True for the whole range the block is FULL,
if False it is EMPTY. Anything the ranges cannot decide (an op without a rule, a range
that straddles the answer) gives None, and the planner evaluates the block densely, so
the answer is always exact. Causal, sliding-window, prefix-LM, document and 2-D masks
are decided in microseconds however long the sequence.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import Interpreter
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten


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


def _clamp(a, lo=None, hi=None):
    lo = _as_range(lo) if lo is not None else Range(-math.inf, -math.inf)
    hi = _as_range(hi) if hi is not None else Range(math.inf, math.inf)
    return Range(min(max(a.lo, lo.lo), hi.hi), min(max(a.hi, lo.hi), hi.hi))


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


_BINARY = {
    aten.add: _add, aten.sub: _sub, aten.mul: lambda a, b: _corners(operator.mul, a, b),
    aten.floor_divide: _floordiv, aten.remainder: _remainder,
    aten.minimum: lambda a, b: Range(min(a.lo, b.lo), min(a.hi, b.hi)),
    aten.maximum: lambda a, b: Range(max(a.lo, b.lo), max(a.hi, b.hi)),
    aten.lt: _compare(True), aten.le: _compare(False),
    aten.gt: _compare(True, flip=True), aten.ge: _compare(False, flip=True),
    aten.eq: _eq, aten.ne: _ne,
    aten.bitwise_and: _and, aten.logical_and: _and, aten.bitwise_or: _or, aten.logical_or: _or,
}
_UNARY = {aten.abs: _abs, aten.neg: lambda a: Range(-a.hi, -a.lo), aten.bitwise_not: _not, aten.logical_not: _not}
_SAME = {aten._to_copy, aten.to, aten.clone, aten.alias, aten.detach, aten.lift_fresh_copy, aten.view,
         aten.reshape, aten.expand, aten.unsqueeze, aten.squeeze, aten._unsafe_view}


class _RangeInterpreter(Interpreter):
    def call_function(self, target, args, kwargs):
        packet = getattr(target, "overloadpacket", None)
        if packet in _BINARY:
            return _BINARY[packet](_as_range(args[0]), _as_range(args[1]))
        if packet in _UNARY:
            return _UNARY[packet](_as_range(args[0]))
        if packet in _SAME:
            return args[0] if isinstance(args[0], Range) else _as_range(args[0])
        if packet is aten.div and kwargs.get("rounding_mode") == "floor":
            return _floordiv(_as_range(args[0]), _as_range(args[1]))
        if packet is aten.where:
            return _where(*(_as_range(a) for a in args))
        if packet is aten.clamp:
            return _clamp(_as_range(args[0]), *args[1:])
        if packet is aten.index:
            return _index(args[0], args[1])
        if packet in (aten.new_ones, aten.ones):
            return Range(True, True)
        if packet in (aten.new_zeros, aten.zeros):
            return Range(False, False)
        if packet is aten.scalar_tensor:
            return _as_range(args[0])
        raise Undecided(f"no range rule for {target}")


def block_decider(mask_mod: Callable, batch: int, heads: int, device=None) -> Optional[Callable]:
    """A function (q_seg, kv_seg) -> True (FULL) / False (EMPTY) / None (undecided), or
    None if the mask cannot be traced."""
    # Four distinct tensors: make_fx would give one object passed twice a single input.
    indices = [torch.zeros((1, 1, 1, 1), dtype=torch.int32, device=device) for _ in range(4)]
    try:
        graph = make_fx(mask_mod)(*indices)
    except Exception:  # data-dependent Python control flow and the like: evaluate densely
        return None

    def decide(q_seg, kv_seg) -> Optional[bool]:
        spans = [Range(0, batch - 1), Range(0, heads - 1),
                 Range(q_seg.start, q_seg.start + q_seg.stride * (q_seg.length - 1)),
                 Range(kv_seg.start, kv_seg.start + kv_seg.stride * (kv_seg.length - 1))]
        try:
            result = _as_range(_RangeInterpreter(graph).run(*spans))
        except Undecided:
            return None
        if result.lo:
            return True
        if not result.hi:
            return False
        return None

    return decide
