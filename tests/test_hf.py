"""attn_implementation="ringflex" in Hugging Face transformers (skipped without transformers): a tiny
Llama (GQA, RoPE at global position ids), a tiny gpt-oss (attention sinks, sliding-window
layers) and a tiny Gemma 2 (logit softcap, sliding-window layers) on a real ring give the logits
and summed parameter gradients of the same model in one process (fp64); sliding windows and
softcap map to mods; padding masks raise. A tiny Llama 4 with chunked attention, which only its
mask function describes."""
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ringflex  # noqa: E402
from support.harness import run_world  # noqa: E402
from support.oracle import attention as oracle  # noqa: E402
from ringflex import mods  # noqa: E402
from ringflex.integrations import hf  # noqa: E402
from ringflex.training import position_ids, reduce_gradients, shard_batch  # noqa: E402

VOCAB, SEQ_PER_RANK = 32, 8


def _set_attention(model, name):
    """``model.set_attn_implementation(name)``; transformers 4.53 has no such method: its layers
    read the config's name at every call."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def _llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _gpt_oss():
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                       num_experts_per_tok=1, sliding_window=4, max_position_embeddings=64,
                                       layer_types=["sliding_attention", "full_attention"])
    config._experts_implementation = "eager"  # the grouped matmul takes no fp64
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def _gemma2_rms_norm_in_its_dtype(self, x):
    return self._norm(x) * (1.0 + self.weight)  # Gemma 2's own norm computes in fp32 even in an fp64 model


def _gemma2():
    transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm.forward = _gemma2_rms_norm_in_its_dtype
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, sliding_window=5, attn_logit_softcapping=3.0,
                                       final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).double()


def _eager_fp64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Gemma 2's eager attention without its softmax in fp32, so that fp64 compares exactly."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    weights = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        weights = softcap * torch.tanh(weights / softcap)
    weights = torch.softmax(weights + attention_mask, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


transformers.AttentionInterface.register("eager_fp64", _eager_fp64)
transformers.masking_utils.AttentionMaskInterface.register("eager_fp64", transformers.masking_utils.eager_mask)

def _llama4_chunked():
    """Llama 4's text model with chunked attention (chunks of 4 tokens) in every layer: the
    chunks exist only in the mask transformers builds, not in the attention call's arguments."""
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=64, attention_chunk_size=4, no_rope_layers=[1, 1], use_qk_norm=False,
        attn_temperature_tuning=False, interleave_moe_layer_step=0, moe_layers=[],
        layer_types=["chunked_attention", "chunked_attention"])
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).double()


# name -> (builder, attention of the one-process model, batch size); eager attention holds gpt-oss's
# sinks, and Gemma 2's logit softcap (in fp64 throughout)
MODELS = {"llama": (_llama, "sdpa", 2), "gpt_oss": (_gpt_oss, "eager", 1), "gemma2": (_gemma2, "eager_fp64", 2),
          "llama4_chunked": (_llama4_chunked, "eager", 1)}


def _compare(rank, world_size, layout, model_name="llama", checkpointed_layers=False):
    """Logits and summed parameter gradients: the model on the ring against one process. With
    ``checkpointed_layers`` each decoder layer is wrapped and checkpointed by the wrapper."""
    build, single_attention, batch = MODELS[model_name]
    hf.register()
    seq_len = SEQ_PER_RANK * world_size
    tokens = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(batch, seq_len, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    single = build()
    _set_attention(single, single_attention)
    want = single(input_ids=tokens, use_cache=False).logits
    (want * weight).sum().backward()

    model = build()
    _set_attention(model, "ringflex")
    wrapped = ringflex.RingFlexAttention(model, layout=layout, backend="reference")
    if checkpointed_layers:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = ringflex.RingFlexAttention(layer, layout=layout, backend="reference", checkpoint=True)
        wrapped = model
    local = shard_batch({"tokens": tokens, "weight": weight}, layout=layout)
    got = wrapped(input_ids=local["tokens"], position_ids=position_ids(seq_len, layout=layout).expand(batch, -1),
                  use_cache=False).logits
    (got * local["weight"]).sum().backward()
    reduce_gradients(model.parameters())
    out_error = (ringflex.unshard(got.detach(), 1, layout=layout) - want).abs().max().item()
    grad_error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), single.parameters()))
    return out_error, grad_error


@pytest.mark.parametrize("world_size,layout", [(2, "zigzag")])
def test_llama_ring_matches_single_process(world_size, layout):
    for out_error, grad_error in run_world(world_size, _compare, layout):
        assert out_error < 1e-10 and grad_error < 1e-10, (out_error, grad_error)


def _checkpointed_by_transformers(rank, world_size):
    hf.register()
    model = _llama()
    _set_attention(model, "ringflex")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    wrapped = ringflex.RingFlexAttention(model, backend="reference")
    tokens = shard_batch(torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1)))
    logits = wrapped(input_ids=tokens, position_ids=position_ids(16).expand(1, -1), use_cache=False).logits
    with pytest.raises(RuntimeError) as raised:
        logits.sum().backward()
    return str(raised.value)


def test_checkpointing_inside_the_wrapper_says_how_to_checkpoint():
    """transformers' checkpointing recomputes the layers outside the wrapper: the attention call
    says so, where it told the user to wrap the model they had wrapped."""
    for message in run_world(2, _checkpointed_by_transformers):
        assert "during backward" in message and "RingFlexAttention(layer, group=..., checkpoint=True)" in message


def test_llama_layers_checkpointed_by_their_wrappers_match_single_process():
    """Gradient checkpointing of a Hugging Face model: each decoder layer wrapped with
    ``checkpoint=True``, its recompute in the ring."""
    for out_error, grad_error in run_world(2, _compare, "zigzag", "llama", True):
        assert out_error < 1e-10 and grad_error < 1e-10, (out_error, grad_error)


class _Layer(torch.nn.Module):
    is_causal = True


def test_sliding_window_and_softcap_map_to_mods():
    q, k, v = (torch.randn(1, 4, 12, 8, dtype=torch.float64) for _ in range(3))
    with ringflex.RingFlexMode(backend="reference"):
        out, weights = hf.ringflex_attention_forward(_Layer(), q, k[:, :2], v[:, :2], None, scaling=0.2,
                                                     sliding_window=3, softcap=5.0)
    want = oracle(q, k[:, :2], v[:, :2], mods.softcap(5.0), mods.sliding_window(3), scale=0.2)
    assert weights is None
    torch.testing.assert_close(out, want.transpose(1, 2))


def test_unroutable_calls_raise():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with ringflex.RingFlexMode():
        with pytest.raises(ValueError, match="attention_mask tensor"):
            hf.ringflex_attention_forward(_Layer(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match="dropout"):
            hf.ringflex_attention_forward(_Layer(), q, q, q, None, dropout=0.1)
        padded = hf.ringflex_mask(attention_mask=torch.tensor([[True, False]]))  # raised by the attention call
        with pytest.raises(ValueError, match="padding attention_mask"):
            hf.ringflex_attention_forward(_Layer(), q, q, q, padded)
    assert hf.ringflex_mask(attention_mask=torch.ones(1, 2, dtype=torch.bool)) is None


def _padded_on_one_rank(rank, world_size):
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    mask = hf.ringflex_mask(attention_mask=torch.tensor([[True, rank != 0]]))
    with ringflex.RingFlexMode(), pytest.raises(ringflex.CallRejected) as refused:
        hf.ringflex_attention_forward(_Layer(), q, q, q, mask)
    return str(refused.value)


def test_a_call_refused_on_one_rank_raises_on_every_rank():
    """Rank 0's tokens are padded, rank 1's are not: rank 1 was left waiting in the ring."""
    for message in run_world(2, _padded_on_one_rank):
        assert message.startswith("ring_flex_attention: rank 0: ringflex attention cannot use a padding"), message


@pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="gpt-oss came with transformers 4.55")
def test_gpt_oss_attention_sinks_match_single_process():
    """gpt-oss's attention sinks (``s_aux``, a learnable logit per head in every softmax) and
    sliding-window layers on a real ring: the logits and every gradient, sinks' included, of
    one process with eager attention (fp64)."""
    for out_error, grad_error in run_world(2, _compare, "zigzag", "gpt_oss"):
        assert out_error < 1e-10 and grad_error < 1e-10, (out_error, grad_error)


def test_gemma2_softcap_and_sliding_window_layers_match_single_process():
    """Gemma 2's attention: a tanh softcap of the logits in every layer, sliding-window and
    full layers in turn, grouped heads and its own query scale, on a real ring: the logits and
    every gradient of one process with eager attention (fp64; its softmax and norms, which
    Gemma 2 computes in fp32, kept in fp64 for both)."""
    for out_error, grad_error in run_world(2, _compare, "zigzag", "gemma2"):
        assert out_error < 1e-10 and grad_error < 1e-10, (out_error, grad_error)


def test_llama4_chunked_attention_matches_single_process():
    """Llama 4's chunked attention, which the attention call learns only from the mask
    transformers builds (``hf.LayerMask``): the logits and every gradient of one process."""
    for out_error, grad_error in run_world(2, _compare, "zigzag", "llama4_chunked"):
        assert out_error < 1e-10 and grad_error < 1e-10, (out_error, grad_error)


def test_masks_are_read_from_the_mask_function():
    """Causal and sliding-window masks are rebuilt from the attention call's arguments; chunks
    become a mod; a packed-sequence part (local position ids) is left out; an unknown part raises."""
    mu = transformers.masking_utils
    assert hf.ringflex_mask(mask_function=mu.causal_mask_function) is None
    assert hf.ringflex_mask(mask_function=mu.sliding_window_causal_mask_function(3)) is None
    assert hf.ringflex_mask(mask_function=_packed_causal(mu)) is None
    chunked = hf.ringflex_mask(mask_function=_chunked_causal(mu, 4))
    again = hf.ringflex_mask(mask_function=_chunked_causal(mu, 4))
    assert chunked.mask_mod is again.mask_mod  # one mod object: the ring plans it once
    q, kv = torch.arange(12).view(-1, 1), torch.arange(12).view(1, -1)
    zero = torch.tensor(0)
    assert torch.equal(chunked.mask_mod(zero, zero, q, kv), (kv <= q) & (q // 4 == kv // 4))
    unknown = mu.or_masks(mu.causal_mask_function, mu.padding_mask_function(torch.tensor([[True, False]])))
    assert "built it with padding_mask_function" in hf.ringflex_mask(mask_function=unknown).error


def _packed_causal(mu):
    """A causal mask over two packed sequences, as the installed transformers builds it (with
    its positions remapped where it does that)."""
    positions, documents = torch.tensor([[0, 1, 0, 1]]), torch.tensor([[0, 0, 1, 1]])
    causal = mu.causal_mask_function
    if hasattr(mu, "remap_positions_for_packed_sequence"):
        causal = mu.remap_positions_for_packed_sequence(causal, positions)
    return mu.and_masks(causal, mu.packed_sequence_mask_function(documents))


def _chunked_causal(mu, size):
    """Newer transformers also take the batch's left padding (none here)."""
    try:
        return mu.chunked_causal_mask_function(size, torch.zeros(1, dtype=torch.long))
    except TypeError:
        return mu.chunked_causal_mask_function(size)


def _compiled_layer_warnings(rank, world_size):
    """Gemma 2 with every decoder layer compiled, on the ring: its logits against one process
    and the warnings of its calls."""
    import warnings
    hf.register()
    seq_len = SEQ_PER_RANK * world_size
    build, single_attention, batch = MODELS["gemma2"]
    tokens = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    single = build()
    _set_attention(single, single_attention)
    want = single(input_ids=tokens, use_cache=False).logits
    model = build()
    _set_attention(model, "ringflex")
    for layer in model.model.layers:
        layer.compile()
    wrapped = ringflex.RingFlexAttention(model, layout="zigzag", backend="reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = wrapped(input_ids=shard_batch({"tokens": tokens}, layout="zigzag")["tokens"],
                      position_ids=position_ids(seq_len, layout="zigzag").expand(batch, -1), use_cache=False).logits
    error = (ringflex.unshard(got.detach(), 1, layout="zigzag") - want).abs().max().item()
    return error, [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def test_layers_compiled_one_by_one_pick_their_mods_outside_dynamo():
    """The integration chooses a layer's cached mods eagerly: traced, dynamo warned that it
    went past their lru_cache (and a new mod object would be planned anew)."""
    for error, lru_warnings in run_world(2, _compiled_layer_warnings, timeout=400):
        assert error < 1e-6 and lru_warnings == [], (error, lru_warnings)


def _without_position_ids(rank, world_size, layout, embeds=False, checkpointed_layers=False):
    """A tiny Llama called as a user calls it on one GPU -- no position_ids, no use_cache (its
    config turns the cache on) -- through the wrapper: the logits and summed gradients of one
    process, the cache off, one warning that says why. ``checkpointed_layers``: each decoder
    layer also wrapped with ``checkpoint=True``, inside the wrapped model."""
    import warnings
    hf.register()
    seq_len, batch = SEQ_PER_RANK * world_size, 2
    tokens = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(batch, seq_len, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    single = _llama()
    _set_attention(single, "sdpa")
    want = single(input_ids=tokens, use_cache=False).logits
    (want * weight).sum().backward()

    model = _llama()
    assert model.config.use_cache
    _set_attention(model, "ringflex")
    if checkpointed_layers:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = ringflex.RingFlexAttention(layer, layout=layout, backend="reference", checkpoint=True)
    wrapped = ringflex.RingFlexAttention(model, layout=layout, backend="reference")
    local = shard_batch({"tokens": tokens, "weight": weight}, layout=layout)
    inputs = {"inputs_embeds": model.model.embed_tokens(local["tokens"])} if embeds else {"input_ids": local["tokens"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wrapped(**inputs)
        again = wrapped(**inputs)
    (out.logits * local["weight"]).sum().backward()
    reduce_gradients(model.parameters())
    out_error = (ringflex.unshard(out.logits.detach(), 1, layout=layout) - want).abs().max().item()
    grad_error = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), single.parameters()))
    cache_warnings = [str(w.message) for w in caught if "use_cache" in str(w.message)]
    return out_error, grad_error, (out.past_key_values, again.past_key_values), cache_warnings, \
        torch.equal(again.logits, out.logits)


@pytest.mark.parametrize("layout,embeds,checkpointed_layers", [("zigzag", False, False), ("contiguous", True, False),
                                                               ("zigzag", False, True)])
def test_llama_called_without_position_ids_or_use_cache_matches_single_process(layout, embeds, checkpointed_layers):
    """The wrapper passes the global position ids of this rank's tokens (RoPE saw local ones:
    silently wrong logits) and turns off the cache the config asked for, saying so once."""
    for out_error, grad_error, caches, cache_warnings, repeatable in run_world(
            2, _without_position_ids, layout, embeds, checkpointed_layers):
        assert out_error < 1e-10 and grad_error < 1e-10, (out_error, grad_error)
        assert caches == (None, None) and repeatable
        assert len(cache_warnings) == 1 and "would hold only this rank's keys" in cache_warnings[0], cache_warnings


def _refused(rank, world_size, layout, how):
    hf.register()
    model = _llama()
    _set_attention(model, "ringflex")
    tokens = shard_batch(torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1)), layout=layout)
    positions = position_ids(16, layout=layout).expand(1, -1)
    if how == "layers_without_positions":  # the model itself unwrapped: it numbers the local tokens from 0
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = ringflex.RingFlexAttention(layer, layout=layout, backend="reference", checkpoint=True)
        call = functools.partial(model, input_ids=tokens, use_cache=False)
    elif how == "mode_without_positions":
        def call():
            with ringflex.RingFlexMode(layout=layout, backend="reference"):
                return model(input_ids=tokens, use_cache=False)
    else:
        wrapped = ringflex.RingFlexAttention(model, layout=layout, backend="reference")
        cache = transformers.DynamicCache() if how == "past_key_values" else None
        call = functools.partial(wrapped, input_ids=tokens, position_ids=positions,
                                 **({"use_cache": True} if how == "use_cache" else {"past_key_values": cache}))
    with pytest.raises(ringflex.CallRejected) as refused:
        call()
    return str(refused.value)


@pytest.mark.parametrize("how,layout,says", [
    ("use_cache", "zigzag", "called with use_cache=True: its cache would hold only this rank's keys and values"),
    ("past_key_values", "zigzag", "called with past_key_values: a Hugging Face cache holds earlier keys"),
    ("layers_without_positions", "contiguous", "rank 1: ringflex attention: this rank's position_ids number its "
                                               "tokens from 0"),
    ("mode_without_positions", "zigzag", "position_ids number its tokens from 0, but in the ring they sit at global "
                                         "positions (here [0, 1, 2, ..., 14, 15])")])
def test_a_cache_or_local_positions_are_refused_on_every_rank(how, layout, says):
    """What the wrapper cannot make right raises the same CallRejected on every rank: a cache
    (it would hold this rank's keys and values only), and position ids a model numbered from 0
    on each rank because it was called without them outside the wrapper (over the contiguous
    layout rank 0's are right: it learns of rank 1's in the ring's argument check)."""
    messages = run_world(2, _refused, layout, how)
    for rank, message in enumerate(messages):
        assert says in message, (rank, message)


def _layer_cache_warning(rank, world_size):
    """Decoder layers wrapped, the model called with global positions but its config's cache."""
    import warnings
    hf.register()
    model = _llama()
    _set_attention(model, "ringflex")
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = ringflex.RingFlexAttention(layer, backend="reference")
    tokens = shard_batch(torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=tokens, position_ids=position_ids(16).expand(1, -1))
    return [str(w.message) for w in caught if "cache" in str(w.message)]


def test_a_cache_that_reaches_a_wrapped_layer_is_warned_about():
    for cache_warnings in run_world(2, _layer_cache_warning):
        assert len(cache_warnings) == 1 and "holds only this rank's keys and values" in cache_warnings[0], cache_warnings
