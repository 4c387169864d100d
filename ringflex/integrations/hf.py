"""Hugging Face transformers: ``attn_implementation="ringflex"``.

    import ringflex.integrations.hf as rf_hf
    rf_hf.register()                                  # once per process
    model.set_attn_implementation("ringflex")         # or from_pretrained(..., attn_implementation="ringflex")
    model = ringflex.RingFlexAttention(model, group=group, layout="zigzag")
    logits = model(input_ids=local_ids, position_ids=local_positions).logits

The model sees this rank's tokens and their GLOBAL position ids (``ringflex.training``); each
attention layer's causal / sliding-window mask and logit softcap become mods evaluated at global
positions by ``ring_flex_attention`` on the wrapper's group and layout. Packed documents: give
the wrapper ``mask_mod=PackedSequences(...).mask_mod()`` (restarting position ids alone are not
read). Attention sinks (gpt-oss's ``s_aux``) are ``ring_flex_attention``'s ``sinks``. What
cannot be routed raises: padding masks, custom 4-D masks, dropout, position biases.
"""
from __future__ import annotations

import functools

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # the optional extra is missing
    raise ImportError(f"ringflex.integrations.hf needs transformers ({e}); pip install 'ringflex[hf]'") from e

from .. import mods
from ..module import attention

NAME = "ringflex"

# One mod object per parameter, so the ring's planner classifies a layer's blocks once.
_sliding_window = functools.lru_cache(maxsize=None)(mods.sliding_window)
_softcap = functools.lru_cache(maxsize=None)(mods.softcap)


def ringflex_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                               is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """The AttentionInterface function: q [B, Hq, S_local, D], k/v [B, Hkv, S_local, D] ->
    ([B, S_local, Hq, D], None). Runs inside ``RingFlexAttention`` / ``RingFlexMode``."""
    if attention_mask is not None:
        raise ValueError("ringflex attention got an attention_mask tensor: padding and custom masks describe local "
                         "positions; pack sequences instead (ringflex.PackedSequences) and pass their mask_mod to "
                         "RingFlexAttention")
    if dropout:
        raise ValueError(f"ringflex attention does not support dropout (got {dropout}); set the config's "
                         "attention dropout to 0 or use model.eval()")
    if kwargs.get("position_bias") is not None:
        raise ValueError("ringflex attention cannot route position_bias")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if sliding_window and not causal:
        raise ValueError("ringflex attention supports sliding_window only for causal attention")
    out = _attend(query, key, value, causal, sliding_window, softcap, scaling, kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


# Eager even inside compiled code: dynamo traces past lru_cache, and every call would then
# hand the ring new mod objects, which it plans anew.
@torch.compiler.disable
def _attend(query, key, value, causal, sliding_window, softcap, scaling, sinks):
    mask_mod = _sliding_window(int(sliding_window)) if sliding_window else mods.causal if causal else None
    return attention(query, key, value, score_mod=_softcap(float(softcap)) if softcap else None, mask_mod=mask_mod,
                     scale=scaling, enable_gqa=query.shape[1] != key.shape[1], sinks=sinks)


def ringflex_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """The AttentionMaskInterface function: no dense mask (the attention builds its mods), and
    a clear error for a padding mask, which local positions cannot express."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("ringflex attention cannot use a padding attention_mask: pack the sequences "
                         "(ringflex.PackedSequences) instead of padding them")
    return None


def register(name: str = NAME) -> None:
    """Registers ``name`` as an attention implementation (and its mask function) in transformers."""
    AttentionInterface.register(name, ringflex_attention_forward)
    AttentionMaskInterface.register(name, ringflex_mask)
