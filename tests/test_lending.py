"""Lending (``ringflex.plan.lending``, carried out by ``ringflex.parallel.loans``): where a mask
gives the ranks unequal work, a rank hands the first rows of its step-1 hops to the previous
rank, which owns the keys they read. The rows come out as one process computes them, and the
ranks' work evens out."""
import pytest
import torch

import ringflex
from support.calls import agreed_calls
from support.harness import run_world
from support.oracle import attention
from ringflex import mods
from ringflex.plan import lending
from ringflex.plan.lending import Loan, Offer, StepOne, amounts
from ringflex.plan.blocks import BlockKind, Hop
from ringflex.plan.layout import Segment


def test_amounts_even_a_window_over_the_contiguous_layout():
    """Rank 0 has its own block's work A, every other rank A and a corner C of the previous
    rank's block: rank r lends C (W - r) / W, and every rank ends with the mean."""
    work, corner = 1000, 240
    for world in (2, 3, 4):
        loads = [work] + [work + corner] * (world - 1)
        lend = amounts(loads, [0] + [corner] * (world - 1))
        assert lend == [0] + [corner * (world - r) // world for r in range(1, world)]
        after = [loads[r] - lend[r] + (lend[r + 1] if r + 1 < world else 0) for r in range(world)]
        assert max(after) - min(after) <= 1, after


@pytest.mark.parametrize("loads, lendable, want", [
    ([1000, 1020], [0, 500], [0, 0]),  # the busiest rank would gain 1%: not worth the transfers
    ([-1, 2000], [0, 500], [0, 0]),  # a rank could not count its work
    ([1000, 2000], [0, 100], [0, 100]),  # no more than the lender's step-1 work
    ([2000, 1000], [0, 900], [0, 0]),  # work moves only to the previous rank
])
def test_amounts_lend_only_what_helps(loads, lendable, want):
    assert amounts(loads, lendable) == want


def test_amounts_weigh_the_call_a_loan_adds():
    """A kernel call costs beyond its pairs (``HopKernel.call_pairs``), and borrowed rows are
    one more call: a window over zigzag (rank 0 makes 3 calls, rank 1 2) lends less than its
    pairs say, and documents whose pairs are even but whose straddling document is a call
    more on rank 1 lend nothing, since the loan would add a call to rank 0 (numbers in
    millions of pairs, a call 1.3 of them: an H100 at 32 heads of 128)."""
    call = 1300
    zigzag = [25200 + 3 * call, 33500 + 2 * call]
    assert amounts(zigzag, [0, 8400]) == [0, 3500] and amounts(zigzag, [0, 8400], call) == [0, 2850]
    assert amounts([17250 + call, 17140 + 2 * call], [0, 4240], call) == [0, 0]


def test_amounts_below_the_min_load_lend_nothing():
    """Under ``min_load`` the busiest rank's kernels would not hide lending's host work."""
    assert amounts([1000, 2000], [0, 500], min_load=2001) == [0, 0]
    assert amounts([1000, 2000], [0, 500], min_load=2000) == [0, 500]


def _corner(rows: int, keys: int) -> StepOne:
    """A window's corner: query row i of the next block sees the last keys - 1 - i keys."""
    hop = Hop((0, rows), (0, keys), Segment(keys, 1, rows), Segment(0, 1, keys), BlockKind.PARTIAL)
    return StepOne((hop,), ((keys - 1 - torch.arange(rows)).clamp(min=0),))


def test_cut_lends_the_rows_closest_to_the_amount(monkeypatch):
    monkeypatch.setattr(lending, "QUANTUM", 4)
    step = _corner(16, 16)  # rows see 15, 14, ... keys
    assert step.cut(15 + 14 + 13 + 12) == (0, 4)
    assert step.cut(15 + 14 + 13 + 12 + 5) == (0, 4)  # 8 rows would be 50 more
    assert step.cut(1) == (0, 0)
    assert step.cut(10 ** 6) == (0, 16)


def test_split_cuts_hops_at_the_lent_rows():
    step = _corner(16, 16)
    lent, kept = step.split((0, 5), None)
    assert [h.q_rows for h in lent] == [(0, 5)] and [h.q_rows for h in kept] == [(5, 16)]
    assert lent[0].q_seg == Segment(16, 1, 5) and kept[0].q_seg == Segment(21, 1, 11)


def test_ranks_that_planned_a_step_differently_do_not_lend_it():
    """Both ends of a loan cut rows from their own plan of the lender's step-1 hops; where the
    digests they share differ, that pair lends nothing (and the transfers stay matched)."""
    step = _corner(16, 16)
    offer = Offer(1000, step, step)
    shared = [[1000, 0, 7, step.digest, 0], [1500, int(step.counts[0].sum()), step.digest, 7, 0]]
    assert isinstance(offer.agree(shared, 1, None), Loan)
    shared[0][3] = 8
    assert offer.agree(shared, 1, None) is None


def test_the_largest_min_load_shared_holds_for_every_rank():
    """A rank on ``RINGFLEX_LENDING=auto`` keeps the others to its least load (the ranks
    derive the same loans from the same shares)."""
    step = _corner(16, 16)
    shared = [[1000, 0, 7, step.digest, 0], [1500, int(step.counts[0].sum()), step.digest, 7, 0]]
    assert isinstance(Offer(1500, step, step).agree(shared, 1, None), Loan)
    shared[0][4] = 1501
    assert Offer(1500, step, step).agree(shared, 1, None) is None


def _pairs_of(mask_mod, q_seg, kv_seg, rows: int, keys: int) -> int:
    """How many (query, key) pairs a kernel call over these segments computes that the mask shows."""
    if q_seg is None or mask_mod is None:
        return rows * keys
    seen = mask_mod(torch.zeros(()), torch.zeros(()), q_seg.positions().view(-1, 1), kv_seg.positions().view(1, -1))
    return int(seen.sum())


def _sparse_rows(b, h, q_idx, kv_idx):
    """Causal, but every 5th query sees nothing (its LSE -inf, lent rows' too)."""
    return (q_idx % 5 != 0) & (kv_idx <= q_idx)


def _lending_ring(rank, world_size, layout, mask_name, quantum, environ=(), call=0):
    """One fwd+bwd: (the largest error against one process, this rank's pairs computed in
    forward, its loan's (lent, borrowed) rows); a kernel call costs ``call`` pairs."""
    import os
    import ringflex.api
    from ringflex.kernels.reference import ReferenceKernel

    os.environ.update(dict(environ))
    lending.QUANTUM = quantum
    local = 64
    seq_len = local * world_size
    lengths = []  # documents of 40, 70, 30, 60, 40, ... tokens, the last cut to fit
    while sum(lengths) < seq_len:
        lengths.append(min((40, 70, 30, 60)[len(lengths) % 4], seq_len - sum(lengths)))
    mask = {"window": mods.sliding_window(24), "documents": mods.document(mods.document_ids(lengths)),
            "causal": mods.causal, "sparse_rows": _sparse_rows}[mask_name]
    computed, calls = [0], agreed_calls()

    class Counting(ReferenceKernel):
        def call_pairs(self, *sizes):
            return call

        def forward(self, q, k, v, q_seg, kv_seg, *args):
            computed[0] += _pairs_of(mask, q_seg, kv_seg, q.shape[2], k.shape[2])
            return super().forward(q, k, v, q_seg, kv_seg, *args)

    ringflex.api.select_kernel = lambda *args, **kwargs: Counting()
    q, k, v, dout = (torch.randn(1, 2, seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                     for i in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, mask_mod=mask)
    want.backward(dout)
    parts = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = ringflex.ring_flex_attention(*parts, mask_mod=mask, layout=layout)
    forward_pairs = computed[0]
    out.backward(ringflex.shard(dout, 2, layout=layout))
    errors = [(a - ringflex.shard(b, 2, layout=layout)).abs().max().item()
              for a, b in zip([out] + [t.grad for t in parts], [want] + [t.grad for t in full])]
    loan = calls[0].loan
    return max(errors), forward_pairs, loan and (loan.lent, loan.borrowed)


@pytest.mark.parametrize("world_size, layout, mask_name", [
    (2, "contiguous", "window"), (3, "contiguous", "window"), (4, "contiguous", "window"),
    (2, "contiguous", "documents"), (3, "contiguous", "documents"), (2, "contiguous", "causal"),
    (3, "contiguous", "causal"), (3, "zigzag", "window")])
def test_lending_evens_the_ranks_work_and_matches_one_process(world_size, layout, mask_name):
    """Against the same call without lending: the busiest rank computes fewer pairs, the ranks
    end within a few rows' work of each other, and out, dq, dk and dv match one process."""
    before = run_world(world_size, _lending_ring, layout, mask_name, 1, {"RINGFLEX_LENDING": "0"})
    after = run_world(world_size, _lending_ring, layout, mask_name, 1)
    assert all(loan is None for _, _, loan in before)
    assert any(loan is not None and loan[0][1] > loan[0][0] for _, _, loan in after), after
    assert max(error for error, _, _ in before + after) < 1e-10
    work_before, work_after = [pairs for _, pairs, _ in before], [pairs for _, pairs, _ in after]
    assert sum(work_before) == sum(work_after)  # the same pairs, computed elsewhere
    assert max(work_after) < 0.97 * max(work_before), (work_before, work_after)


def test_lent_rows_end_on_multiples_of_the_quantum():
    """Lent rows end on a multiple of ``QUANTUM`` (64 in real calls, 16 here), so a kernel
    sees few shapes; the ring still matches one process."""
    for error, _, loan in run_world(2, _lending_ring, "contiguous", "window", 16):
        assert error < 1e-10
        assert loan is not None and all(r[1] % 16 == 0 for r in loan), loan


def test_lending_off_on_one_rank_turns_it_off_for_all():
    """RINGFLEX_LENDING=0 on a single rank: it shares no counts, so no rank lends (and none
    waits for a transfer that its neighbour does not make)."""
    results = run_world(2, _one_rank_off)
    assert all(loan is None for _, _, loan in results)
    assert max(error for error, _, _ in results) < 1e-10


def _one_rank_off(rank, world_size):
    return _lending_ring(rank, world_size, "contiguous", "window", 1, {"RINGFLEX_LENDING": "0" if rank else "1"})


def _small_work(rank, world_size, modes):
    """A window whose busiest rank's load is under ``MIN_CALLS`` kernel calls (of 1000 pairs),
    each rank with its ``RINGFLEX_LENDING``."""
    return _lending_ring(rank, world_size, "contiguous", "window", 1, {"RINGFLEX_LENDING": modes[rank]}, call=1000)


@pytest.mark.parametrize("modes, lends", [(("auto", "auto"), False), (("1", "1"), True), (("1", "auto"), False)])
def test_small_work_lends_only_when_every_rank_asks(modes, lends):
    """By default (``auto``) work too small to hide lending's host work is not lent; with
    RINGFLEX_LENDING=1 on every rank it is; either way the ring matches one process."""
    results = run_world(2, _small_work, modes)
    assert all((loan is not None) == lends for _, _, loan in results), results
    assert max(error for error, _, _ in results) < 1e-10


@pytest.mark.parametrize("mask_name", ["window", "sparse_rows"])
def test_lending_in_debug_mode(mask_name, monkeypatch):
    """RINGFLEX_DEBUG=1 checks every transfer across the ranks, the loans' among them: lent
    rows that see no key come back with an LSE of -inf, as rows that see nothing have."""
    monkeypatch.setenv("RINGFLEX_DEBUG", "1")
    for error, _, loan in run_world(3, _lending_ring, "contiguous", mask_name, 1):
        assert error < 1e-10 and loan is not None


def _borrower_copies(rank, world_size):
    """The copies into a result this rank runs in a lending window's fwd+bwd, and its loan."""
    from benchmarks.probes.ring_passes import Passes
    from ringflex.kernels.flex import FlexKernel
    from ringflex.kernels.reference import ReferenceKernel

    lending.QUANTUM = 1
    # hops trimmed to the key tiles they see, as the GPU kernels plan them: the borrowed rows
    # and the sum the ring brings then reach only part of the borrower's block
    ReferenceKernel.plans_within, ReferenceKernel.tile = FlexKernel.plans_within, 64
    calls = agreed_calls()
    passes = Passes()
    passes.install()
    q, k, v = (ringflex.shard(torch.randn(1, 2, 2048, 8, generator=torch.Generator().manual_seed(i)), world_size,
                              layout="contiguous").requires_grad_() for i in range(3))
    with passes:
        ringflex.ring_flex_attention(q, k, v, mask_mod=mods.sliding_window(128), layout="contiguous").sum().backward()
    return [op for op in passes.ops if op.startswith("copy_(") and " result" in op], calls[0].loan


def test_a_borrowers_own_hop_becomes_its_gradient_sum():
    """The borrower adds the borrowed rows' dK/dV first, so its own hop, which covers every
    key row, comes last and becomes the sum: no rows are copied into a new result."""
    (copies, loan), _ = run_world(2, _borrower_copies)
    assert loan is not None and loan.borrowed[1] > loan.borrowed[0]
    assert copies == []
