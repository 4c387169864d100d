"""Re-sharding a call left in the default layout: ``parallel.reshard.move`` against the
permutation it stands for (random Shardings, 2 to 4 ranks, forward and gradient, float64);
``ring_flex_attention`` with ``layout=None`` and a mask another sharding runs faster
(a sliding window, packed documents) against the float64 oracle in the caller's zigzag
shards, saying so once; a mask the move does not pay for, run in place, saying what that costs; causal and explicit layouts, which move nothing; a call whose mask
differs on one rank, refused alike on every rank before any move; a rank raising in the
move, which fails every rank instead of leaving them waiting."""
import warnings

import pytest
import torch

import ringflex
from ringflex import mods
from ringflex.parallel import reshard
from ringflex.plan.layout import Sharding
from ringflex.plan.sharding import resharding
from support.cases import random_sharding
from support.harness import price_moves_by_their_rows, run_world
from support.oracle import attention

HQ, HKV, D, DV = 4, 2, 8, 6
PER_RANK = 16


def _moves(rank, world_size):
    seq_len = 6 * world_size
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 3, seq_len, 5, generator=gen, dtype=torch.float64),
            torch.randn(2, 1, seq_len, 4, generator=gen, dtype=torch.float64)]
    grads = [torch.randn_like(t) for t in full]
    worst = 0.0
    for seed in range(3):
        source, target = random_sharding(seq_len, world_size, seed), random_sharding(seq_len, world_size, seed + 10)
        local = [source.take(t, rank, dim=2).requires_grad_() for t in full]
        moved = reshard.move(local, 2, source, target, None, "a test move")
        sum(((m * target.take(g, rank, dim=2)).sum() for m, g in zip(moved, grads))).backward()
        got = [*moved, *(t.grad for t in local)]
        want = [*(target.take(t, rank, dim=2) for t in full), *(source.take(g, rank, dim=2) for g in grads)]
        assert all(g.shape == w.shape and g.is_contiguous() for g, w in zip(got, want))
        worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want)))
    lse = source.take(full[0][:, :, :, 0], rank, dim=2)  # along the last dim: an LSE's shape
    assert torch.equal(reshard.move([lse], 2, source, target, None, "an LSE")[0], target.take(full[0][..., 0], rank, 2))
    return worst


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_move_is_the_permutation_between_two_shardings_and_its_gradient_the_reverse(world_size):
    assert run_world(world_size, _moves) == [0.0] * world_size


def _documents(seq_len: int) -> torch.Tensor:
    return mods.document_ids([5, 11, seq_len // 2 - 16, 3, seq_len - seq_len // 2 - 3])


MASKS = {"window": lambda seq_len: mods.sliding_window(9),
         "wide window": lambda seq_len: mods.sliding_window(seq_len // 2),
         "documents": lambda seq_len: mods.and_masks(mods.causal, mods.document(_documents(seq_len))),
         "causal": lambda seq_len: mods.causal}


def _inputs(seq_len: int):
    gen = torch.Generator().manual_seed(0)
    shapes = [(HQ, D), (HKV, D), (HKV, DV), (HQ, DV)]
    q, k, v, dout = (torch.randn(1, h, seq_len, d, generator=gen, dtype=torch.float64) for h, d in shapes)
    return q, k, v, dout, torch.randn(1, HQ, seq_len, generator=gen, dtype=torch.float64)


def _default_layout(rank, world_size, mask_name, per_rank=PER_RANK, cheap_moves=True):
    """Two calls in the default layout (the LSE returned and read by the loss, then not),
    against the oracle in zigzag shards; the warnings said; whether routes were made.
    ``cheap_moves``: moves priced by their rows alone (``price_moves_by_their_rows``)."""
    if cheap_moves:
        price_moves_by_their_rows()
    seq_len = per_rank * world_size
    mask_mod, softcap = MASKS[mask_name](seq_len), mods.softcap(3.0)
    q, k, v, dout, dlse = _inputs(seq_len)
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for return_lse in (True, False):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            want, want_lse = attention(*full, mask_mod=mask_mod, score_mod=softcap, return_lse=True)
            ((want * dout).sum() + return_lse * (want_lse * dlse).sum()).backward()
            local = [ringflex.shard(t, 2).requires_grad_() for t in (q, k, v)]
            got = ringflex.ring_flex_attention(*local, mask_mod=mask_mod, score_mod=softcap, enable_gqa=True,
                                               return_lse=return_lse, backend="reference")
            out, lse = got if return_lse else (got, None)
            ((out * ringflex.shard(dout, 2)).sum() + (0 if lse is None else (lse * ringflex.shard(dlse, 2)).sum())
             ).backward()
            pairs = [(out, want), *((x.grad, y.grad) for x, y in zip(local, full))] + [(lse, want_lse)] * return_lse
            errors.append(max((g.detach() - ringflex.shard(w, 2)).abs().max().item() for g, w in pairs))
    said = [str(w.message) for w in caught if "slower in the default layout" in str(w.message)]
    return errors, said, len(reshard._ROUTES)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("mask_name", ["window", "documents"])
def test_the_default_layout_reshards_a_local_mask_and_gives_the_oracles_shards(world_size, mask_name):
    results = run_world(world_size, _default_layout, mask_name)
    for errors, _, routes in results:
        assert all(e < 1e-10 for e in errors), errors
        assert routes > 0  # the tokens moved
    said = [s for _, s, _ in results]
    assert len(said[0]) == 1 and all(s == [] for s in said[1:]), said
    assert "re-shards" in said[0][0] and "shard_by_mask" in said[0][0] and "layout='zigzag'" in said[0][0], said[0]


def test_a_mask_the_move_does_not_pay_for_runs_in_place_and_says_what_that_costs():
    """Over 2 ranks of 1024 tokens a window of 1024 is priced more than 10% dearer in zigzag than
    in contiguous shards, but less than the move there and back would add: the call runs in
    place (no route made) and gives the oracle's shards, and the first rank says once how much
    slower the default layout is estimated and how to shard instead."""
    results = run_world(2, _default_layout, "wide window", 1024)
    for errors, _, routes in results:
        assert all(e < 1e-10 for e in errors), errors
        assert routes == 0
    said = [s for _, s, _ in results]
    assert len(said[0]) == 1 and said[1] == [], said
    assert "run in place" in said[0][0] and "re-shards" not in said[0][0], said[0]
    assert "shard_by_mask" in said[0][0] and "layout='zigzag'" in said[0][0], said[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_short_causal_call_stays_in_zigzag_and_says_once_what_that_costs(world_size):
    """At a few tokens a rank the host bounds a causal call, and over zigzag every rank both
    receives and sends a block where over contiguous each rank does one or the other: the
    model prices zigzag dearer, but not by as much as a move costs the host, so the call runs
    in place and the first rank says so once. (At thousands of tokens a rank causal is
    zigzag's own: ``test_the_decision_pays_for_the_move``.)"""
    results = run_world(world_size, _default_layout, "causal", PER_RANK, False)
    for errors, _, routes in results:
        assert all(e < 1e-10 for e in errors), errors
        assert routes == 0
    said = [s for _, s, _ in results]
    assert len(said[0]) == 1 and all(s == [] for s in said[1:]), said
    assert "run in place" in said[0][0] and "sharding 'contiguous'" in said[0][0], said[0]


def _explicit_layouts(rank, world_size):
    seq_len = PER_RANK * world_size
    q, k, v, _, _ = _inputs(seq_len)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layout in ("zigzag", "striped", Sharding.of_layout("zigzag", seq_len, world_size)):
            local = [ringflex.shard(t, 2, layout=layout) for t in (q, k, v)]
            ringflex.ring_flex_attention(*local, mask_mod=MASKS["window"](seq_len), layout=layout, enable_gqa=True,
                                         backend="reference")
    return [str(w.message) for w in caught if "slower in the default layout" in str(w.message)], len(reshard._ROUTES)


def test_an_explicit_layout_never_moves():
    assert run_world(4, _explicit_layouts) == [([], 0)] * 4


def _one_rank_differs(rank, world_size):
    seq_len = PER_RANK * world_size
    q, k, v, _, _ = _inputs(seq_len)
    local = [ringflex.shard(t, 2) for t in (q, k, v)]
    window = MASKS["window"](seq_len)
    try:
        ringflex.ring_flex_attention(*local, mask_mod=mods.causal if rank == 1 else window, enable_gqa=True,
                                     backend="reference")
        refused = "no error"
    except ringflex.CallRejected as e:
        refused = str(e)
    out = ringflex.ring_flex_attention(*local, mask_mod=window, enable_gqa=True, backend="reference")
    want = ringflex.shard(attention(q, k, v, mask_mod=window), 2)
    return refused, (out - want).abs().max().item()


def test_a_mask_that_differs_on_one_rank_is_refused_alike_everywhere_and_the_group_lives_on():
    results = run_world(3, _one_rank_differs)
    refused = {r for r, _ in results}
    assert len(refused) == 1 and "disagree on the mask_mod" in refused.pop(), results
    assert all(error < 1e-10 for _, error in results), results


def _fault_in_the_move(rank, world_size):
    """Rank 1 raises as it packs the rows it sends in the move of q, k and v: (error text,
    seconds until it was raised) on every rank."""
    import datetime
    import time
    import torch.distributed as dist
    price_moves_by_their_rows()
    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=60))
    joined = reshard._joined

    def failing(parts, dim):
        if dist.get_rank() == 1:
            raise RuntimeError("injected fault")
        return joined(parts, dim)

    reshard._joined = failing
    seq_len = PER_RANK * world_size
    q, k, v, _, _ = _inputs(seq_len)
    start = time.monotonic()
    try:
        ringflex.ring_flex_attention(*(ringflex.shard(t, 2) for t in (q, k, v)), mask_mod=MASKS["window"](seq_len),
                                     enable_gqa=True, backend="reference", group=group)
        text = None
    except Exception as e:  # noqa: BLE001 (the test reads the text)
        text = f"{type(e).__name__}: {e}"
    return text, time.monotonic() - start


def test_a_rank_raising_in_the_move_fails_every_rank():
    results = run_world(3, _fault_in_the_move, timeout=120)
    assert results[1][0] == "RuntimeError: injected fault", results
    for text, seconds in results[:1] + results[2:]:
        assert text.startswith("RingFailure: ringflex: ") and "rank 1 raised in the ring's re-sharding of q, k and v" \
            in text, text
        assert seconds < 15, seconds


def test_the_decision_pays_for_the_move():
    """At 128k tokens a rank over 4 ranks, a causal mask whose queries are the first quarter of
    the sequence re-shards: in zigzag only ranks 0 and 1 hold such queries, striped spreads them
    over all four (2.3x faster with the move of 3/4 of each rank's rows). A window of 512 there
    stays in zigzag, with nothing to say: each neighbour receives only the 512 rows it reads, so
    zigzag costs what contiguous does (before the ring sent each reader its own rows, one range
    around both ends of a block travelled, the whole block, and it re-sharded). At 8k tokens a rank
    over 4 ranks, where the host's work bounds windows, they stay in place and say what staying
    costs (1.2x for a window of 4096, 1.4x for one of 512: a zigzag rank receives and sends two
    blocks, a contiguous one one each); over 2 ranks a window of 4096 costs the same in both
    (measured within 4%); causal is zigzag's own, prefix-LM within 10% of its best in zigzag,
    and a window of 4096 at 32k tokens a rank over 2 ranks as cheap in zigzag: nothing to say."""
    seq_len = 4 * 131072
    early = resharding(lambda b, h, q_idx, kv_idx: (q_idx < seq_len // 4) & (q_idx >= kv_idx), seq_len, 4, "zigzag")
    assert early.source == Sharding.of_layout("zigzag", seq_len, 4)
    assert early.target == Sharding.of_layout("striped", seq_len, 4)
    assert "up to 98304 of a rank's 131072 tokens" in early.message, early.message
    assert resharding(mods.sliding_window(512), seq_len, 4, "zigzag") is None
    per_rank = 8192
    for mask_mod, world, slower in ((mods.sliding_window(4096), 4, "1.2x"), (mods.sliding_window(512), 4, "1.4x")):
        stays = resharding(mask_mod, world * per_rank, world, "zigzag")
        assert stays.source == Sharding.of_layout("zigzag", world * per_rank, world) and stays.target is None
        assert f"an estimated {slower} slower" in stays.message and "sharding 'contiguous'" in stays.message, stays.message
        assert "run in place" in stays.message, stays.message
    for world in (2, 4):
        assert resharding(mods.causal, world * per_rank, world, "zigzag") is None
        assert resharding(mods.prefix_lm(world * per_rank // 4), world * per_rank, world, "zigzag") is None
    assert resharding(mods.sliding_window(4096), 2 * per_rank, 2, "zigzag") is None
    assert resharding(mods.sliding_window(4096), 2 * 32768, 2, "zigzag") is None


def _through_the_mode(rank, world_size):
    """SDPA inside a ``RingFlexMode`` that chose no layout, with the window as the mode's mask:
    the call re-shards as a direct call in the default layout does."""
    import torch.nn.functional as F

    price_moves_by_their_rows()
    seq_len = PER_RANK * world_size
    q, k, v, dout, _ = _inputs(seq_len)
    q, k, v, dout = (t[:, :HKV] for t in (q, k, v, dout))  # one head count: SDPA without GQA
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, mask_mod=MASKS["window"](seq_len))
    (want * dout).sum().backward()
    local = [ringflex.shard(t, 2).requires_grad_() for t in (q, k, v)]
    with ringflex.RingFlexMode(mask_mod=MASKS["window"](seq_len), backend="reference"):
        out = F.scaled_dot_product_attention(*local)
    (out * ringflex.shard(dout, 2)).sum().backward()
    pairs = [(out, want), *((x.grad, y.grad) for x, y in zip(local, full))]
    return max((g.detach() - ringflex.shard(w, 2)).abs().max().item() for g, w in pairs), len(reshard._ROUTES)


def test_a_mode_without_a_layout_reshards_as_the_call_does():
    for error, routes in run_world(4, _through_the_mode):
        assert error < 1e-10 and routes > 0
