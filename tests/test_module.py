"""RingFlexAttention / RingFlexMode: an unchanged attention module, wrapped, on a real ring gives
the single-process output, input gradients and (summed) parameter gradients, in fp64 (torch's
nn.MultiheadAttention and nn.TransformerEncoderLayer too); calls that cannot be routed raise."""
import copy
import functools
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

import ringflex
from support.cases import _document_lengths
from support.harness import run_world
from support.oracle import attention as oracle
from ringflex import mods
from ringflex.module import RingFlexAttention, RingFlexMode, attention as ring_attention
from ringflex.training import reduce_gradients

DIM, HEADS, HEAD_DIM = 16, 4, 8
LOCAL = 8  # tokens per rank


def _doc_mask(seq_len):
    return mods.document(mods.document_ids(_document_lengths(seq_len)))


def _softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * torch.tanh(score / 2.0)


class Attention(nn.Module):
    """A plain multi-head attention layer, as a user would write it for one device.

    ``attend(q, k, v, seq_len)`` is the attention call under test; ``memory`` (if given) is
    attended instead of ``x`` (cross-attention, key length != query length)."""

    def __init__(self, attend, kv_heads=HEADS):
        super().__init__()
        self.attend, self.kv_heads = attend, kv_heads
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, dtype=torch.float64)
        self.kv = nn.Linear(DIM, 2 * kv_heads * HEAD_DIM, dtype=torch.float64)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, dtype=torch.float64)

    def forward(self, x, memory=None):
        memory = x if memory is None else memory
        q = self.q(x).unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)
        k, v = self.kv(memory).unflatten(-1, (2 * self.kv_heads, HEAD_DIM)).transpose(1, 2).chunk(2, dim=1)
        return self.out(self.attend(q, k, v).transpose(1, 2).flatten(2))


def _flex_with_block_mask(mask_mod, score_mod=None, **kwargs):
    def attend(q, k, v):  # the block mask is built for the lengths the layer sees, as on one device
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, **kwargs)
    return attend


def _flex_lse(q, k, v):  # asks for the LSE through return_aux and folds it into the output
    out, aux = flex_attention(q, k, v, score_mod=_softcap, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out + 0.1 * aux.lse.unsqueeze(-1).detach()  # ring_flex_attention's LSE has no gradient


def _oracle_lse(q, k, v):
    groups = q.shape[1] // k.shape[1]
    s = _softcap(q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * HEAD_DIM ** -0.5, None, None, None, None)
    return oracle(q, k, v, _softcap) + 0.1 * torch.logsumexp(s, -1).unsqueeze(-1).detach()


def cases(seq_len):
    """name -> (attention as the module calls it, the same attention for one process, kv heads,
    cross-attention, extra mask given to the wrapper)."""
    doc = _doc_mask(seq_len)
    return {
        "sdpa_causal": (functools.partial(F.scaled_dot_product_attention, is_causal=True), None, HEADS, False, None),
        "sdpa_gqa_scale": (functools.partial(F.scaled_dot_product_attention, enable_gqa=True, scale=0.3), None, 2,
                           False, None),
        # SDPA's is_causal with fewer keys than queries is top-left aligned: mods.causal
        "sdpa_cross_causal": (functools.partial(F.scaled_dot_product_attention, is_causal=True), None, HEADS, True,
                              None),
        "sdpa_causal_documents": (functools.partial(F.scaled_dot_product_attention, is_causal=True),
                                  functools.partial(oracle, mask_mod=mods.and_masks(mods.causal, doc)), HEADS, False,
                                  doc),
        "flex_documents_softcap": (_flex_with_block_mask(doc, _softcap),
                                   functools.partial(oracle, score_mod=_softcap, mask_mod=doc), HEADS, False, None),
        "flex_gqa_window": (_flex_with_block_mask(mods.sliding_window(3), enable_gqa=True),
                            functools.partial(oracle, mask_mod=mods.sliding_window(3)), 2, False, None),
        "flex_gqa_lse": (_flex_lse, _oracle_lse, 1, False, None),
    }


def _run_case(name, world_size, layout, group=None):
    """(errors of output, input grads, summed parameter grads) of the wrapped module vs one process."""
    seq_len = LOCAL * world_size
    attend, reference, kv_heads, cross, extra_mask = cases(seq_len)[name]
    torch.manual_seed(0)
    module = Attention(attend, kv_heads)
    single = Attention(reference or attend, kv_heads)
    single.load_state_dict(module.state_dict())
    x = torch.randn(2, seq_len, DIM, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(2, seq_len // 2, DIM, dtype=torch.float64, requires_grad=True) if cross else None
    weight = torch.randn(2, seq_len, DIM, dtype=torch.float64)

    want = single(x, memory)
    (want * weight).sum().backward()

    shard = functools.partial(ringflex.shard, dim=1, group=group, layout=layout)
    x_local = shard(x.detach()).requires_grad_()
    mem_local = shard(memory.detach()).requires_grad_() if cross else None
    wrapped = RingFlexAttention(module, group=group, layout=layout, backend="reference", mask_mod=extra_mask)
    got = wrapped(x_local, mem_local)
    (got * shard(weight)).sum().backward()
    reduce_gradients(module.parameters(), group)

    errors = {"out": (got - shard(want)).abs().max().item(), "dx": (x_local.grad - shard(x.grad)).abs().max().item()}
    if cross:
        errors["dmemory"] = (mem_local.grad - shard(memory.grad)).abs().max().item()
    for (pname, p), q in zip(module.named_parameters(), single.parameters()):
        errors[pname] = (p.grad - q.grad).abs().max().item()
    return errors


def _all_cases(rank, world_size, layout, names):
    return {name: _run_case(name, world_size, layout) for name in names or cases(LOCAL * world_size)}


@pytest.mark.parametrize("world_size,layout,names", [
    (2, "zigzag", None),
    (3, "striped", ["sdpa_causal", "sdpa_cross_causal", "flex_documents_softcap"]),
])
def test_wrapped_module_matches_single_process(world_size, layout, names):
    failures = [f"rank {rank} {name}: {errors}"
                for rank, result in enumerate(run_world(world_size, _all_cases, layout, names))
                for name, errors in result.items() if max(errors.values()) > 1e-10]
    assert not failures, "\n".join(failures)


def test_one_process_routes_too():
    """Without torch.distributed the mode runs the ring on one rank (the reference kernel)."""
    for name in cases(LOCAL):
        errors = _run_case(name, 1, "zigzag")
        assert max(errors.values()) < 1e-10, (name, errors)


def _qkv(seq_len=8):
    torch.manual_seed(0)
    return [torch.randn(1, 2, seq_len, 4, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool)),
     "dense attn_mask"),
    (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), "dropout"),
    (lambda q, k, v: flex_attention(q, k, v, block_mask=BlockMask.from_kv_blocks(
        torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 2, dtype=torch.int32), BLOCK_SIZE=4,
        seq_lengths=(8, 8))), "no mask_mod"),
    (lambda q, k, v: flex_attention(q, k, v, block_mask=create_block_mask(mods.causal, None, None, 4, 4,
                                                                           device="cpu")), "built for lengths"),
    (lambda q, k, v: flex_attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=True)), "max_scores"),
    (lambda q, k, v: flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True)), "both"),
])
def test_calls_that_cannot_be_routed_raise(call, match):
    with RingFlexMode(), pytest.raises(ValueError, match=match):
        call(*_qkv())


def _refused_on_one_rank(rank, world_size):
    """Rank 0's model asks for a dense mask (as transformers does for positions it reads as two
    packed sequences), the others' for causal attention: how each call ends, and how fast."""
    q, k, v = (ringflex.shard(t, 2) for t in _qkv(8 * world_size))
    start = time.monotonic()
    with RingFlexMode(), pytest.raises(ringflex.CallRejected) as refused:
        if rank == 0:
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
        else:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return str(refused.value), time.monotonic() - start


def test_a_call_refused_on_one_rank_raises_on_every_rank():
    """The others were left waiting in the ring's argument check (20 s, until rank 0 exited)."""
    for message, seconds in run_world(2, _refused_on_one_rank):
        assert message.startswith("ring_flex_attention: rank 0: scaled_dot_product_attention: RingFlexMode cannot "
                                  "route a dense attn_mask"), message
        assert seconds < 10


def test_unreplaceable_flex_reference_is_refused():
    from ringflex.module import _TORCH_FLEX
    hidden = functools.partial(_TORCH_FLEX)  # a reference the patch cannot see
    with RingFlexMode(), pytest.raises(Exception, match="could not replace"):
        hidden(*_qkv())


_COMPILED_FLEX = torch.compile(flex_attention)  # as models often write it; the mode routes it too


def test_compiled_flex_is_routed():
    q, k, v = _qkv()
    with RingFlexMode(backend="reference"):
        out = _COMPILED_FLEX(q, k, v, block_mask=create_block_mask(mods.causal, None, None, 8, 8, device="cpu"))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert _COMPILED_FLEX.__dict__["_torchdynamo_orig_callable"] is torch.nn.attention.flex_attention.flex_attention


def test_autocast_runs_attention_in_the_autocast_dtype():
    q, k, v = (t.float() for t in _qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with RingFlexMode(backend="reference"):
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_autocast_leaves_float64_alone():
    """As torch's autocast does: float64 attention, and a float64 nn.MultiheadAttention, stay float64."""
    q, k, v = _qkv()
    mha = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(8, 1, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want_mha, _ = mha(x, x, x, need_weights=False, attn_mask=torch.ones(8, 8).triu(1).bool(), is_causal=True)
        with RingFlexMode(backend="reference"):
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            got_mha, _ = mha(x, x, x, need_weights=False, attn_mask=torch.ones(8, 8).triu(1).bool(), is_causal=True)
    assert got.dtype == got_mha.dtype == torch.float64
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_mha, want_mha)


def test_flex_in_a_script_spawned_by_multiprocessing_is_routed(tmp_path, monkeypatch):
    """multiprocessing's spawn and forkserver run the launched script as ``__mp_main__`` with
    runpy, copying its globals into a new module: the script's functions keep runpy's dict,
    where the mode must replace flex_attention too (here as multiprocessing does it)."""
    import runpy
    import sys
    import types
    script = tmp_path / "launched.py"
    script.write_text("from torch.nn.attention.flex_attention import flex_attention\n\n"
                      "def attend(q, k, v):\n    return flex_attention(q, k, v)\n")
    main = types.ModuleType("__mp_main__")
    main.__dict__.update(runpy.run_path(str(script), run_name="__mp_main__"))
    monkeypatch.setitem(sys.modules, "launched_as_mp_main", main)  # a new name: the mode rescans new modules
    q, k, v = _qkv()
    with RingFlexMode(backend="reference", mask_mod=mods.causal):  # routed: causal, else torch's full attention
        out = main.attend(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_patch_is_scoped():
    import torch.nn.attention.flex_attention as torch_flex_module
    from ringflex.module import _TORCH_FLEX
    q, k, v = _qkv()
    with RingFlexMode():
        assert torch_flex_module.flex_attention is not _TORCH_FLEX
        with RingFlexMode(layout="striped"):
            assert torch_flex_module.flex_attention is not _TORCH_FLEX
        assert torch_flex_module.flex_attention is not _TORCH_FLEX
    assert torch_flex_module.flex_attention is _TORCH_FLEX
    assert flex_attention is _TORCH_FLEX  # this module's own import, restored too
    torch.testing.assert_close(flex_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))  # untouched outside


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="layout must be one of"):
        RingFlexMode(layout="diagonal")
    with pytest.raises(ValueError, match="backend must be one of"):
        RingFlexMode(backend="fast")
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        RingFlexAttention(lambda x: x)
    with pytest.raises(RuntimeError, match="outside RingFlexAttention"):
        ring_attention(*_qkv())


def _mha_models():
    """name -> (module, its call on (x, memory), batch_first, cross-attention): torch's own
    attention modules, which reach attention through ``F.multi_head_attention_forward``."""
    causal = nn.Transformer.generate_square_subsequent_mask
    return {
        "mha_self": (nn.MultiheadAttention(DIM, HEADS, batch_first=True),
                     lambda m, x, mem: m(x, x, x, need_weights=False)[0], True, False),
        "mha_cross_kdim_vdim": (nn.MultiheadAttention(DIM, HEADS, kdim=12, vdim=10, batch_first=True),
                                lambda m, x, mem: m(x, mem[..., :12], mem[..., 12:22], need_weights=False)[0], True,
                                True),
        "mha_seq_first": (nn.MultiheadAttention(DIM, HEADS), lambda m, x, mem: m(x, x, x, need_weights=False)[0],
                          False, False),
        "mha_unbatched": (nn.MultiheadAttention(DIM, HEADS),
                          lambda m, x, mem: m(x[:, 0], x[:, 0], x[:, 0], need_weights=False)[0], False, False),
        "encoder_layer_causal": (nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=32, dropout=0.0,
                                                            batch_first=True),
                                 lambda m, x, mem: m(x, src_mask=causal(x.shape[1], dtype=x.dtype), is_causal=True),
                                 True, False),
        "decoder_layer_causal": (nn.TransformerDecoderLayer(DIM, HEADS, dim_feedforward=32, dropout=0.0,
                                                            batch_first=True),
                                 lambda m, x, mem: m(x, mem[..., :DIM], tgt_mask=causal(x.shape[1], dtype=x.dtype),
                                                     tgt_is_causal=True), True, True),
    }


def _mha_run(rank, world_size, layout):
    """Errors (output, input grads, summed parameter grads) of each wrapped torch module vs one process."""
    seq_len, results = LOCAL * world_size, {}
    for name, (module, call, batch_first, cross) in _mha_models().items():
        torch.manual_seed(0)
        module = module.double()
        single = copy.deepcopy(module)
        dim = 1 if batch_first else 0
        x = torch.randn(*((2, seq_len) if batch_first else (seq_len, 2)), DIM, dtype=torch.float64, requires_grad=True)
        memory = torch.randn(*((2, seq_len // 2) if batch_first else (seq_len // 2, 2)), 22, dtype=torch.float64,
                             requires_grad=True) if cross else None
        want = call(single, x, memory)
        weight = torch.randn_like(want)
        (want * weight).sum().backward()

        shard = functools.partial(ringflex.shard, dim=dim, layout=layout)
        x_local = shard(x.detach()).requires_grad_()
        mem_local = shard(memory.detach()).requires_grad_() if cross else None
        got = call(RingFlexAttention(module, layout=layout, backend="reference"), x_local, mem_local)
        (got * shard(weight)).sum().backward()
        reduce_gradients(module.parameters())
        errors = [(got - shard(want)).abs().max().item(), (x_local.grad - shard(x.grad)).abs().max().item()]
        if cross:
            errors.append((mem_local.grad - shard(memory.grad)).abs().max().item())
        errors += [(p.grad - q.grad).abs().max().item() for p, q in zip(module.parameters(), single.parameters())]
        results[name] = max(errors)
    return results


def test_torch_attention_modules_match_single_process():
    """nn.MultiheadAttention (self- and cross-attention with other key / value dims, batch or
    sequence first, unbatched), nn.TransformerEncoderLayer (causal) and nn.TransformerDecoderLayer
    (causal, cross-attention to a memory sharded alike), unchanged and wrapped, on a real
    ring: the output and every gradient of one process (fp64). Without the route torch ran
    their attention over each rank's tokens alone: 0.5 off, silently."""
    for rank, result in enumerate(run_world(2, _mha_run, "zigzag")):
        assert all(error < 1e-10 for error in result.values()), (rank, result)


@pytest.mark.parametrize("call,match", [
    (lambda m, x: m(x, x, x), "need_weights=True"),
    (lambda m, x: m(x, x, x, need_weights=False, key_padding_mask=torch.zeros(1, 8, dtype=torch.bool)),
     "key_padding_mask"),
    (lambda m, x: m(x, x, x, need_weights=False, attn_mask=torch.zeros(8, 8, dtype=torch.float64)),
     "dense attn_mask"),
    (lambda m, x: m(x, x, x, need_weights=False, is_causal=True), "is_causal=True without an attn_mask"),
    (lambda m, x: nn.MultiheadAttention(DIM, HEADS, add_zero_attn=True, batch_first=True).double()(
        x, x, x, need_weights=False), "add_zero_attn"),
    (lambda m, x: nn.MultiheadAttention(DIM, HEADS, dropout=0.1, batch_first=True).double()(
        x, x, x, need_weights=False), "dropout in training"),
])
def test_multihead_attention_calls_that_cannot_be_routed_raise(call, match):
    module, x = nn.MultiheadAttention(DIM, HEADS, batch_first=True).double(), torch.randn(1, 8, DIM, dtype=torch.float64)
    with RingFlexMode(), pytest.raises(ValueError, match=match):
        call(module, x)


@pytest.mark.parametrize("op", [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                                torch.ops.aten._scaled_dot_product_attention_math.default])
def test_torch_attention_ops_called_directly_are_refused(op):
    """Code that calls torch's fused attention ops itself would attend to this rank's tokens
    alone: the mode refuses them instead."""
    with RingFlexMode(), pytest.raises(RuntimeError, match="this rank's tokens alone"):
        op(*_qkv())


def test_torch_varlen_attention_is_refused():
    """torch's own packed-sequence attention (a custom op around the flash kernel, which the
    mode never sees) would attend to this rank's tokens alone: refused at the op."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    q, lengths = torch.randn(16, 2, 8), torch.tensor([0, 7, 16], dtype=torch.int32)
    with RingFlexMode(), pytest.raises(RuntimeError, match="tokens alone.*ringflex.varlen_attention"):
        varlen.varlen_attn(q, q, q, lengths, lengths, 9, 9)
