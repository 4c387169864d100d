"""Deciding a block's kind from the mask's formula, without evaluating it on every pair.

The mask's traced graph (``mod.trace``) is evaluated on *ranges*: q_idx over the
block's query positions, kv_idx over its key positions, b and h over all batches and heads.
If the result is True for the whole range the block is FULL, if False it is EMPTY. Anything
the ranges cannot decide (an op without a rule, a range that straddles the answer) gives
None, and the planner evaluates the block densely, so the answer is always exact. Causal,
sliding-window, prefix-LM, document and 2-D masks are decided in microseconds however long
the sequence.

Floating-point values are ranged as if computed exactly, then widened by what torch may round
them by in the dtype it computes them in (``_widen``): a block whose answer lies within that
rounding (an int32 distance of 9 times 0.7 gives 6.2999997 in float32, not 6.3) is left to
dense evaluation. Integers and booleans are exact, so integer masks keep their exact answers.

The same rules run on tensors of ranges (``tile_ranges``): every query of a block against
every tile of its keys at once, which tells the cuDNN kernel's exact plan which tiles it need
not evaluate pair by pair (``plan.extents``).
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .graph import COMPARISONS, MASK_INPUTS, ModGraph, UnsupportedModError
from .lookups import lookup_message, read_outside, subscripts
from .trace import trace_mask_mod


class Undecided(Exception):
    """The ranges cannot decide this op; the caller falls back to dense evaluation."""


@dataclass(frozen=True)
class Range:
    """All values a scalar may take lie in [lo, hi] (bools as False < True). ``lo`` and ``hi``
    are numbers, or broadcastable tensors of them: one range per element (``tile_ranges``)."""

    lo: object
    hi: object


# The rules below take numbers or tensors alike; these few helpers are where the two differ.
def _select(c, x, y):
    return torch.where(c, x, y) if isinstance(c, torch.Tensor) else (x if c else y)


def _map(number_fn, tensor_fn, x):
    return tensor_fn(x) if isinstance(x, torch.Tensor) else number_fn(x)


def _minimum(x, y):
    return _select(x <= y, x, y)


def _maximum(x, y):
    return _select(x >= y, x, y)


def _negate(x):
    return ~x if isinstance(x, torch.Tensor) else not x


def _undecided_if(condition, why: str) -> None:
    """Give up where ``condition`` holds (for any element)."""
    if condition.any() if isinstance(condition, torch.Tensor) else condition:
        raise Undecided(why)


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
    return Range(functools.reduce(_minimum, values), functools.reduce(_maximum, values))


def _add(a, b):
    return Range(a.lo + b.lo, a.hi + b.hi)


def _sub(a, b):
    return Range(a.lo - b.hi, a.hi - b.lo)


def _floordiv(a, b):
    _undecided_if((b.lo <= 0) & (b.hi >= 0), "division by a range that holds 0")
    return _corners(operator.floordiv, a, b)


def _remainder(a, b):
    _undecided_if((b.lo != b.hi) | (b.lo <= 0), "remainder by a range")
    m = b.lo
    within = a.lo // m == a.hi // m  # no multiple of m between them
    top = m - 1 if isinstance(m, int) else m
    return Range(_select(within, a.lo % m, 0), _select(within, a.hi % m, top))


def _abs(a):
    return Range(_select(a.lo >= 0, a.lo, _select(a.hi <= 0, -a.hi, 0)), _maximum(-a.lo, a.hi))


def _compare(strict, flip=False):
    """a < b (strict) or a <= b, with the operands swapped for > and >=."""
    def rule(a, b):
        if flip:
            a, b = b, a
        less = operator.lt if strict else operator.le
        return Range(less(a.hi, b.lo), less(a.lo, b.hi))
    return rule


def _eq(a, b):
    return Range((a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo), _negate((a.hi < b.lo) | (b.hi < a.lo)))


def _ne(a, b):
    e = _eq(a, b)
    return Range(_negate(e.hi), _negate(e.lo))


def _truth(x):
    if isinstance(x, torch.Tensor):
        return x if x.dtype == torch.bool else x != 0
    return bool(x)


def _and(a, b):
    return Range(_truth(a.lo) & _truth(b.lo), _truth(a.hi) & _truth(b.hi))


def _or(a, b):
    return Range(_truth(a.lo) | _truth(b.lo), _truth(a.hi) | _truth(b.hi))


def _not(a):
    return Range(_negate(_truth(a.hi)), _negate(_truth(a.lo)))


def _where(c, x, y):
    either = Range(_minimum(x.lo, y.lo), _maximum(x.hi, y.hi))
    return Range(_select(c.lo, x.lo, _select(c.hi, either.lo, y.lo)), _select(c.lo, x.hi, _select(c.hi, either.hi, y.hi)))


def _index(table, indices):
    """table[i] for i in a range: the min and max of the table over that range."""
    if not isinstance(table, torch.Tensor) or table.dim() != 1 or len(indices) != 1 or indices[0] is None:
        raise Undecided("lookup other than a 1-D table indexed once")
    i = _as_range(indices[0])
    if isinstance(i.lo, torch.Tensor) or isinstance(i.hi, torch.Tensor):
        return _lookups(table, i)
    lo, hi = int(i.lo), int(i.hi)
    # a range that reaches outside the table may take any of its values (negative indices count from its end)
    part = table[lo:hi + 1] if 0 <= lo <= hi < table.numel() else table
    return Range(*torch.stack([part.min(), part.max()]).tolist())


_MAX_LOOKUPS = 1 << 24  # table entries read at once for ranges held in tensors


def _lookups(table: torch.Tensor, i: Range) -> Range:
    """``_index`` for ranges held in tensors: every entry of each range read (a range of a
    query's own position is one entry; of a tile of keys, the tile's). A range that reaches
    outside the table may take any of its values (negative indices count from its end), which
    spares the GPU a check the host would wait for."""
    n = table.numel()
    lo, hi = torch.as_tensor(i.lo).long(), torch.as_tensor(i.hi).long()
    outside = (lo < 0) | (hi >= n) | (hi < lo)
    lo, hi = torch.broadcast_tensors(lo.clamp(0, n - 1), hi.clamp(0, n - 1))
    if i.lo is i.hi:  # one entry per range
        entries = table[lo].unsqueeze(-1)
    else:
        width = int((hi - lo).max()) + 1
        if lo.numel() * width > _MAX_LOOKUPS:
            raise Undecided("lookups over ranges too long to read")
        entries = table[torch.minimum(lo.unsqueeze(-1) + torch.arange(width, device=lo.device), hi.unsqueeze(-1))]
    return Range(torch.where(outside, table.min(), entries.amin(-1)), torch.where(outside, table.max(), entries.amax(-1)))


def _monotone(fn, tensor_fn, lowest=-math.inf):
    """An increasing function, defined above ``lowest``."""
    def rule(a):
        if lowest > -math.inf:
            _undecided_if(a.lo < lowest, f"{fn.__name__} of a range reaching below its domain")
        exact = lambda t: tensor_fn(t.double())  # noqa: E731  (positions as large as 2**24 stay exact)
        return Range(_map(fn, exact, a.lo), _map(fn, exact, a.hi))
    return rule


def _cast(a: Range, dtype: torch.dtype) -> Range:
    if dtype == torch.bool:
        return _ne(a, Range(0, 0))
    if dtype.is_floating_point:
        return a
    truncated = Range(*(_map(math.trunc, _truncated, x) for x in (a.lo, a.hi)))  # monotone
    # torch wraps what the type cannot hold (-1 as uint8 is 255): such a range may take any value of it
    info = torch.iinfo(dtype)
    wraps = (truncated.lo < info.min) | (truncated.hi > info.max)
    return Range(_select(wraps, info.min, truncated.lo), _select(wraps, info.max, truncated.hi))


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """Toward zero, as an int64 tensor: ranges of integers are held in int64 (``_exact``)."""
    return (torch.trunc(t) if t.is_floating_point() else t).long()


def _exact(r: Range, dtype: torch.dtype) -> Range:
    """``r``, the range of an integer op computed in ``dtype``; undecided where torch's result
    would wrap around, which the range (exact, in Python ints or int64) does not."""
    if dtype.is_floating_point or dtype == torch.bool:
        return r
    info = torch.iinfo(dtype)
    _undecided_if((r.lo < info.min) | (r.hi > info.max), f"a value that may overflow {dtype}")
    return r


def _div(a, b):
    _undecided_if((b.lo <= 0) & (b.hi >= 0), "division by a range that holds 0")
    return _corners(operator.truediv, a, b)


_BINARY = {
    "add": _add, "sub": _sub, "mul": lambda a, b: _corners(operator.mul, a, b), "div": _div,
    "floordiv": _floordiv, "mod": _remainder,
    "minimum": lambda a, b: Range(_minimum(a.lo, b.lo), _minimum(a.hi, b.hi)),
    "maximum": lambda a, b: Range(_maximum(a.lo, b.lo), _maximum(a.hi, b.hi)),
    "lt": _compare(True), "le": _compare(False), "gt": _compare(True, flip=True), "ge": _compare(False, flip=True),
    "eq": _eq, "ne": _ne, "and": _and, "or": _or,
}
_BOOLEAN = {"add": "or", "mul": "and"}
_UNARY = {
    "abs": _abs, "neg": lambda a: Range(-a.hi, -a.lo), "not": _not,
    "floor": _monotone(math.floor, torch.floor),
    "exp": _monotone(lambda x: math.exp(x) if x < 710 else math.inf, torch.exp),
    "tanh": _monotone(math.tanh, torch.tanh),
    "sigmoid": _monotone(lambda x: 1 / (1 + math.exp(-x)) if x > -700 else 0.0, torch.sigmoid),
    "sqrt": _monotone(math.sqrt, torch.sqrt, lowest=0),
    "log": _monotone(lambda x: math.log(x) if x > 0 else -math.inf, torch.log, lowest=0),
}


# eps by which one op may round: half of one for + - * / and conversions, a few for exp, tanh, ...
# Each op widens its own result, so the margins of a formula's several ops add up.
_ULPS = 4
_ROUNDED = frozenset({"add", "sub", "mul", "div", "exp", "log", "sqrt", "tanh", "sigmoid"})


def _widen(r: Range, dtype: torch.dtype) -> Range:
    """``r`` grown outward by what a value computed in ``dtype`` may be rounded by: ``_ULPS``
    eps of it, and the smallest normal number (underflow, flushed to zero on GPUs). Undecided
    where the value may overflow to inf (inf - inf is nan, which no comparison holds for)."""
    info = torch.finfo(dtype)
    lo, hi = (_map(float, torch.Tensor.double, x) for x in (r.lo, r.hi))
    _undecided_if((abs(lo) > info.max) | (abs(hi) > info.max), f"a value that may overflow {dtype}")
    return Range(lo - abs(lo) * (_ULPS * info.eps) - info.tiny, hi + abs(hi) * (_ULPS * info.eps) + info.tiny)


def _computed_in(n) -> Optional[torch.dtype]:
    """The floating-point dtype torch computes node ``n`` in, its operands converted to it, or
    None (integers and booleans are exact; a lookup reads the table's values as they are). A
    comparison computes in its operands' common dtype: an index tensor against 6.3, float32."""
    if n.op == "index" or not (n.dtype.is_floating_point or any(a.dtype.is_floating_point for a in n.args)):
        return None
    dtype = n.dtype
    if n.op in COMPARISONS:
        dtype = torch.result_type(*(a.value if a.op in ("const", "tensor") else torch.empty(1, dtype=a.dtype)
                                    for a in n.args))
    return dtype if dtype.is_floating_point else None


def _converted(a, dtype: torch.dtype) -> bool:
    """Whether operand node ``a`` is rounded on its way into a ``dtype`` op: a Python number
    (exact here, 0.7 is not in float32) or a value of another dtype (positions past 2**24)."""
    return a.dtype != torch.bool and (a.op == "const" or a.dtype != dtype)


def _range_of(n, args, env, tables):
    """The range of node ``n`` from its arguments' ``args``, inputs given by ``env`` and captured
    tensors by ``tables`` (by node id)."""
    dtype = _computed_in(n)
    if dtype is not None:
        args = [_widen(_as_range(r), dtype) if _converted(a, dtype) else r for a, r in zip(n.args, args)]
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
        # booleans add and multiply as or and and: torch keeps them booleans
        rule = _BOOLEAN.get(n.op, n.op) if n.dtype == torch.bool else n.op
        v = _exact(_BINARY[rule](_as_range(args[0]), _as_range(args[1])), n.dtype)
    else:
        raise Undecided(f"no range rule for {n.op}")
    return _widen(v, dtype) if dtype is not None and n.op in _ROUNDED else v


def _ranges(graph, env, tables):
    """The range of ``graph``'s output (``_range_of`` every node)."""
    memo = {}
    for n in graph.nodes:
        memo[id(n)] = _range_of(n, [memo[id(a)] for a in n.args], env, tables)
    return _as_range(memo[id(graph.output)])


def node_ranges(graph, env) -> dict:
    """By node id, the range of every node of ``graph`` over the ranges ``env`` gives its
    inputs (numbers), or None where they cannot decide it (inputs ``env`` leaves out, the
    score say, are undecided). Lookups read a host copy of the captured tensors."""
    tables = {id(n): n.value.detach().cpu() for n in graph.nodes if n.op == "tensor"}
    memo = {}
    for n in graph.nodes:
        args = [memo[id(a)] for a in n.args]
        try:
            memo[id(n)] = None if None in args else _range_of(n, args, env, tables)
        except Undecided:
            memo[id(n)] = None
    return memo


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


def tile_ranges(graph, q_positions: torch.Tensor, kv_first: torch.Tensor, kv_last: torch.Tensor):
    """For every query position and every range ``kv_first[j]..kv_last[j]`` of key positions at
    once: whether the mask holds for all of the keys (``lo``) and for some (``hi``), as
    [len(q_positions), len(kv_first)] bools; None where the ranges cannot decide an op. For
    masks that depend on neither batch nor head (both taken as 0)."""
    # int64: the ranges of integer ops are exact where the mask computes in int64 (``_exact``)
    q, shape = q_positions.long().view(-1, 1), (len(q_positions), len(kv_first))
    env = {"b": Range(0, 0), "h": Range(0, 0), "q_idx": Range(q, q),
           "kv_idx": Range(kv_first.long().view(1, -1), kv_last.long().view(1, -1))}
    tables = {id(n): n.value for n in graph.nodes if n.op == "tensor"}
    bounds = mask_bounds(graph, env, tables)
    return None if bounds is None else tuple(torch.as_tensor(x, device=q.device).expand(shape) for x in bounds)


def mask_bounds(graph, env, tables):
    """(lo, hi) of a mask's graph over the ranges ``env``: whether it holds at every point of
    them and at some, as bools; None where the ranges cannot decide an op."""
    try:
        result = _ranges(graph, env, tables)
        if not all(isinstance(x, bool) or getattr(x, "dtype", None) == torch.bool for x in (result.lo, result.hi)):
            result = _cast(result, torch.bool)
    except Undecided:
        return None
    return result.lo, result.hi


_LOOKUP_TILE = 128  # positions a side of the tiles a lookup's subscript is ranged over, at least
_MAX_LOOKUP_TILES = 1 << 20  # tiles of a block ranged at once: longer blocks take larger tiles
_MAX_LOOKUP_READS = 1 << 26  # reads of a block evaluated one by one, where the ranges leave them open


def ranged_lookup_error(graph: ModGraph, batch: int, heads: int, q_segs, kv_segs, device) -> Optional[str]:
    """What ``graph`` reads outside a captured tensor through a subscript of several inputs (a
    table of relative positions, ``bias[q_idx - kv_idx + c]``) at any batch element, head and
    pair of a query of ``q_segs`` and a key of ``kv_segs``, or None. A rank's queries times
    the sequence's keys are too many pairs to evaluate each, so the subscript is ranged over
    tiles of them, and evaluated pair by pair only in tiles whose range reaches outside the
    tensor: a read outside is named where it happens. Where those hold too many reads (ranges
    that do not settle the subscript: no rule for an op, a guard the ranges cannot follow), the
    error says that the reads could not be checked."""
    for shape, size, subscript in subscripts(graph):
        if len(subscript.deps) < 2 or not subscript.deps <= set(MASK_INPUTS):
            continue
        tables = {id(n): n.value.detach().cpu() for n in subscript.nodes if n.op == "tensor"}
        for q_seg, kv_seg in itertools.product(q_segs, kv_segs):
            try:
                found = _read_outside(subscript, size, tables, batch, heads, q_seg, kv_seg, device)
            except Undecided as e:
                inputs = " and ".join(name for name in MASK_INPUTS if name in subscript.deps)
                return (f"{graph.kind} indexes a captured tensor of shape {shape} by {inputs}, and its ranges cannot "
                        f"show that every read stays inside it: {e}. Clamp the subscript into the tensor "
                        f"(.clamp(0, {size - 1})) to settle them")
            if found:
                return lookup_message(graph.kind, shape, *found)
    return None


def _read_outside(subscript: ModGraph, size: int, tables, batch: int, heads: int, q_seg, kv_seg, device):
    """``lookups.read_outside`` over every batch element, head and pair of a query of ``q_seg``
    and a key of ``kv_seg``, evaluated in the tiles whose range reaches outside (``tables``:
    host copies of the tensors the subscript reads, by node id); raises Undecided where those
    hold more than ``_MAX_LOOKUP_READS`` reads."""
    if not q_seg.length or not kv_seg.length:
        return None
    whole = _tiles(q_seg, q_seg.length), _tiles(kv_seg, kv_seg.length)
    if not _reaching_outside(subscript, size, batch, heads, *whole, tables).any():
        return None  # the block's range settles most subscripts at once
    tile = _LOOKUP_TILE
    while -(-q_seg.length // tile) * -(-kv_seg.length // tile) > _MAX_LOOKUP_TILES:
        tile *= 2
    q_tiles, kv_tiles = _tiles(q_seg, tile), _tiles(kv_seg, tile)
    values = {"b": torch.arange(batch, device=device), "h": torch.arange(heads, device=device)}
    reads = 0
    for i, j in _reaching_outside(subscript, size, batch, heads, q_tiles, kv_tiles, tables).nonzero().tolist():
        values["q_idx"] = q_seg.slice(int(q_tiles[0][i]), int(q_tiles[1][i])).positions(device)
        values["kv_idx"] = kv_seg.slice(int(kv_tiles[0][j]), int(kv_tiles[1][j])).positions(device)
        reads += math.prod(len(values[name]) for name in subscript.deps)
        if reads > _MAX_LOOKUP_READS:
            raise Undecided(f"more than {_MAX_LOOKUP_READS} reads at queries {q_seg.start} to {int(q_tiles[3][-1])} "
                            f"and keys {kv_seg.start} to {int(kv_tiles[3][-1])} are left to evaluate one by one")
        found = read_outside(subscript, size, values)
        if found:
            return found
    return None


def _reaching_outside(subscript: ModGraph, size: int, batch: int, heads: int, q_tiles, kv_tiles, tables):
    """[query tiles, key tiles]: whether the subscript's range over a tile pair (every batch
    element and head) reaches outside a dimension of ``size``; True where the ranges cannot tell."""
    env = {"b": Range(0, batch - 1), "h": Range(0, heads - 1),
           "q_idx": Range(q_tiles[2].view(-1, 1), q_tiles[3].view(-1, 1)),
           "kv_idx": Range(kv_tiles[2].view(1, -1), kv_tiles[3].view(1, -1))}
    try:
        r = _ranges(subscript, env, tables)
        outside = torch.as_tensor((r.lo < -size) | (r.hi >= size))
    except Undecided:
        outside = torch.tensor(True)
    return outside.expand(len(q_tiles[0]), len(kv_tiles[0]))


def _tiles(seg, size: int):
    """The tiles of ``size`` positions of segment ``seg``: their local begins and ends, and
    their first and last positions."""
    begins = torch.arange(0, seg.length, size)
    ends = (begins + size).clamp(max=seg.length)
    return begins, ends, seg.start + seg.stride * begins, seg.start + seg.stride * (ends - 1)
