"""Masks that are a diagonal band, ``lo <= q_idx - kv_idx <= hi`` (causal, sliding window):
kernels run them with a native band mask that skips tiles, and the planner runs a causal own
block as one call (``diagonal_band``).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import List, Optional, Tuple

import torch

from .graph import ModGraph, Node


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
    split = band_and_rest(mask)
    if split is None or split[2]:
        return None
    return split[0], split[1]


def band_and_rest(mask: ModGraph) -> Optional[Tuple[Optional[int], Optional[int], List[Node]]]:
    """(lo, hi, rest): the mask as ``lo <= q_idx - kv_idx <= hi`` (None: unbounded) and the
    conjuncts ``rest`` that are no such comparison (a document mask's id equality), so a
    caller can price the band and what it understands of the rest in closed form; None
    where the mask depends on more than q_idx and kv_idx or shows no pair at all."""
    if mask.kind != "mask_mod" or not mask.deps <= {"q_idx", "kv_idx"}:
        return None
    lo, hi, rest = -math.inf, math.inf, []
    for n in _conjuncts(mask.output):
        b = _atom_bounds(n)
        if b is None:
            rest.append(n)
        else:
            lo, hi = max(lo, b[0]), min(hi, b[1])
    if lo > hi:  # a False conjunct, or bounds no difference meets
        return None
    return (None if lo == -math.inf else int(lo)), (None if hi == math.inf else int(hi)), rest


def _conjuncts(n: Node) -> List[Node]:
    """The operands of a tree of logical ``and`` s, left to right."""
    return _conjuncts(n.args[0]) + _conjuncts(n.args[1]) if n.op == "and" and n.dtype == torch.bool else [n]
