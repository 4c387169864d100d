"""Hugging Face transformers: ``attn_implementation="ringflex"``.

    import ringflex.integrations.hf as rf_hf
    rf_hf.register()                                  # once per process
    model.set_attn_implementation("ringflex")         # or from_pretrained(..., attn_implementation="ringflex")
    model = ringflex.RingFlexAttention(model, group=group, layout="zigzag")
    logits = model(input_ids=local_ids, position_ids=local_positions).logits

The model sees this rank's tokens and their GLOBAL position ids (``ringflex.training``; the
wrapper passes them where the call gives none); each attention layer's causal / sliding-window /
chunked (Llama 4) mask and logit softcap become mods evaluated at global positions by
``ring_flex_attention`` on the wrapper's group and layout. Packed documents: set the
wrapper's ``mask_mod`` and ``layout`` to a batch's ``packed.mask_mod()`` and ``packed.layout``
(``PackedSequences``; restarting position ids alone are not read). Attention sinks (gpt-oss's
``s_aux``) are ``ring_flex_attention``'s ``sinks``. What cannot be routed raises: padding
masks, custom 4-D masks, masks with parts ringflex does not know (image tokens attending
bidirectionally), dropout, position biases, a cache (keys of earlier calls), and position ids
that number each rank's tokens from 0 (a model called without them inside ``RingFlexMode`` or
with only its layers wrapped).
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Optional

import torch
import torch.distributed as dist

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # the optional extra is missing
    raise ImportError(f"ringflex.integrations.hf needs transformers ({e}); pip install 'ringflex[hf]'") from e

from .. import mods, training
from ..module import attention, current_mode

__all__ = ["NAME", "register", "ringflex_attention_forward", "ringflex_mask", "LayerMask"]

NAME = "ringflex"

# One mod object per parameter, so the ring's planner classifies a layer's blocks once.
_sliding_window = functools.lru_cache(maxsize=None)(mods.sliding_window)
_softcap = functools.lru_cache(maxsize=None)(mods.softcap)
_and_masks = functools.lru_cache(maxsize=None)(mods.and_masks)
_or_masks = functools.lru_cache(maxsize=None)(mods.or_masks)


@functools.lru_cache(maxsize=None)
def _window_overlay(window: int):
    def window_overlay(b, h, q_idx, kv_idx):  # transformers' sliding_window_overlay
        return kv_idx > q_idx - window
    return window_overlay


@functools.lru_cache(maxsize=None)
def _chunks(size: int):
    def chunk_mask(b, h, q_idx, kv_idx):  # transformers' chunked_overlay without padding
        return q_idx // size == kv_idx // size
    return chunk_mask


class LayerMask:
    """What ``ringflex_mask`` hands a layer whose mask its attention call's arguments do not
    describe (Llama 4's chunked attention): the mask as a mod at global positions; or, where
    the mask cannot be routed, why (raised by the attention call, on every rank of the ring)."""

    def __init__(self, mask_mod=None, error: Optional[str] = None):
        self.mask_mod, self.error = mask_mod, error


def ringflex_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                               is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """The AttentionInterface function: q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D] ->
    ([B, S_local, Hq, D], None). Runs inside ``RingFlexAttention`` / ``RingFlexMode``. A call
    it cannot route raises on every rank (one rank's tokens may be padded, the others' not)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    error = _unroutable(attention_mask, dropout, kwargs.get("position_bias"), causal, sliding_window) \
        or _cached_keys(query, key, causal) or _local_positions(kwargs.get("position_ids"), query.shape[-2])
    if error is not None:
        attention(query, key, value, error=error)
    if isinstance(attention_mask, LayerMask):
        return _attend(query, key, value, attention_mask, None, softcap, scaling, kwargs.get("s_aux")), None
    return _attend(query, key, value, causal, sliding_window, softcap, scaling, kwargs.get("s_aux")), None


def _unroutable(attention_mask, dropout, position_bias, causal, sliding_window) -> Optional[str]:
    """Why an attention call cannot run as a ring, or None."""
    if isinstance(attention_mask, LayerMask):
        return attention_mask.error
    if attention_mask is not None:
        return ("ringflex attention got an attention_mask tensor: padding and custom masks describe local "
                "positions; pack sequences instead (ringflex.PackedSequences) and pass their mask_mod to "
                "RingFlexAttention")
    if dropout:
        return (f"ringflex attention does not support dropout (got {dropout}); set the config's attention dropout "
                "to 0 or use model.eval()")
    if position_bias is not None:
        return "ringflex attention cannot route position_bias"
    if sliding_window and not causal:
        return "ringflex attention supports sliding_window only for causal attention"
    return None


def _cached_keys(query, key, causal) -> Optional[str]:
    """Why a causal call with more keys than queries cannot run: the keys of a cache."""
    if causal and key.shape[-2] != query.shape[-2]:
        return (f"ringflex attention got {key.shape[-2]} keys for {query.shape[-2]} queries: a Hugging Face cache "
                "added keys of earlier calls, which hold this rank's tokens only (ring attention does not decode); "
                "call the model with use_cache=False and without past_key_values")
    return None


_CHECKED = threading.local()  # the last position ids checked: (weak reference, version, mode, error)


@torch.compiler.disable
def _local_positions(position_ids, length: int) -> Optional[str]:
    """Why ``position_ids`` [B, S_local] cannot be right: they number this rank's tokens from 0
    where the ring puts them elsewhere (a model that made them itself, from local lengths). Not
    checked under an extra mask (packed documents restart their positions) or while a CUDA
    graph captures; a tensor is checked once (every layer of a forward gets the same)."""
    mode = current_mode()
    if not isinstance(position_ids, torch.Tensor) or mode is None or position_ids.shape[-1] != length \
            or position_ids.is_floating_point() or mode.extra_mask() is not None:
        return None
    world_size = dist.get_world_size(mode.group) if dist.is_available() and dist.is_initialized() else 1
    if world_size == 1 or (position_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    last = getattr(_CHECKED, "last", None)
    if last is not None and last[0]() is position_ids and last[1:3] == (position_ids._version, mode):
        return last[3]
    local = torch.arange(length, device=position_ids.device)
    error = None
    if bool((position_ids == local).all()):
        ring = training.position_ids(length * world_size, group=mode.group, layout=mode.layout)
        if not torch.equal(ring, local.cpu()):
            error = ("ringflex attention: this rank's position_ids number its tokens from 0, but in the ring they sit "
                     f"at global positions (here {_span(ring)}): RoPE would see local positions. The model made them "
                     "itself (it was called without position_ids) or was given them; wrap the whole model in "
                     "RingFlexAttention, which passes the global ones, or pass position_ids="
                     "ringflex.training.position_ids(seq_len, group=..., layout=...)")
    _CHECKED.last = (weakref.ref(position_ids), position_ids._version, mode, error)
    return error


def _span(positions: torch.Tensor) -> str:
    shown = positions.tolist() if positions.numel() <= 6 else positions[:3].tolist() + ["..."] + positions[-2:].tolist()
    return "[" + ", ".join(map(str, shown)) + "]"


# Eager even inside compiled code: dynamo traces past lru_cache, and every call would then
# hand the ring new mod objects, which it plans anew.
@torch.compiler.disable
def _attend(query, key, value, mask, sliding_window, softcap, scaling, sinks):
    """[B, S_local, Hq, D]; ``mask``: a ``LayerMask``, or whether the layer is causal."""
    if isinstance(mask, LayerMask):
        mask_mod = mask.mask_mod
    else:
        mask_mod = _sliding_window(int(sliding_window)) if sliding_window else mods.causal if mask else None
    out = attention(query, key, value, score_mod=_softcap(float(softcap)) if softcap else None, mask_mod=mask_mod,
                    scale=scaling, enable_gqa=query.shape[1] != key.shape[1], sinks=sinks)
    return out.transpose(1, 2).contiguous()


def ringflex_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """The AttentionMaskInterface function: no dense mask. A causal, sliding-window or full
    mask the attention call rebuilds from its own arguments (None); one they do not describe
    is read from ``mask_function`` into a ``LayerMask``; a padding mask, which local positions
    cannot express, or a part of a mask ringflex does not know raises."""
    if attention_mask is not None and not bool(attention_mask.all()):
        return LayerMask(error="ringflex attention cannot use a padding attention_mask: pack the sequences "
                               "(ringflex.PackedSequences) instead of padding them")
    if mask_function is None:
        return None
    parts = set()
    try:
        mask_mod = _as_mod(mask_function, parts)
    except ValueError as e:
        return LayerMask(error=str(e))
    return None if parts <= {"causal", "sliding window"} else LayerMask(mask_mod)


def _as_mod(fn, parts: set):
    """transformers' ``mask_function`` as a ringflex mod at global positions (None: every key),
    adding to ``parts`` the names of what it is made of. Its packed-sequence part is left out:
    it reads local position ids (the module docstring says how to pack documents)."""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()))) \
        if hasattr(fn, "__code__") else {}
    if name == "causal_mask_function":
        parts.add("causal")
        return mods.causal
    if name == "bidirectional_mask_function" or name.startswith("packed_sequence_mask_function."):
        return None
    if name.startswith("remap_positions_for_packed_sequence."):
        return _as_mod(cells["mask_function"], parts)
    if name.startswith("sliding_window_overlay."):
        parts.add("sliding window")
        return _window_overlay(int(cells["sliding_window"]))
    if name.startswith("chunked_overlay.") and not bool(torch.as_tensor(cells.get("left_padding", 0)).any()):
        parts.add("chunks")
        return _chunks(int(cells["chunk_size"]))
    if name in ("and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"):
        inner = [_as_mod(f, parts) for f in cells["mask_functions"]]
        if name.startswith("or_"):
            return None if None in inner else _or_masks(*inner)
        inner = [m for m in inner if m is not None]
        return _and_masks(*inner) if len(inner) > 1 else inner[0] if inner else None
    raise ValueError(f"ringflex attention cannot route this layer's mask: transformers built it with {name}, which "
                     "ringflex does not know (it routes causal, sliding-window and chunked masks, and full attention)")


def register(name: str = NAME) -> None:
    """Registers ``name`` as an attention implementation (and its mask function) in transformers."""
    AttentionInterface.register(name, ringflex_attention_forward)
    AttentionMaskInterface.register(name, ringflex_mask)
