"""Backward's joins: the FULL hops of several ring steps over the same query rows run as one
kernel call over keys forward kept (``plan.joins``), against the float64 oracle."""
import pytest
import torch

import ringflex
from ringflex import mods
from ringflex.plan import joins
from ringflex.plan.blocks import BlockKind, Hop
from ringflex.plan.layout import Segment
from support.harness import run_world
from support.oracle import attention

FULL, PARTIAL = BlockKind.FULL, BlockKind.PARTIAL


def _hop(q_rows, kv_rows, kind=FULL):
    seg = Segment(0, 1, 1)  # planned hops may carry segments; a FULL hop without score_mod ignores them
    return Hop(q_rows, kv_rows, seg, seg, kind)


def test_the_full_hops_of_several_steps_over_one_query_range_join_in_step_order():
    own = [_hop((0, 8), (0, 8), PARTIAL)]
    schedule = [own, [_hop((0, 8), (0, 4))], [_hop((0, 8), (4, 8))], [_hop((0, 8), (0, 4))]]
    planned = joins.plan_joins(schedule, False, [8] * len(schedule), 1)
    assert [(j.q_rows, [(step, hop.kv_rows, r) for step, hop, r in j.parts]) for j in planned] == [
        ((0, 8), [(1, (0, 4), (0, 4)), (2, (4, 8), (4, 8)), (3, (0, 4), (8, 12))])]
    assert planned[0].keys == 12 and planned[0].hop == Hop((0, 8), (0, 12), None, None, FULL)
    assert joins.first_backward_step(planned, len(schedule)) == 0


def test_hops_that_join_nothing_may_come_before_the_joins_in_backward():
    """Backward takes the forward steps in reverse: a hop of the last forward step runs
    first, and the joins of the steps before it after it, at the first step they reach."""
    schedule = [[], [_hop((0, 8), (0, 4))], [_hop((0, 8), (0, 4))], [_hop((4, 8), (0, 8))]]
    planned = joins.plan_joins(schedule, False, [8] * len(schedule), 1)
    assert [[step for step, _, _ in j.parts] for j in planned] == [[1, 2]]
    assert joins.first_backward_step(planned, len(schedule)) == 1


@pytest.mark.parametrize("why, schedule, has_score_mod, most_kept", [
    ("one step", [[], [_hop((0, 8), (0, 4)), _hop((0, 8), (4, 8))]], False, 1 << 20),
    ("the own block's step", [[_hop((0, 8), (0, 8))], [_hop((0, 8), (0, 4))]], False, 1 << 20),
    ("masked", [[], [_hop((0, 8), (0, 4), PARTIAL)], [_hop((0, 8), (0, 4), PARTIAL)]], False, 1 << 20),
    ("a score_mod reads positions", [[], [_hop((0, 8), (0, 4))], [_hop((0, 8), (0, 4))]], True, 1 << 20),
    ("more keys than the copy repays", [[], [_hop((0, 4), (0, 8))], [_hop((0, 4), (0, 8))]], False, 1 << 20),
    ("more kept than allowed", [[], [_hop((0, 8), (0, 4))], [_hop((0, 8), (0, 4))], []], False, 15),
    ("a hop that joins nothing would run after the join in backward",
     [[], [_hop((0, 8), (0, 4)), _hop((8, 12), (0, 4), PARTIAL)], [_hop((0, 8), (0, 4))]], False, 1 << 20),
])
def test_no_join(monkeypatch, why, schedule, has_score_mod, most_kept):
    monkeypatch.setattr(joins, "MOST_KEPT_BYTES", most_kept)
    assert joins.plan_joins(schedule, has_score_mod, [8] * len(schedule), 1) == [], why


def _joined_ring(rank, world_size, mask_mod, return_lse, kv_heads, retain):
    """The ring's errors against the oracle, and the backward hop calls on this rank."""
    from ringflex.parallel import ring
    calls = []
    hop_backward = ring.hop_backward
    ring.hop_backward = lambda call, hop, *args: calls.append(hop) or hop_backward(call, hop, *args)
    planned = []
    plan_joins = ring.plan_joins
    ring.plan_joins = lambda *args: planned.append(plan_joins(*args)) or planned[-1]
    seq_len, gen = 16 * world_size, torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, seq_len, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, seq_len, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout, dlse = torch.randn_like(q), torch.randn(q.shape[:3], generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, None, mask_mod, return_lse=return_lse)
    shard = lambda t: ringflex.shard(t, 2, layout="zigzag")  # noqa: E731
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    got = ringflex.ring_flex_attention(*local, mask_mod=mask_mod, layout="zigzag", enable_gqa=True,
                                       backend="reference", return_lse=return_lse)
    if return_lse:
        loss = lambda o, lse, place: (o * place(dout)).sum() + (lse * place(dlse)).sum()  # noqa: E731
        loss(*want, lambda t: t).backward()
        for _ in range(1 + retain):
            loss(*got, shard).backward(retain_graph=retain)
        got, want = got[0], want[0]
    else:
        want.backward(dout)
        for _ in range(1 + retain):
            got.backward(shard(dout), retain_graph=retain)
    errors = [(got - shard(want)).abs().max().item()] + [
        (a.grad / (1 + retain) - shard(b.grad)).abs().max().item() for a, b in zip(local, full)]
    return planned[0], len(calls), errors


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("mask_mod, return_lse, kv_heads, retain", [
    (mods.causal, False, 4, False), (mods.causal, True, 2, False), (None, False, 1, True)])
def test_joined_backward_matches_the_oracle(world_size, mask_mod, return_lse, kv_heads, retain):
    """Causal over zigzag: the last rank's every step takes all its query rows against the
    first half of the block, a join. No mask: every step's hop is a whole block, whose copy
    repays two blocks' keys per query row (3 ranks) and not three (4 ranks: no join, the ring
    as before). A loss reading the LSE runs the join's second call, GQA its repeated heads,
    retain_graph a second backward."""
    results = run_world(world_size, _joined_ring, mask_mod, return_lse, kv_heads, retain)
    for rank, (planned, calls, errors) in enumerate(results):
        assert max(errors) < 1e-12, (rank, errors)
    last_planned, last_calls, _ = results[-1]
    rows_read = (0, 16) if mask_mod is None else (0, 8)
    if mask_mod is None and world_size == 4:
        assert all(planned == [] for planned, _, _ in results)
        return
    assert [(step, hop.kv_rows) for step, hop, _ in last_planned[0].parts] == [
        (step, rows_read) for step in range(1, world_size)]
    hop_calls_per_backward = 1 + 1  # the join, then the own block
    assert last_calls == hop_calls_per_backward * (1 + retain)
