"""The flex_attention hop kernel: torch's own fused kernels, generated from the mods, for
what cuDNN cannot run on a GPU.

cuDNN's graphs take mods built from a fixed set of ops on positions and tables indexed by
one position (``kernels.cudnn``). A mod that gathers from a table indexed by a difference of
positions (a relative-position bias), a tensor that requires grad (a learnable bias),
fp32 inputs: these run here, as Triton kernels that ``torch.compile`` generates from the
mod itself, instead of on the reference kernel, which materialises every hop's scores.

- Positions reach the mods as 0-dim tensors (``_positions``), so a new hop offset is a new
  input value, not a recompilation.
- The block mask's tiles come from ringflex's own tile classifier (``plan.block_kinds``:
  bounded memory, every batch and head at once), kept per mask and block (``MaskCache``):
  empty tiles are skipped, full ones run without the mask.
- Backward: flex_attention differentiates its own output and LSE, while a hop's backward
  is given the GLOBAL ones (``base.HopKernel.backward``). The hop's forward is recomputed
  and its (out_i, lse_i) take the gradients the merge gives them: with
  w = exp(lse_i - lse), dout_i = w * dout and dlse_i = w * <dout, out_i - out>, which makes
  dS = P (dout . v - <dout, out>) with P under the global LSE. One extra forward per hop.
- A hop whose kernels torch fails to compile (torch 2.11 did at some small, odd hop lengths:
  docs/reliability.md) runs on the reference kernel instead, which says so once: raising
  would break the ring for every rank (``parallel.fault``).
"""
from __future__ import annotations

import inspect
import types
from collections import OrderedDict
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..cache import remember
from ..config import warn_once
from ..mod.graph import UnsupportedModError
from ..mod.trace import trace_mask_mod
from ..plan.blocks import BlockKind, MaskCache, block_kinds
from ..plan.layout import Segment
from . import huge
from .base import Mods, OneCallPerHop
from .reference import ReferenceKernel, compute_dtype

FLEX_TILE = 128  # flex_attention's tile (its BLOCK_SIZE): the mask is classified per tile
_BLOCK_MASKS = MaskCache(size=256)
_POSITIONS: "OrderedDict[tuple, Tuple[Tensor, Tensor, Tensor]]" = OrderedDict()


def flex_unavailable_reason(q: Tensor) -> Optional[str]:
    """Why the flex kernel cannot run a call on ``q``'s device, or None if it can."""
    if not q.is_cuda:
        return "inputs are not on a CUDA device (torch's flex_attention has no backward on CPU)"
    from torch.utils._triton import has_triton
    if not has_triton():
        return "Triton is not installed (torch.compile generates flex_attention's kernels with it)"
    return None


# Gradients of tensors the score_mod reads take shared memory in flex_attention's backward:
# with its default pipeline a head dim of 128 needs a little more than a GPU's 227 KiB per SM.
TENSOR_GRAD_OPTIONS = {"bwd_num_stages": 1}
# Pipeline depths tried in turn when a compilation runs out of shared memory: torch's default
# (None), then shallower ones: torch's default tiles for bf16 at head dim 64 (128 x 128, 3
# stages) need more than a GPU's 227 KiB per SM under a relative-position gather.
STAGES = (None, 2, 1)
_FITTING_STAGES = {}  # (pass, mod codes, dtype, head dim, device) -> the depth that fits
_UNCOMPILED = set()  # (the same, the shapes of q and k): hops torch failed to compile kernels for


def _compile_failure(error: Exception) -> bool:
    """Whether ``error`` is torch failing to compile flex_attention's kernels (Inductor's),
    not a mod that raised (which the reference kernel would raise too)."""
    from torch._dynamo.exc import BackendCompilerFailed
    return isinstance(error, BackendCompilerFailed)


def _with_stages(options: Optional[dict], stages: Optional[int]) -> Optional[dict]:
    if stages is None:
        return options
    options = dict(options or {})
    for name in ("fwd_num_stages", "bwd_num_stages"):
        options[name] = min(options.get(name, stages), stages)
    return options


def _flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options=None):
    from torch.nn.attention import flex_attention as flex
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                  kernel_options=kernel_options)
    if "return_aux" in inspect.signature(flex.flex_attention).parameters:
        out, aux = flex.flex_attention(q, k, v, **kwargs, return_aux=flex.AuxRequest(lse=True))
        return out, aux.lse
    return flex.flex_attention(q, k, v, **kwargs, return_lse=True)


# - Floats a mod captures (a softcap's cap) stay constants: traced as symbolic inputs, they
#   failed flex_attention's lowering (torch 2.11). Lengths still turn dynamic after the
#   first new shape, so hops of any length share the compiled kernels.
# - Every head dim and grad mode (forward, and the backward's recompute) is a compilation: a
#   higher limit than torch's 8, and an error instead of torch's fallback past it, which runs
#   flex_attention uncompiled, materializing every score.
_COMPILE_CONFIG = dict(specialize_float=True, recompile_limit=64, fail_on_recompile_limit_hit=True)
_COMPILED: "OrderedDict[tuple, Callable]" = OrderedDict()


def _code(mod) -> object:
    mod = getattr(mod, "user_mod", mod)  # the user's mod inside ringflex's position wrapper
    return getattr(mod, "__code__", type(mod))


def compiled_flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa,
                            kernel_options=None) -> Tuple[Tensor, Tensor]:
    """(out, natural-log LSE) of torch's flex_attention, compiled.

    torch keeps compiled graphs per code object. With one function for every mod, switching
    from a mod that captures a table to a softcap failed inside torch's own recompilation
    check (an IndexError in torch 2.11's aliasing-guard reason): each pair of mod codes
    gets a function of its own (a copy of the code object), so its graphs only ever see
    closures of one shape."""
    family = (_code(score_mod), _code(block_mask.mask_mod) if block_mask is not None else None)
    compiled = _COMPILED.get(family)
    if compiled is None:
        code = _flex_attention.__code__.replace(co_name=f"_flex_attention_{len(_COMPILED)}")
        function = types.FunctionType(code, _flex_attention.__globals__, code.co_name, _flex_attention.__defaults__)
        compiled = remember(_COMPILED, family, torch.compile(function), 64)
    with torch._dynamo.config.patch(**_COMPILE_CONFIG):
        return compiled(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options)


def _positions(seg: Segment, side: str, device) -> Tuple[Tensor, Tensor, Tensor]:
    """(start, stride, last local index) of ``seg`` as 0-dim int32 tensors on ``device``.

    The query and key sides never share tensors, even where their segments are equal (a
    rank's own block): tensors aliased in one call and not in the next are a recompilation."""
    key = (side, seg.start, seg.stride, seg.length, str(device))
    if key not in _POSITIONS:
        values = torch.tensor([seg.start, seg.stride, seg.length - 1], dtype=torch.int32, device=device)
        remember(_POSITIONS, key, tuple(values.unbind()), 1024)
    return _POSITIONS[key]


def _global_index(seg: Segment, side: str, device) -> Callable[[Tensor], Tensor]:
    """Local index -> global position. flex_attention also evaluates the mods past the end of
    a block (its last tile's padding): those indices are clamped, so a lookup in a table of
    the global sequence's length stays inside it."""
    start, stride, last = _positions(seg, side, device)
    return lambda i: start + stride * torch.minimum(i, last)


def _score_mod(mods: Mods, q_seg: Segment, kv_seg: Segment, device):
    """The user's score_mod at the hop's global positions. flex_attention tells a score_mod
    from a mask_mod by its number of parameters, so each gets a closure of its own signature."""
    q_pos, kv_pos = _global_index(q_seg, "q", device), _global_index(kv_seg, "kv", device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return mods.score_mod(score, b, h, q_pos(q_idx), kv_pos(kv_idx))
    score_mod.user_mod = mods.score_mod
    return score_mod


def _mask_mod(mods: Mods, q_seg: Segment, kv_seg: Segment, device):
    """The user's mask_mod at the hop's global positions (see ``_score_mod``)."""
    q_pos, kv_pos = _global_index(q_seg, "q", device), _global_index(kv_seg, "kv", device)

    def mask_mod(b, h, q_idx, kv_idx):
        return mods.mask_mod(b, h, q_pos(q_idx), kv_pos(kv_idx))
    mask_mod.user_mod = mods.mask_mod
    return mask_mod


def _ordered(tiles: Tensor) -> Tuple[Tensor, Tensor]:
    """flex_attention's (counts [1, 1, nq], indices [1, 1, nq, nk]) of the True ``tiles``."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def _same_for_every_batch_and_head(mask_mod, device) -> bool:
    """Whether ``mask_mod`` reads neither b nor h (False where ringflex cannot trace it to tell):
    its tiles are then classified once for all, and the planner's and the block mask's are one."""
    try:
        return not trace_mask_mod(mask_mod, device).deps & {"b", "h"}
    except UnsupportedModError:
        return False


def _tile_kinds(mods: Mods, batch: int, heads: int, q_seg: Segment, kv_seg: Segment, tile: int, device) -> Tensor:
    key = ("tiles", batch, heads, q_seg, kv_seg, tile, str(device))
    return _BLOCK_MASKS.lookup(mods.mask_mod, key, lambda: block_kinds(
        mods.mask_mod, batch, heads, q_seg, kv_seg, tile, tile, device))


def _block_mask(mods: Mods, batch: int, heads: int, q_seg: Segment, kv_seg: Segment, tile: int, device):
    if _same_for_every_batch_and_head(mods.mask_mod, device):
        batch, heads = 1, 1

    def build():
        from torch.nn.attention.flex_attention import BlockMask
        kinds = _tile_kinds(mods, batch, heads, q_seg, kv_seg, tile, device)
        return BlockMask.from_kv_blocks(*_ordered(kinds == BlockKind.PARTIAL), *_ordered(kinds == BlockKind.FULL),
                                        BLOCK_SIZE=tile, mask_mod=_mask_mod(mods, q_seg, kv_seg, device),
                                        seq_lengths=(q_seg.length, kv_seg.length))
    key = ("block mask", batch, heads, q_seg, kv_seg, tile, str(device))
    return _BLOCK_MASKS.lookup(mods.mask_mod, key, build)


class FlexKernel(OneCallPerHop):
    """HopKernel on torch's flex_attention (see the module docstring).

    ``attend(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options) -> (out, lse)`` is the
    differentiable attention it calls: compiled flex_attention unless given (the CPU tests
    give a dense one with flex_attention's semantics: flex_attention has no CPU backward).
    """

    name = "flex"

    def __init__(self, attend: Callable = compiled_flex_attention, tile: int = FLEX_TILE):
        self.attend, self.tile = attend, tile

    def _fitting(self, run: Callable, uncompiled: Callable, phase: str, q: Tensor, k: Tensor, mods: Mods,
                 options: Optional[dict]):
        """``run(options)`` at the deepest pipeline (``STAGES``) whose kernels fit the GPU's
        shared memory for this pass, mods, dtype and head dim; saying once when it is shallower.
        ``uncompiled()`` where torch cannot compile the kernels for these shapes at all."""
        key = (phase, _code(mods.score_mod), _code(mods.mask_mod), q.dtype, q.shape[-1], str(q.device))
        shapes = (*key, tuple(q.shape), tuple(k.shape))
        if shapes in _UNCOMPILED:
            return uncompiled()
        for stages in STAGES[STAGES.index(_FITTING_STAGES.get(key)):]:
            try:
                result = run(_with_stages(options, stages))
            except Exception as error:  # torch wraps Triton's OutOfResources in its compiler's errors
                if stages != STAGES[-1] and "out of resource" in str(error):
                    warn_once(f"ringflex: flex_attention's {phase} kernels for this mod at {q.dtype}, head dim "
                              f"{q.shape[-1]} need more shared memory than the GPU has: compiling them "
                              f"with fewer pipeline stages (slower)")
                    continue
                if not _compile_failure(error):
                    raise
                _UNCOMPILED.add(shapes)
                warn_once(f"ringflex: torch could not compile flex_attention's {phase} kernels for hops of "
                          f"{q.shape[2]} x {k.shape[2]} tokens with this mod ({str(error).splitlines()[0][:200]}); "
                          f"they run on the reference kernel (exact, slower)")
                return uncompiled()
            _FITTING_STAGES[key] = stages
            return result

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # flex_attention returns dk/dv in the input dtype

    def call_pairs(self, batch: int, heads: int, head_dim: int) -> int:
        return 0  # not measured: lending weighs pairs alone

    def plans_within(self, mask_mod, has_score_mod: bool, q_seg: Segment, kv_seg: Segment, device):
        # The block mask skips empty tiles: a block stays one call, over the tiles' rows and
        # keys where the mask holds somewhere. Masks that differ by batch or head (or that
        # ringflex cannot trace to tell) are left to the planner's split.
        if not _same_for_every_batch_and_head(mask_mod, device):
            return None
        visible = _tile_kinds(Mods(None, mask_mod), 1, 1, q_seg, kv_seg, self.tile, device) != BlockKind.EMPTY
        rows, keys = visible.any(1).nonzero(), visible.any(0).nonzero()
        if rows.numel() == 0:
            return None
        (r0, r1), (c0, c1) = (int(rows[0]), int(rows[-1]) + 1), (int(keys[0]), int(keys[-1]) + 1)
        return ((r0 * self.tile, min(q_seg.length, r1 * self.tile)),
                (c0 * self.tile, min(kv_seg.length, c1 * self.tile)))

    def _attend(self, q, k, v, q_seg, kv_seg, mods: Mods, scale: float, masked: bool, kernel_options=None):
        score_mod = None if mods.score_mod is None else _score_mod(mods, q_seg, kv_seg, q.device)
        block_mask = None
        if masked and mods.mask_mod is not None:
            block_mask = _block_mask(mods, q.shape[0], q.shape[1], q_seg, kv_seg, self.tile, q.device)
        return self.attend(q, k, v, score_mod, block_mask, scale, q.shape[1] != k.shape[1], kernel_options)

    def forward(self, q, k, v, q_seg, kv_seg, mods: Mods, scale: float, masked: bool):
        def uncompiled():
            out, lse, _ = ReferenceKernel().forward(q, k, v, q_seg, kv_seg, mods, scale, masked)
            return out.to(q.dtype), lse.float()
        with torch.no_grad():
            out, lse = self._fitting(lambda options: self._attend(q, k, v, q_seg, kv_seg, mods, scale, masked, options),
                                     uncompiled, "forward", q, k, mods, None)
        # flex_attention's LSE is one float: rows whose scores are all huge go to the reference kernel
        return huge.exact_forward(self.name, huge.huge_terms(mods.score_mod, q.device), out, lse, q, k, v, q_seg,
                                  kv_seg, mods, scale, masked)

    def backward(self, q, k, v, out, lse, dout, q_seg, kv_seg, mods: Mods, scale: float, masked: bool, tensors=(),
                 res=None):
        # flex_attention's backward normalises by its own LSE, one float: rows whose scores are
        # all huge go to the reference kernel
        return huge.exact_backward(
            self.name, huge.huge_terms(mods.score_mod, q.device),
            lambda stats: self._backward(q, k, v, out, stats, dout, q_seg, kv_seg, mods, scale, masked, tensors, res),
            q, k, v, out, lse, dout, q_seg, kv_seg, mods, scale, masked, tensors, res)

    def _backward(self, q, k, v, out, lse, dout, q_seg, kv_seg, mods: Mods, scale: float, masked: bool, tensors, res):
        """The gradients, ``res`` read by the reference kernel alone: the rows left here are not
        huge, and their res is below fp32's precision of their lse."""
        dtype = compute_dtype(q.dtype)
        dout = dout.to(dtype)

        def gradients(options):
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                hop_out, hop_lse = self._attend(*inputs, q_seg, kv_seg, mods, scale, masked, options)
            # The merge's weight of this hop per row; 0 where the hop sees no key (lse_i -inf).
            weight = torch.where(hop_lse.isneginf(), 0.0, torch.exp(hop_lse.to(dtype) - lse.to(dtype)))
            d_out = (weight.unsqueeze(-1) * dout).to(hop_out.dtype)
            d_lse = (weight * (dout * (hop_out.to(dtype) - out.to(dtype))).sum(-1)).to(hop_lse.dtype)
            # An LSE computed from scores that ignore q and k (a score_mod that ignores the
            # score) may have no gradient: only outputs that have one are differentiated.
            outputs, upstream = zip(*((o, d) for o, d in ((hop_out, d_out), (hop_lse, d_lse)) if o.requires_grad))
            return torch.autograd.grad(outputs, (*inputs, *tensors), upstream, allow_unused=True, materialize_grads=True)

        def uncompiled():
            return ReferenceKernel().backward(q, k, v, out, lse, dout, q_seg, kv_seg, mods, scale, masked, tensors,
                                              res)
        grads = self._fitting(gradients, uncompiled, "backward", q, k, mods, TENSOR_GRAD_OPTIONS if tensors else None)
        return (*(g.to(t.dtype) for g, t in zip(grads[:3], (q, k, v))), *(g.to(dtype) for g in grads[3:]))
