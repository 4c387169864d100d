"""Rows whose every score is huge, on the kernels that return the LSE as one float (cuDNN's,
flex_attention's): an additive -1e30 or finfo.min mask in a score_mod that leaves a row no
ordinary key, as Hugging Face masks padding.

Such a row's LSE is m + log(l) with |m| ~ 1e30, and one fp32 number rounds log(l) away: a
merge then weighs the row's hops by 1 instead of by l, and a backward's exp(s - lse) sums to
l instead of 1 (the output is the sum of V, not its mean). These kernels cannot say what
they rounded away (``res``, ``kernels.base``), and flex_attention's and cuDNN's kernels also
scale the scores by log2(e), which turns finfo.min into -inf: a row that looks masked. So
their rows whose LSE is that large, or not finite, are computed again by the reference
kernel, which keeps the LSE as (lse, res). Finding them reads the LSE on the host, so only
mods that can add such terms are checked (``huge_terms``).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..mod.graph import ModGraph, UnsupportedModError
from ..mod.trace import trace_score_mod
from .base import Mods
from .reference import ReferenceKernel

# From this magnitude on, an fp32 LSE is off by up to 2**-8 (half its spacing), a bf16 rounding;
# from 2**24 on, by up to log(l) itself.
HUGE = 2.0 ** 16
_HOLDS_HUGE: "weakref.WeakKeyDictionary[ModGraph, bool]" = weakref.WeakKeyDictionary()
_UNTRACEABLE: "weakref.WeakSet" = weakref.WeakSet()  # not traced again at every hop


def huge_terms(score_mod, device) -> bool:
    """Whether ``score_mod`` may add terms of magnitude ``HUGE`` or more: a float constant, or a
    float tensor it reads holding one (read once per traced graph); True where it cannot be
    traced to tell."""
    if score_mod is None:
        return False
    with contextlib.suppress(TypeError):  # unhashable: traced again
        if score_mod in _UNTRACEABLE:
            return True
    try:
        graph = trace_score_mod(score_mod, device)
    except UnsupportedModError:
        with contextlib.suppress(TypeError):
            _UNTRACEABLE.add(score_mod)
        return True
    return holds_huge(graph)


def holds_huge(graph: Optional[ModGraph]) -> bool:
    """``huge_terms`` of a traced score_mod (None: no score_mod)."""
    if graph is None:
        return False
    if graph not in _HOLDS_HUGE:
        _HOLDS_HUGE[graph] = any(_huge_input(a) for n in graph.nodes if n.dtype.is_floating_point for a in n.args)
    return _HOLDS_HUGE[graph]


def _huge_input(n) -> bool:
    if n.op == "const":
        return HUGE <= abs(n.value) < math.inf
    if n.op == "index":
        n = n.args[0]
    if n.op != "tensor" or not n.value.is_floating_point() or n.value.numel() == 0:
        return False
    values = n.value.detach().abs()
    return bool(torch.where(values.isfinite(), values, 0.0).max() >= HUGE)


def _span(rows: Tensor) -> Optional[Tuple[int, int]]:
    """The first and past the last row where ``rows`` [B, H, L] holds anywhere; None if nowhere.
    Under CUDA-graph capture, which cannot read it, every row."""
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        return 0, rows.shape[-1]
    found = rows.flatten(0, -2).any(0).nonzero()
    return (int(found[0]), int(found[-1]) + 1) if found.numel() else None


def _warn(kernel: str) -> None:
    from ..config import warn_once as _warn_once
    _warn_once(f"ringflex: the score_mod adds terms of 2**16 or more in magnitude (an additive -1e30 or finfo.min "
               f"mask?): rows whose LSE is that large or not finite are computed by the reference kernel, not "
               f"{kernel}, as one fp32 LSE cannot hold their log-sum-exp (slower; a mask_mod masks keys at full "
               f"speed)")


def exact_forward(kernel: str, may_be_huge: bool, out: Tensor, lse: Tensor, q, k, v, q_seg, kv_seg, mods: Mods,
                  scale: float, masked: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """A hop's (out, lse, res) from a kernel's (out, lse): where the score_mod ``may_be_huge``
    (``huge_terms``), rows of an LSE that is huge or not finite (overflowed, or seeing no
    key) are computed again by the reference kernel."""
    span = _span(~(lse.abs() < HUGE)) if may_be_huge else None
    if span is None:
        return out, lse, None
    _warn(kernel)
    exact = ReferenceKernel().forward(q[:, :, span[0]:span[1]], k, v, q_seg.slice(*span), kv_seg, mods, scale, masked)
    res = torch.zeros_like(lse)
    for into, value in zip((out, lse, res), exact):
        into[:, :, span[0]:span[1]] = value
    return out, lse, res


def exact_backward(kernel: str, may_be_huge: bool, backward: Callable[[Tensor], tuple], q, k, v, out, lse, dout,
                   q_seg, kv_seg, mods: Mods, scale: float, masked: bool, tensors, res: Optional[Tensor]) -> tuple:
    """A hop's gradients from a kernel's ``backward(lse)``: where the score_mod ``may_be_huge``,
    rows of a huge (finite) global LSE are left out of it (an LSE of +inf gives them
    probabilities 0) and computed by the reference kernel, with the LSE's res, instead."""
    if not may_be_huge:  # no pass over the LSE at all: most calls
        return backward(lse)
    huge = (lse.abs() >= HUGE) & lse.isfinite()
    span = _span(huge)
    if span is None:
        return backward(lse)
    _warn(kernel)
    grads = backward(torch.where(huge, math.inf, lse))
    only_huge = torch.where(huge, lse, math.inf)[:, :, span[0]:span[1]]
    exact = ReferenceKernel().backward(q[:, :, span[0]:span[1]], k, v, out[:, :, span[0]:span[1]], only_huge,
                                       dout[:, :, span[0]:span[1]], q_seg.slice(*span), kv_seg, mods, scale, masked,
                                       tensors, None if res is None else res[:, :, span[0]:span[1]])
    for i, (grad, value) in enumerate(zip(grads, exact)):
        into = grad[:, :, span[0]:span[1]] if i == 0 else grad  # dq of the span's rows; dk, dv, tensors whole
        into.copy_(into.to(value.dtype) + value)  # added in the reference's precision, rounded once
    return grads
