"""A Sharding as the ring's layout: ``shard``, ``ring_flex_attention`` and ``unshard`` over the
segments it gives each rank, forward and backward against the float64 oracle, for world sizes
2 to 4; a Sharding the ranks do not share, or the ring cannot run, refused on every rank."""
import pytest
import torch

import ringflex
from ringflex import mods
from ringflex.plan.layout import Sharding
from ringflex.plan.cost import NO_WEIGHTS
from support.harness import run_world
from support.oracle import attention

B, H, D = 1, 2, 8
PER_RANK = 16


def _shardings(seq_len: int, world_size: int, ids: torch.Tensor):
    """Scattered chunks (each rank holds chunks of every part of the sequence, in an order no
    fixed layout has), and the one the cost model chooses for the documents."""
    chunk = seq_len // (4 * world_size)
    order = torch.randperm(4 * world_size, generator=torch.Generator().manual_seed(world_size)).tolist()
    scattered = Sharding.from_ranges(seq_len, [[(c * chunk, (c + 1) * chunk) for c in order[r::world_size]]
                                               for r in range(world_size)], "scattered")
    chosen = ringflex.shard_by_mask(mods.document(ids), seq_len, world_size, document_ids=ids,
                                    weights=NO_WEIGHTS)
    return {"scattered": scattered, "by documents": chosen}


def _documents(seq_len: int) -> torch.Tensor:
    lengths = [5, 11, seq_len // 2 - 16, 3, seq_len - seq_len // 2 - 3]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


MASKS = {"causal": lambda ids: mods.causal, "window": lambda ids: mods.sliding_window(9),
         "documents": lambda ids: mods.and_masks(mods.causal, mods.document(ids)),
         "prefix_lm": lambda ids: mods.prefix_lm(12)}


def _errors(rank, world_size, mask_name):
    seq_len = PER_RANK * world_size
    ids = _documents(seq_len)
    mask_mod = MASKS[mask_name](ids)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, seq_len, D, generator=gen, dtype=torch.float64) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, mask_mod=mask_mod, score_mod=mods.softcap(3.0))
    want.backward(dout)
    errors = {}
    for name, sharding in _shardings(seq_len, world_size, ids).items():
        local = [ringflex.shard(t, 2, layout=sharding).requires_grad_() for t in (q, k, v)]
        out = ringflex.ring_flex_attention(*local, mask_mod=mask_mod, score_mod=mods.softcap(3.0), layout=sharding,
                                           backend="reference")
        out.backward(ringflex.shard(dout, 2, layout=sharding))
        got = [ringflex.unshard(t, 2, layout=sharding) for t in (out.detach(), *(x.grad for x in local))]
        errors[name] = max((g - w).abs().max().item() for g, w in zip(got, [want, *(x.grad for x in full)]))
    return errors


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_a_sharding_runs_the_ring_like_one_process(world_size, mask_name):
    for errors in run_world(world_size, _errors, mask_name):
        assert all(e < 1e-10 for e in errors.values()), errors


def _refusals(rank, world_size):
    seq_len = PER_RANK * world_size
    q = torch.randn(B, H, PER_RANK, D, dtype=torch.float64)
    mine = Sharding.of_layout("contiguous" if rank == 0 else "striped", seq_len, world_size)
    seen = []
    for layout in (mine, Sharding.from_ranges(seq_len, [[(0, 24)], [(24, 32)]])):
        try:
            ringflex.ring_flex_attention(q, q, q, mask_mod=mods.causal, layout=layout, backend="reference")
            seen.append("no error")
        except ringflex.CallRejected as e:
            seen.append(str(e))
    agreed = Sharding.of_layout("zigzag", seq_len, world_size)
    out = ringflex.ring_flex_attention(q, q, q, mask_mod=mods.causal, layout=agreed, backend="reference")
    return seen, out.shape


def test_a_sharding_the_ranks_do_not_share_or_of_unequal_shards_is_refused_everywhere():
    for (differ, unequal), shape in run_world(2, _refusals):
        assert shape == (B, H, PER_RANK, D)  # the group lives on
        assert "disagree on the layout" in differ and "a Sharding (digest" in differ, differ
        assert "shards of equal sizes" in unequal, unequal


def test_a_sharding_prints_its_ranges_and_is_a_layout_value():
    s = Sharding.of_layout("zigzag", 16, 2)
    assert "rank 0: [0, 4) [12, 16)" in repr(s)
    same = Sharding.from_ranges(16, [[(0, 4), (12, 16)], [(4, 12)]])
    assert s == same and s.digest() == same.digest() != Sharding.of_layout("contiguous", 16, 2).digest()
    with pytest.raises(ValueError, match="cannot shard 32 positions"):
        ringflex.shard(torch.zeros(32), 0, layout=s)

