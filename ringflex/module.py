"""Make an existing model context-parallel without touching its code.

``RingFlexMode`` is a ``TorchFunctionMode``: while it is active, the attention calls made by
the model -- ``torch.nn.functional.scaled_dot_product_attention`` and
``torch.nn.attention.flex_attention.flex_attention`` -- run as ``ring_flex_attention`` on the
given process group and layout. ``RingFlexAttention`` is the ``nn.Module`` form: it wraps an
attention module or a whole model and activates the mode around its forward.

How the calls are found:

- SDPA is a torch function, so the mode sees it directly. So is ``nn.MultiheadAttention``'s
  ``F.multi_head_attention_forward``, whose projections the mode computes around the ring
  (torch's fused fast paths step aside while a mode is active).
- ``flex_attention`` is a plain Python function. While a mode is active, every module global
  that holds torch's ``flex_attention`` or ``torch.compile(flex_attention)`` (the attribute of
  ``torch.nn.attention.flex_attention`` and names bound by ``from ... import flex_attention``
  or ``flex_attention = torch.compile(flex_attention)`` in any module) is replaced by a stand-in
  that hands the call to the mode. The patch is process-wide but harmless: outside a mode (in
  any thread) a stand-in calls the function it replaced, and the last mode to exit restores them.

Limits: a reference the patch cannot see (an attribute, closure, default argument or local
variable holding the function) still reaches torch's flex_attention, which the mode then refuses with an error
naming the cause. ``torch.compile(RingFlexAttention(model))`` compiles the model inside the
mode: the wrapper's own frame runs eagerly, so the names are replaced before dynamo traces the
model. A mode entered inside compiled code is traced without replacing them, and refused.
Activation checkpointing recomputes outside the wrapper's forward, so wrap the attention
modules themselves (the recompute then runs the wrapper again).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import flex_attention as _flex
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from . import mods, training
from .parallel import mesh as meshes
from .api import reject, ring_flex_attention
from .config import warn_once
from .kernels import BACKENDS
from .plan.layout import check_layout, or_default

_TORCH_FLEX = _flex.flex_attention
_FLEX_SIGNATURE = inspect.signature(_TORCH_FLEX)
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
# Attention torch computes over the tensors it is given: under the mode, this rank's tokens
# alone. Only code that calls these itself reaches them (torch's modules take SDPA or
# F.multi_head_attention_forward while a mode is active); the mode refuses them.
_LOCAL_ATTENTION = set(
    [getattr(torch.ops.aten, name) for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward", "_efficient_attention_forward", "_cudnn_attention_forward")
     if hasattr(torch.ops.aten, name)]
    + [getattr(torch, name) for name in ("_native_multi_head_attention", "_transformer_encoder_layer_fwd")
       if hasattr(torch, name)])
_FLEX_HOP = getattr(torch.ops.higher_order, "flex_attention", None)


def _refuse_torch_varlen() -> None:
    """Adds torch's ``varlen_attn`` op to ``_LOCAL_ATTENTION`` once its module has registered
    it: importing that module here would slow every ``import ringflex``."""
    if "torch.nn.attention.varlen" in sys.modules and hasattr(torch.ops.torch_attn, "_varlen_attn"):
        _LOCAL_ATTENTION.add(torch.ops.torch_attn._varlen_attn)


def _stand_in(original):
    """Calls ``original`` (torch's flex_attention, or a compiled one) unless a mode is active."""
    def routed_flex_attention(query, key, value, *args, **kwargs):
        if has_torch_function((query, key, value)):  # every stand-in reaches the mode as ``flex_attention``
            return handle_torch_function(flex_attention, (query, key, value), query, key, value, *args, **kwargs)
        return original(query, key, value, *args, **kwargs)
    routed_flex_attention.__doc__ = "torch's ``flex_attention``, routed to the innermost active ``RingFlexMode`` if any."
    return routed_flex_attention


flex_attention = _stand_in(_TORCH_FLEX)


def _is_torch_flex(value) -> bool:
    """torch's flex_attention itself, or ``torch.compile`` of it."""
    if value is _TORCH_FLEX:
        return True
    return type(value) is types.FunctionType and value.__dict__.get("_torchdynamo_orig_callable") is _TORCH_FLEX


def attention(query, key, value, *, score_mod=None, mask_mod=None, scale=None, enable_gqa=False, sinks=None,
              error: Optional[str] = None):
    """Attention over the sharded sequence of the active ``RingFlexMode`` (its group, layout,
    backend and extra mask). For integrations that call attention directly (Hugging Face).
    ``error``: the call cannot be routed; it raises on every rank of the mode's group, as a
    bad ring call does (it may be refused on one rank only: a padding mask of its tokens)."""
    if has_torch_function((query, key, value)):
        return handle_torch_function(attention, (query, key, value), query, key, value, score_mod=score_mod,
                                     mask_mod=mask_mod, scale=scale, enable_gqa=enable_gqa, sinks=sinks, error=error)
    if torch._C._current_graph_task_id() != -1:  # inside a backward: a checkpointed layer's recompute
        raise RuntimeError("ringflex attention was called outside RingFlexAttention / RingFlexMode during backward: "
                           "activation checkpointing recomputes a layer there, outside the wrapper (transformers' "
                           "activation_checkpointing_enable / gradient_checkpointing_enable do); wrap each "
                           "checkpointed layer instead: RingFlexAttention(layer, group=..., checkpoint=True)")
    raise RuntimeError("ringflex attention was called outside RingFlexAttention / RingFlexMode: wrap the model "
                       "(RingFlexAttention(model, group=...)) or run it inside `with RingFlexMode(group=...)`")


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return attn_mask, dropout_p, is_causal, scale, enable_gqa


class _FlexPatch:
    """Replaces module globals that hold torch's flex_attention while any mode is active."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._holders = []  # (module dict, name, original) found by the last scan
        self._scanned_modules = -1  # len(sys.modules) at that scan: rescan after new imports
        self._stand_ins = {}  # id(original) -> (original, its stand-in)

    def _scan(self):
        if len(sys.modules) != self._scanned_modules:
            self._scanned_modules = len(sys.modules)
            found = {}
            for namespace in _namespaces():
                for name, value in list(namespace.items()):
                    if _is_torch_flex(value):
                        found[id(namespace), name] = (namespace, name, value)
            self._holders = list(found.values())
        return self._holders

    def _stand_in_for(self, original):
        if original is _TORCH_FLEX:
            return flex_attention
        entry = self._stand_ins.get(id(original))
        if entry is None or entry[0] is not original:
            entry = self._stand_ins[id(original)] = (original, _stand_in(original))
        return entry[1]

    def acquire(self):
        with self._lock:
            if self._users == 0:
                for namespace, name, original in self._scan():
                    if namespace.get(name) is original:
                        namespace[name] = self._stand_in_for(original)
            self._users += 1

    def release(self):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for namespace, name, original in self._holders:
                    if namespace.get(name) is self._stand_in_for(original):
                        namespace[name] = original


def _namespaces():
    """The globals of every module but this one (it keeps the original), and the globals its
    functions were defined in where those differ: a script that multiprocessing's spawn (or
    forkserver) runs as ``__mp_main__`` leaves its functions the dict runpy ran it in."""
    seen = {id(globals())}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        defined_in = [v.__globals__ for v in list(namespace.values())
                      if type(v) is types.FunctionType and v.__globals__ is not namespace]
        for candidate in [namespace, *defined_in]:
            if id(candidate) not in seen:
                seen.add(id(candidate))
                yield candidate


_PATCH = _FlexPatch()
_ENTERED = threading.local()


def _entered() -> List["RingFlexMode"]:
    """The RingFlexModes this thread is inside, outermost first."""
    if not hasattr(_ENTERED, "modes"):
        _ENTERED.modes = []
    return _ENTERED.modes


def current_mode() -> Optional["RingFlexMode"]:
    """The innermost ``RingFlexMode`` this thread is inside (the one its attention calls reach), or None."""
    return _entered()[-1] if _entered() else None


def _enclosing_mask(mode: "RingFlexMode") -> Optional[Callable]:
    """What the modes this thread is inside add to ``mode``'s calls: the extra mask of the
    innermost, where it runs on the same ring and layout (another ring's positions are not
    this one's)."""
    enclosing = _entered()[-1] if _entered() else None
    if enclosing is None or ((meshes.ring_key(enclosing.group), or_default(enclosing.layout))
                             != (meshes.ring_key(mode.group), or_default(mode.layout))):
        return None
    return enclosing.extra_mask()


class _MaskCombiner:
    """``and_masks(call_mask, extra)``, remembered so the planner sees the same object each step."""

    def __init__(self, size: int = 16):
        self.size = size
        self.entries = {}

    def __call__(self, call_mask: Optional[Callable], extra: Optional[Callable]) -> Optional[Callable]:
        if call_mask is None or extra is None:
            return call_mask if extra is None else extra
        key = (id(call_mask), id(extra))
        entry = self.entries.get(key)
        if entry is None or entry[0] is not call_mask or entry[1] is not extra:
            if len(self.entries) >= self.size:
                self.entries.pop(next(iter(self.entries)))
            entry = self.entries[key] = (call_mask, extra, mods.and_masks(call_mask, extra))
        return entry[2]


def _mask_from_block_mask(block_mask, q_len: int, kv_len: int, world_size: int) -> Optional[Callable]:
    """The mask_mod behind a BlockMask, which ringflex evaluates at global positions."""
    if not isinstance(block_mask, _flex.BlockMask):
        raise TypeError(f"flex_attention: block_mask must be a BlockMask or None, got {type(block_mask).__name__}")
    lengths = tuple(block_mask.seq_lengths)
    if lengths not in ((q_len, kv_len), (q_len * world_size, kv_len * world_size)):
        raise ValueError(
            f"flex_attention: block_mask was built for lengths {lengths}, but this rank holds {q_len} query and "
            f"{kv_len} key tokens of {q_len * world_size} and {kv_len * world_size}: build it for either")
    mask_mod = block_mask.mask_mod
    if mask_mod is getattr(_flex, "_sliced_mask_mod_error", object()):
        raise ValueError("flex_attention: a sliced BlockMask has no mask_mod; pass the unsliced one")
    if mask_mod is _flex.noop_mask:
        if bool(block_mask.to_dense().all()):
            return None
        raise ValueError(
            "flex_attention: this BlockMask has no mask_mod (it was built from block indices), so its sparsity "
            "cannot be evaluated at global positions; build it with create_block_mask(mask_mod, ...)")
    return mask_mod


class RingFlexMode(TorchFunctionMode):
    """While active, SDPA and flex_attention calls run as ring attention over ``group`` (as
    ``ring_flex_attention`` takes it: a heads x ring DeviceMesh too).

    Every q/k/v that reaches attention must be this rank's shard of the sequence in ``layout``
    (see ``ringflex.shard``; None, the default: zigzag, and the calls may re-shard inside as
    ``ring_flex_attention``'s do); every rank must make the same calls. ``mask_mod`` (optional) is
    ANDed onto every call's mask -- the document mask of a packed batch, for a model that only
    knows ``is_causal`` -- and so are those of the modes it is entered inside on the same ring
    and layout (a wrapped block inside a wrapped model). Calls that cannot be routed exactly raise instead of computing
    something else: a dense ``attn_mask``, ``dropout_p > 0``, a BlockMask without mask_mod,
    ``nn.MultiheadAttention`` asked for its attention weights.
    """

    def __init__(self, group=None, layout=None, backend: str = "auto", mask_mod: Optional[Callable] = None):
        super().__init__()
        if layout is not None:
            check_layout(layout)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable or None, got {type(mask_mod).__name__}")
        self.group, self.layout, self.backend, self.mask_mod = meshes.group_or_mesh(group), layout, backend, mask_mod
        self._combine = _MaskCombiner()
        self._outer: List[Optional[Callable]] = []  # per entry: the extra mask of the modes around it

    def __enter__(self):
        outer = _enclosing_mask(self)
        _refuse_torch_varlen()
        _PATCH.acquire()
        try:
            entered = super().__enter__()
        except BaseException:
            _PATCH.release()
            raise
        self._outer.append(outer)
        _entered().append(self)
        return entered

    def __exit__(self, *exc):
        _entered().pop()
        self._outer.pop()
        try:
            return super().__exit__(*exc)
        finally:
            _PATCH.release()

    def extra_mask(self) -> Optional[Callable]:
        """The mask this mode ANDs onto every call: its ``mask_mod`` and those of the modes it
        was entered inside on the same ring and layout (a wrapped block inside a wrapped model)."""
        return self._combine(self.mask_mod, self._outer[-1] if self._outer else None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            return self._multi_head(*args, **kwargs)
        if func is flex_attention:
            return self._flex(*args, **kwargs)
        if func is attention:
            error = kwargs.pop("error", None)
            if error is not None:
                self._refuse(error)
            return self._ring(*args, **kwargs)
        if _FLEX_HOP is not None and func is _FLEX_HOP:
            raise RuntimeError(
                "RingFlexMode: torch's flex_attention was reached through a reference ringflex could not replace "
                "(the function kept in an attribute, closure, default argument or local variable): call it through a "
                "module-level name (torch.nn.attention.flex_attention.flex_attention, or a name imported or compiled "
                "from it); "
                "or the mode was entered inside torch.compile'd code, which traces its entry without replacing "
                "the names: enter it outside, or compile the model inside RingFlexAttention")
        if getattr(func, "overloadpacket", func) in _LOCAL_ATTENTION:
            raise RuntimeError(f"RingFlexMode: {func} computes attention over this rank's tokens alone, and ringflex "
                               "cannot route it: call F.scaled_dot_product_attention, flex_attention or (for packed "
                               "sequences) ringflex.varlen_attention instead")
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def _running(self, mask_mod: Optional[Callable], outer: Optional[Callable], layout):
        """Inside: ``mask_mod`` as this entered mode's own mask, ``outer`` as what the modes around
        it add (a checkpoint's recompute runs outside them) and ``layout`` as its layout; the
        mode's own after."""
        kept = self.mask_mod, self._outer[-1], self.layout
        self.mask_mod, self._outer[-1], self.layout = mask_mod, outer, layout
        try:
            yield
        finally:
            self.mask_mod, self._outer[-1], self.layout = kept

    def _refuse(self, error: str):
        """Raises ``error`` on every rank: a call may be refused on one rank only (a model that
        reads its positions, which differ per rank), while the others' calls wait in the ring."""
        reject(error, self.group)

    # Eager even inside compiled code: plans are cached by mod object, and dynamo, tracing the
    # combination of masks, handed the ring a new object at every call (or failed inside).
    @torch.compiler.disable
    def _ring(self, query, key, value, *, score_mod=None, mask_mod=None, scale=None, enable_gqa=False,
              return_lse=False, sinks=None):
        device_type = query.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if autocast:  # as SDPA does under autocast: run in the autocast dtype, kernels unchanged (fp64 stays)
            dtype = torch.get_autocast_dtype(device_type)
            query, key, value = (t if t.dtype == torch.float64 else t.to(dtype) for t in (query, key, value))
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            return ring_flex_attention(query, key, value, score_mod=score_mod,
                                       mask_mod=self._combine(mask_mod, self.extra_mask()), group=self.group,
                                       layout=self.layout, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                       backend=self.backend, sinks=sinks)

    def _sdpa(self, query, key, value, *args, **kwargs):
        attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(query, key, value, *args, **kwargs)
        if attn_mask is not None:
            self._refuse(
                "scaled_dot_product_attention: RingFlexMode cannot route a dense attn_mask (it describes local, not "
                "global, positions); express the mask as a mask_mod: flex_attention with "
                "create_block_mask(mask_mod, ...), or RingFlexMode(mask_mod=...) with is_causal; a Hugging Face "
                "model: load it with attn_implementation=\"ringflex\" (ringflex.integrations.hf.register())")
        if dropout_p:
            self._refuse(f"scaled_dot_product_attention: RingFlexMode does not support dropout, got "
                         f"dropout_p={dropout_p}; pass dropout_p=0.0 (e.g. put the model in eval mode)")
        return self._ring(query, key, value, mask_mod=mods.causal if is_causal else None, scale=scale,
                          enable_gqa=enable_gqa)

    def _multi_head(self, *args, **kwargs):
        """``nn.MultiheadAttention`` (through ``F.multi_head_attention_forward``, which torch
        would run here without the mode, over this rank's tokens alone): its projections as
        torch computes them, its attention as a ring. What needs the whole attention matrix or
        local positions raises, as does dropout in training."""
        a = _MHA_SIGNATURE.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        refused = [
            (a["need_weights"], "need_weights=True (the whole attention matrix, which a ring never forms): "
                                "call it with need_weights=False"),
            (a["key_padding_mask"] is not None, "a key_padding_mask (local positions): pack the sequences instead "
                                                "(ringflex.PackedSequences)"),
            (a["is_causal"] and a["attn_mask"] is None, "is_causal=True without an attn_mask, which torch refuses "
                                                       "too: pass the causal mask with the hint"),
            (a["attn_mask"] is not None and not a["is_causal"],
             "a dense attn_mask (local positions): for a causal mask pass is_causal=True with it, else give "
             "RingFlexAttention a mask_mod"),
            (any(a[name] is not None for name in ("bias_k", "bias_v", "static_k", "static_v")) or a["add_zero_attn"],
             "bias_k / bias_v, add_zero_attn or static_k / static_v (keys beside the sequence)"),
            (a["training"] and a["dropout_p"] > 0, f"dropout in training (dropout={a['dropout_p']}): set it to 0 or "
                                                   "use eval mode"),
        ]
        for is_refused, why in refused:
            if is_refused:
                self._refuse(f"nn.MultiheadAttention: RingFlexMode cannot route {why}")
        inputs = [a[name] for name in ("query", "key", "value")]
        unbatched = inputs[0].dim() == 2
        if unbatched:
            inputs = [x.unsqueeze(1) for x in inputs]
        if a["use_separate_proj_weight"]:
            weights = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
        else:
            weights = a["in_proj_weight"].chunk(3)
        biases = a["in_proj_bias"].chunk(3) if a["in_proj_bias"] is not None else (None,) * 3
        # [L, N, E] -> [N, heads, L, E / heads], as SDPA takes them
        q, k, v = (F.linear(x, w, b).unflatten(-1, (a["num_heads"], -1)).permute(1, 2, 0, 3)
                   for x, w, b in zip(inputs, weights, biases))
        out = self._ring(q, k, v, mask_mod=mods.causal if a["is_causal"] else None)
        out = F.linear(out.permute(2, 0, 1, 3).flatten(2), a["out_proj_weight"], a["out_proj_bias"])
        return out.squeeze(1) if unbatched else out, None

    def _flex(self, query, key, value, *args, **kwargs):
        bound = _FLEX_SIGNATURE.bind(query, key, value, *args, **kwargs).arguments
        block_mask = bound.get("block_mask")
        try:
            mask_mod = None if block_mask is None else _mask_from_block_mask(
                block_mask, query.shape[-2], key.shape[-2], meshes.world_size(self.group))
        except (TypeError, ValueError) as e:
            self._refuse(str(e))
        return_aux = bound.get("return_aux")
        if return_aux is not None and bound.get("return_lse"):  # as torch's flex_attention
            self._refuse("flex_attention: cannot specify both return_lse and return_aux")
        if return_aux is not None and getattr(return_aux, "max_scores", False):
            self._refuse("flex_attention: RingFlexMode cannot return max_scores; request AuxRequest(lse=True) only")
        want_lse = bool(bound.get("return_lse")) or (return_aux is not None and return_aux.lse)
        result = self._ring(query, key, value, score_mod=bound.get("score_mod"), mask_mod=mask_mod,
                            scale=bound.get("scale"), enable_gqa=bool(bound.get("enable_gqa")), return_lse=want_lse)
        if return_aux is not None:
            out, lse = result if want_lse else (result, None)
            return out, _flex.AuxOutput(lse=lse, max_scores=None)
        return result


class RingFlexAttention(nn.Module):
    """Wraps an attention module or a whole model: its forward runs inside a ``RingFlexMode``.

    ``RingFlexAttention(model, group=g)(*inputs)`` computes what ``model``
    computes on one device, given this rank's shards of the inputs (and the global position
    ids, for RoPE). ``mask_mod`` and ``layout`` may be changed between steps: new packed
    documents, and the sharding chosen for them (``PackedSequences(...).layout``).
    ``checkpoint=True``: activation checkpointing of ``module`` (torch's, non-reentrant), whose
    recompute runs in the ring too, with the ``mask_mod`` and ``layout`` of its forward. A
    checkpoint taken inside ``module`` recomputes with those set when backward runs
    (docs/guide.md, "Wrapping a model").

    A Hugging Face style model (its forward takes ``position_ids`` and ``input_ids`` or
    ``inputs_embeds``) called without ``position_ids`` gets the global position ids of this
    rank's tokens (``ringflex.training.position_ids`` on the wrapper's group and layout; a
    model would otherwise number its local tokens from 0). Its cache is refused: a call with
    ``use_cache=True`` or ``past_key_values`` raises ``CallRejected`` on every rank (the cache
    would hold this rank's keys and values only); a call that leaves ``use_cache`` to a
    config that turns it on runs with ``use_cache=False`` and warns once.
    """

    def __init__(self, module: nn.Module, *, group=None, layout=None, backend: str = "auto",
                 mask_mod: Optional[Callable] = None, checkpoint: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module, self.checkpoint = module, bool(checkpoint)
        self.mode = RingFlexMode(group=group, layout=layout, backend=backend, mask_mod=mask_mod)
        self._signature = _hf_signature(module)

    @property
    def mask_mod(self) -> Optional[Callable]:
        return self.mode.mask_mod

    @mask_mod.setter
    def mask_mod(self, mask_mod: Optional[Callable]) -> None:
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable or None, got {type(mask_mod).__name__}")
        self.mode.mask_mod = mask_mod

    @property
    def layout(self):
        """The layout of the shards this rank is given (None: zigzag, as ``shard``'s default)."""
        return self.mode.layout

    @layout.setter
    def layout(self, layout) -> None:
        self.mode.layout = None if layout is None else check_layout(layout)

    @functools.partial(torch.compiler.disable, recursive=False)  # the model's frames still compile
    def forward(self, *args, **kwargs):
        if self._signature is not None:
            args, kwargs = self._hf_call(args, kwargs)
        elif any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
            warn_once("ringflex: a Hugging Face cache reached a module wrapped by RingFlexAttention: it holds only "
                       "this rank's keys and values, so it cannot continue the sequence (ringflex does not decode); "
                       "call the model with use_cache=False, or wrap the whole model, which turns the cache off")
        step = self.mode.mask_mod, _enclosing_mask(self.mode), self.mode.layout
        if self.checkpoint and torch.is_grad_enabled():  # inputs: the recompute gets the forward's again
            return torch.utils.checkpoint.checkpoint(self._run, *step, args, kwargs, use_reentrant=False)
        return self._run(*step, args, kwargs)

    @functools.partial(torch.compiler.disable, recursive=False)  # as forward: the mode enters eagerly
    def _run(self, mask_mod: Optional[Callable], outer: Optional[Callable], layout, args, kwargs):
        with self.mode, self.mode._running(mask_mod, outer, layout):
            return self.module(*args, **kwargs)

    def _hf_call(self, args, kwargs):
        """A Hugging Face style model's arguments with the global position ids of this rank's
        tokens where it was given none, and its cache off where its config turned it on; a
        cache it was asked for, or positions it cannot size, refused on every rank."""
        try:
            bound = self._signature.bind_partial(*args, **kwargs)
        except TypeError:
            return args, kwargs  # the model raises its own error
        arguments = bound.arguments
        extra = next((arguments.get(p.name, {}) for p in self._signature.parameters.values()
                      if p.kind is inspect.Parameter.VAR_KEYWORD), {})

        def given(name):
            return arguments[name] if arguments.get(name) is not None else extra.get(name)

        cache = next((name for name in _CACHE_ARGUMENTS if given(name) is not None), None)
        if cache is not None:
            self.mode._refuse(f"RingFlexAttention: the model was called with {cache}: a Hugging Face cache holds "
                              "earlier keys and values of this rank only, and ring attention does not decode from it; "
                              "call the model without a cache (use_cache=False)")
        if given("use_cache"):
            self.mode._refuse("RingFlexAttention: the model was called with use_cache=True: its cache would hold only "
                              "this rank's keys and values (ring attention does not decode); pass use_cache=False")
        if "use_cache" in self._signature.parameters and given("use_cache") is None \
                and getattr(getattr(self.module, "config", None), "use_cache", False):
            warn_once("ringflex: RingFlexAttention runs the model with use_cache=False (its config turns the cache "
                       "on): a cache would hold only this rank's keys and values; pass use_cache=False, or set "
                       "model.config.use_cache = False, to silence this")
            arguments["use_cache"] = False
        if given("position_ids") is None:
            tokens = given("input_ids")
            embeds = given("inputs_embeds")
            local = tokens.shape[-1] if isinstance(tokens, torch.Tensor) and tokens.dim() in (1, 2) else \
                embeds.shape[-2] if isinstance(embeds, torch.Tensor) and embeds.dim() in (2, 3) else None
            if local is None:
                self.mode._refuse(
                    "RingFlexAttention: the model was called without position_ids, and ringflex cannot tell the "
                    "length of this rank's sequence (no input_ids [B, S_local] or inputs_embeds [B, S_local, D]) to "
                    "number its tokens at their global positions; pass position_ids="
                    "ringflex.training.position_ids(seq_len, group=..., layout=...)")
            source, batched = (tokens, tokens.dim() == 2) if isinstance(tokens, torch.Tensor) else \
                (embeds, embeds.dim() == 3)
            positions = training.position_ids(local * meshes.world_size(self.mode.group), group=self.mode.group,
                                              layout=self.mode.layout, device=source.device)
            arguments["position_ids"] = positions.expand(source.shape[0], -1) if batched else positions
        return bound.args, bound.kwargs


# The arguments by which Hugging Face models take a cache (transformers 4.x, 5.x).
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache")


def _hf_signature(module: nn.Module) -> Optional[inspect.Signature]:
    """The signature of a Hugging Face style model's forward (it takes ``position_ids`` and
    ``input_ids`` or ``inputs_embeds``), or None."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    names = signature.parameters
    return signature if "position_ids" in names and ("input_ids" in names or "inputs_embeds" in names) else None
