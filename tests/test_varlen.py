"""Packed variable-length batches: lengths, cu_seqlens and jagged nested tensors describe the same
packing; on a real ring, varlen attention equals attending each sequence on its own (fp64,
forward and backward), with the padding isolated."""
import pytest
import torch

import ringflex
from support.harness import run_world
from support.oracle import attention as oracle
from ringflex import mods
from ringflex.parallel.groups import gather_objects
from ringflex.varlen import PackedSequences, varlen_attention

LENGTHS = [7, 1, 12, 5]  # 25 tokens: padded to 28 for zigzag on 2 ranks, 27 for contiguous on 3
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _nested(lengths, *shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, *shape, generator=g, dtype=torch.float64) for n in lengths],
                                      layout=torch.jagged)


def test_lengths_cu_seqlens_and_nested_agree():
    nested = _nested(LENGTHS, 3, seed=0)
    packings = [PackedSequences.from_lengths(LENGTHS), PackedSequences.from_cu_seqlens([0, 7, 8, 20, 25]),
                PackedSequences.from_nested(nested)]
    for p in packings:
        assert p.lengths == tuple(LENGTHS) and p.total == 25 and p.padded_len == 26  # zigzag on 1 rank: even
        assert p.doc_ids.tolist() == mods.document_ids(LENGTHS + [1]).tolist()
        assert p.cu_seqlens.tolist() == [0, 7, 8, 20, 25]
    p = packings[0]
    assert p.position_ids().tolist() == list(range(7)) + [0] + list(range(12)) + list(range(5)) + [0]
    padded = p.pad(nested, value=-1.0)
    assert padded.shape == (26, 3) and torch.equal(padded[:25], nested.values()) and bool((padded[25] == -1).all())
    back = p.to_nested(nested.values())
    assert torch.equal(back.offsets(), nested.offsets()) and torch.equal(back.values(), nested.values())
    assert p.mask_mod() is p.mask_mod() and p.mask_mod(causal=False) is not p.mask_mod()


def test_bad_packings_raise():
    with pytest.raises(ValueError, match="positive sequence lengths"):
        PackedSequences.from_lengths([3, 0])
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        PackedSequences.from_cu_seqlens([1, 4])
    with pytest.raises(TypeError, match="layout=torch.jagged"):
        PackedSequences.from_nested(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="layout must be one of"):
        PackedSequences.from_lengths([3], layout="diagonal")
    p = PackedSequences.from_lengths([3, 4])
    with pytest.raises(ValueError, match="must have 7 tokens"):
        p.pad(torch.zeros(6, 2))
    with pytest.raises(ValueError, match=r"q must be \[8, heads, head_dim\]"):
        varlen_attention(torch.zeros(7, 2, 4), torch.zeros(8, 2, 4), torch.zeros(8, 2, 4), p)


def _softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0)


def _per_sequence(q, k, v, dout, causal, sinks=None):
    """Each sequence attended alone: outputs and gradients as packed values [total, H, D] (and
    the sinks' gradient)."""
    leaves = [t.values().detach().requires_grad_() for t in (q, k, v)]
    sinks = None if sinks is None else sinks.clone().requires_grad_()
    outs = []
    for begin, end in zip(q.offsets()[:-1].tolist(), q.offsets()[1:].tolist()):
        qi, ki, vi = (t[begin:end].transpose(0, 1).unsqueeze(0) for t in leaves)
        outs.append(oracle(qi, ki, vi, _softcap, mods.causal if causal else None, sinks=sinks).squeeze(0).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.values())
    return [out.detach()] + [t.grad for t in leaves] + ([] if sinks is None else [sinks.grad])


def _ring(rank, world_size, layout, causal, with_sinks):
    import torch.distributed as dist

    q = _nested(LENGTHS, HEADS, HEAD_DIM, seed=1)
    k, v = (_nested(LENGTHS, KV_HEADS, HEAD_DIM, seed=s) for s in (2, 3))
    dout = _nested(LENGTHS, HEADS, HEAD_DIM, seed=4)
    sinks = torch.randn(HEADS, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) if with_sinks else None
    want = _per_sequence(q, k, v, dout, causal, sinks)
    packed = PackedSequences.from_nested(q, layout=layout)
    local = [packed.shard(t).requires_grad_() for t in (q, k, v)]
    local_sinks = None if sinks is None else sinks.clone().requires_grad_()
    out = varlen_attention(*local, packed, causal=causal, score_mod=_softcap, enable_gqa=True, backend="reference",
                           sinks=local_sinks)
    out.backward(packed.shard(dout))
    errors = [(packed.unshard(out.detach()) - want[0]).abs().max().item()]
    # local gradients, padding rows included (they must be 0), and the gathered real tokens
    errors += [(t.grad - packed.shard(w)).abs().max().item() for t, w in zip(local, want[1:4])]
    errors += [(packed.unshard(t.grad) - w).abs().max().item() for t, w in zip(local, want[1:4])]
    if with_sinks:  # the padding's rows, which no loss reads, add nothing to it
        dist.all_reduce(local_sinks.grad)
        errors.append((local_sinks.grad - want[4]).abs().max().item())
    if layout is None:  # chosen from the mask, the same on every rank
        assert isinstance(packed.layout, ringflex.Sharding)
        errors.append(float(len(set(gather_objects(None, packed.layout.digest()))) - 1))
    return packed.padded_len, errors


@pytest.mark.parametrize("world_size,layout,causal,padded_len,with_sinks", [
    (2, "zigzag", True, 28, False), (3, "contiguous", False, 27, False), (2, "zigzag", True, 28, True),
    (3, None, True, 30, False), (4, None, False, 32, True)])  # None: the sharding chosen from the sequences
def test_varlen_ring_matches_each_sequence_alone(world_size, layout, causal, padded_len, with_sinks):
    for rank, (got_len, errors) in enumerate(run_world(world_size, _ring, layout, causal, with_sinks)):
        assert got_len == padded_len
        assert max(errors) < 1e-12, (rank, errors)


def _wrong_shape_on_one_rank(rank, world_size):
    packed = PackedSequences.from_lengths([5, 11])
    local = [torch.zeros(8 + (rank == 0 and name == "q"), 2, 4) for name in "qkv"]
    with pytest.raises(ringflex.CallRejected) as refused:
        varlen_attention(*local, packed)
    return str(refused.value)


def test_a_shape_wrong_on_one_rank_raises_on_every_rank():
    """The other ranks were left waiting in the ring's argument check."""
    for message in run_world(2, _wrong_shape_on_one_rank):
        assert message == ("ring_flex_attention: rank 0: varlen_attention: q must be [8, heads, head_dim] (this "
                           "rank's shard of 16 packed tokens), got shape (9, 2, 4)")
