"""Layouts are permutations with the promised shape; the planner classifies blocks exactly."""
import pytest
import torch

import ringflex
from support.harness import run_world
from support.oracle import attention, visible_extent
from ringflex import mods
from ringflex.plan import layout as layouts
from ringflex.plan.blocks import BlockKind, block_kinds, classify, distances_needed, keys_read, plan_hops
from ringflex.plan.layout import Segment


@pytest.mark.parametrize("layout", ringflex.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layout_is_a_permutation(layout, world_size):
    seq_len = 8 * world_size
    perm = layouts.permutation(layout, seq_len, world_size)
    assert sorted(perm.tolist()) == list(range(seq_len))
    assert torch.equal(perm[layouts.inverse_permutation(layout, seq_len, world_size)], torch.arange(seq_len))
    for rank in range(world_size):
        segs = layouts.segments(layout, seq_len, world_size, rank)
        assert sum(s.length for s in segs) == seq_len // world_size
        assert torch.equal(torch.cat([s.positions() for s in segs]).long(),
                           layouts.positions(layout, seq_len, world_size, rank))


def test_layout_shapes():
    assert layouts.positions("zigzag", 8, 2, 0).tolist() == [0, 1, 6, 7]
    # the last rank's chunks (W-1 and W) are neighbours: one run, planned as one block
    assert layouts.segments("zigzag", 12, 3, 2) == [Segment(4, 1, 4)]
    assert layouts.segments("zigzag", 12, 3, 1) == [Segment(2, 1, 2), Segment(8, 1, 2)]
    assert layouts.positions("striped", 8, 2, 1).tolist() == [1, 3, 5, 7]
    assert layouts.positions("contiguous", 8, 2, 1).tolist() == [4, 5, 6, 7]


def test_layout_rejects_lengths_that_do_not_fit():
    with pytest.raises(ValueError, match="multiple of 4"):
        layouts.segments("zigzag", 10, 2, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        layouts.segments("diagonal", 8, 2, 0)


def _brute_kind(mask_mod, q_seg, kv_seg, batch=2, heads=3):
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    m = torch.broadcast_to(mask_mod(b, h, q_seg.positions().view(1, 1, -1, 1), kv_seg.positions().view(1, 1, 1, -1)),
                           (batch, heads, q_seg.length, kv_seg.length))
    return BlockKind.FULL if m.all() else BlockKind.EMPTY if not m.any() else BlockKind.PARTIAL


@pytest.mark.parametrize("mask_name", ["causal", "window", "documents", "head_dependent"])
def test_classify_matches_brute_force(mask_name):
    mask_mod = {
        "causal": mods.causal,
        "window": mods.sliding_window(7),
        "documents": mods.document(mods.document_ids([5, 11, 3, 13])),
        "head_dependent": lambda b, h, q, kv: (q >= kv) | (h == 1),
    }[mask_name]
    segs = [Segment(0, 1, 8), Segment(8, 1, 8), Segment(24, 1, 8), Segment(1, 4, 8), Segment(16, 2, 8)]
    for qs in segs:
        for ks in segs:
            assert BlockKind(int(classify(mask_mod, 2, 3, qs, ks))) == _brute_kind(mask_mod, qs, ks), (qs, ks)


def test_block_kinds_tiles_and_padding():
    kinds = block_kinds(mods.causal, 1, 1, Segment(0, 1, 10), Segment(0, 1, 10), 4, 4)
    assert kinds.tolist() == [[1, 0, 0], [2, 1, 0], [2, 2, 1]]


def test_plan_skips_empty_and_joins_full_blocks():
    # zigzag on 2 ranks, rank 0 holds chunks 0 and 3 of 4; causal mask.
    q = layouts.segments("zigzag", 16, 2, 0)
    steps = [layouts.segments("zigzag", 16, 2, src) for src in (0, 1)]
    plan = plan_hops(mods.causal, False, 1, 1, q, steps)
    # the rank's own block: causal on local rows too, so one call over local positions
    assert [(h.q_rows, h.kv_rows, h.kind, h.q_seg, h.kv_seg) for h in plan[0]] == [
        ((0, 8), (0, 8), BlockKind.PARTIAL, Segment(0, 1, 8), Segment(0, 1, 8))]
    # a mask that is not a pure order comparison keeps one hop per pair of segments (chunk 3
    # sees no key of chunk 0 within a window of 5)
    window = plan_hops(mods.sliding_window(5), False, 1, 1, q, steps)
    assert [(h.q_rows, h.kv_rows, h.kind) for h in window[0]] == [
        ((0, 4), (0, 4), BlockKind.PARTIAL), ((4, 8), (4, 8), BlockKind.PARTIAL)]
    # step 1 holds chunks 1 and 2, one run (the last rank's chunks are neighbours): only chunk 3
    # of the queries sees them, fully, as one call
    assert steps[1] == [Segment(4, 1, 8)]
    assert [(h.q_rows, h.kv_rows, h.kind) for h in plan[1]] == [((4, 8), (0, 8), BlockKind.FULL)]
    # blocks of neighbouring segments join into one call; with a score_mod positions matter, so
    # they join only where their positions stay one run, and the run is kept
    halves = [steps[0], [Segment(4, 1, 4), Segment(8, 1, 4)]]
    assert [(h.q_rows, h.kv_rows, h.kind, h.q_seg) for h in plan_hops(mods.causal, False, 1, 1, q, halves)[1]] == [
        ((4, 8), (0, 8), BlockKind.FULL, None)]
    assert [(h.q_rows, h.kv_rows, h.kv_seg) for h in plan_hops(mods.causal, True, 1, 1, q, halves)[1]] == [
        ((4, 8), (0, 8), Segment(4, 1, 8))]
    three = [layouts.segments("zigzag", 24, 3, src) for src in (0, 1)]  # rank 1: chunks 1 and 4, apart
    assert len(plan_hops(None, True, 1, 1, layouts.segments("zigzag", 24, 3, 0), three)[1]) == 4


def test_plan_splits_sparse_blocks_and_keeps_dense_ones_whole():
    seg = [Segment(0, 1, 4096)]
    window = plan_hops(mods.sliding_window(256), False, 1, 1, seg, [seg], min_tile=256)[0]
    assert sum((h.q_rows[1] - h.q_rows[0]) * (h.kv_rows[1] - h.kv_rows[0]) for h in window) < 4096 * 4096 / 4
    assert all(_brute_kind(mods.sliding_window(256), h.q_seg or Segment(h.q_rows[0], 1, h.q_rows[1] - h.q_rows[0]),
                           h.kv_seg or Segment(h.kv_rows[0], 1, h.kv_rows[1] - h.kv_rows[0])) == h.kind for h in window)
    assert len(plan_hops(mods.causal, False, 1, 1, seg, [seg], min_tile=256)[0]) == 1


class _PlansWithin:
    """A kernel that computes the visible part of blocks up to ``area`` pairs by itself."""
    name = "plans-within"

    def __init__(self, area=None):
        self.area, self.asked = area, []

    def plans_within(self, mask_mod, has_score_mod, q_seg, kv_seg, device):
        self.asked.append((q_seg, kv_seg))
        if self.area is None or q_seg.length * kv_seg.length <= self.area:
            return visible_extent(mask_mod, q_seg, kv_seg)
        return None


def test_plan_keeps_blocks_whole_that_the_kernel_plans_within():
    seg = [Segment(0, 1, 4096)]
    doc = mods.document(mods.document_ids([1000, 1500, 1596]))
    kernel = _PlansWithin()
    assert [(h.q_rows, h.kv_rows) for h in plan_hops(doc, False, 1, 1, seg, [seg], min_tile=256, kernel=kernel)[0]] == [
        ((0, 4096), (0, 4096))]
    assert kernel.asked == [(seg[0], seg[0])]
    assert len(plan_hops(doc, False, 1, 1, seg, [seg], min_tile=256)[0]) > 1  # split without such a kernel
    # blocks it plans within are not joined into one it cannot plan (too large); each is
    # the part the kernel's calls reach (below the diagonal: the second document's rows)
    small = plan_hops(doc, False, 1, 1, seg, [seg], min_tile=256, kernel=_PlansWithin(area=2048 * 2048))[0]
    assert [(h.q_rows, h.kv_rows) for h in small] == [((0, 2048), (0, 2048)), ((2048, 2500), (1000, 2048)),
                                                      ((2048, 4096), (2048, 4096))]
    assert small[1].q_seg == Segment(2048, 1, 452) and small[1].kv_seg == Segment(1000, 1, 1048)


def test_a_hop_covers_only_what_the_kernel_computes_of_its_block():
    """A window's queries at the start of a rank's block see only the last keys of the
    previous rank's block: the hop is that corner (as the kernel reports it), so the ring
    merges and sums only the rows and keys it reaches."""
    window, length = mods.sliding_window(1000), 8192
    q, kv = [Segment(length, 1, length)], [Segment(0, 1, length)]
    (hop,), = plan_hops(window, False, 1, 1, q, [kv], min_tile=256, kernel=_PlansWithin())
    assert (hop.q_rows, hop.kv_rows) == ((0, 999), (7193, 8192))
    assert (hop.q_seg, hop.kv_seg, hop.kind) == (Segment(length, 1, 999), Segment(7193, 1, 999), BlockKind.PARTIAL)
    assert _brute_kind(window, Segment(length + 999, 1, length - 999), kv[0]) == BlockKind.EMPTY
    assert _brute_kind(window, q[0], Segment(0, 1, 7193)) == BlockKind.EMPTY


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_rows_each_rank_reads_of_each_block(world_size):
    """What the ring moves (a block goes to each reader with the rows that reader reads). A
    window of 1000 over the contiguous layout: each rank reads the last 999 keys of the
    previous rank's block, so two ring steps run (and no rank reads the last rank's block).
    A causal mask over zigzag: a rank reads the first chunk alone of the blocks of the ranks
    before it (its queries all come after that chunk and before the second), both chunks of
    the others. A window over zigzag reads the ranks on either side: the ring runs distances 1 and W - 1."""
    window, length = mods.sliding_window(1000), 4096
    kernel, n = _PlansWithin(), length * world_size

    def reads(mask, layout):
        segs = [layouts.segments(layout, n, world_size, r) for r in range(world_size)]
        return [keys_read(plan_hops(mask, False, 1, 1, segs[r], [segs[(r - s) % world_size] for s in range(world_size)],
                                    min_tile=256, kernel=kernel), world_size)
                for r in range(world_size)]

    windowed = reads(window, "contiguous")
    assert windowed[0] == [(0, length)] + [(0, 0)] * (world_size - 1)
    assert all(spans == [(0, length), (length - 999, length)] + [(0, 0)] * (world_size - 2) for spans in windowed[1:])
    assert distances_needed(windowed) == [0, 1]
    causal = reads(mods.causal, "zigzag")
    assert distances_needed(causal) == list(range(world_size))
    for reader, spans in enumerate(causal):  # a rank after the owner reads its first chunk alone
        for d in range(1, world_size):
            owner = (reader - d) % world_size
            assert spans[d] == ((0, length // 2) if owner < reader else (0, length)), (reader, d)
    # over zigzag the window reads the ranks on either side: two steps, none between them
    windowed = reads(window, "zigzag")
    assert distances_needed(windowed) == sorted({0, 1, world_size - 1})


def _shard_roundtrip(rank, world_size, layout):
    x = torch.arange(2 * 3 * 12 * world_size, dtype=torch.float64).view(2, 3, 12 * world_size)
    x.requires_grad_()
    local = ringflex.shard(x, 2, layout=layout)
    full = ringflex.unshard(local, 2, layout=layout)
    (full * torch.arange(full.numel(), dtype=torch.float64).view_as(full)).sum().backward()
    expected_grad = torch.zeros_like(x)
    idx = layouts.positions(layout, x.shape[2], world_size, rank)
    expected_grad[:, :, idx] = torch.arange(x.numel(), dtype=torch.float64).view_as(x)[:, :, idx]
    return torch.equal(full, x) and torch.equal(x.grad, expected_grad)


@pytest.mark.parametrize("layout", ringflex.LAYOUTS)
def test_shard_unshard_roundtrip_and_gradients(layout):
    assert all(run_world(3, _shard_roundtrip, layout))


def test_plan_cache_reuses_only_identical_masks():
    from ringflex.plan.blocks import PlanCache
    cache = PlanCache()
    q = layouts.segments("zigzag", 16, 2, 0)
    steps = [layouts.segments("zigzag", 16, 2, src) for src in (0, 1)]
    doc_ids = mods.document_ids([3, 13])
    mask = mods.document(doc_ids)
    first = cache.get(mask, False, 1, 1, q, steps)
    assert cache.get(mask, False, 1, 1, q, steps) is first
    doc_ids[:] = 0  # edited in place: one document now, the plan must change
    second = cache.get(mask, False, 1, 1, q, steps)
    assert second is not first and second == plan_hops(mask, False, 1, 1, q, steps)
    assert cache.get(mods.document(mods.document_ids([8, 8])), False, 1, 1, q, steps) is not second


@pytest.mark.parametrize("mask_name", ["causal", "window", "prefix", "documents", "image", "head_dependent", "and_or"])
def test_range_decisions_are_exact(mask_name):
    """Whatever the formula decides from ranges agrees with dense evaluation; the common
    masks are decided for every block of a long sequence without dense evaluation."""
    from ringflex.mod.ranges import block_decider
    mask_mod = {
        "causal": mods.causal,
        "window": mods.sliding_window(7),
        "prefix": mods.prefix_lm(9),
        "documents": mods.document(mods.document_ids([5, 11, 3, 13])),
        "image": mods.image_neighbourhood(4, 8, 1),
        "head_dependent": lambda b, h, q, kv: (q >= kv) | (h == 1),
        "and_or": mods.and_masks(mods.causal, mods.or_masks(mods.sliding_window(5), mods.prefix_lm(4))),
    }[mask_name]
    decide = block_decider(mask_mod, 2, 3)
    assert decide is not None
    segs = [Segment(s, 1, n) for s in range(0, 32, 4) for n in (1, 4)] + [Segment(1, 4, 7), Segment(16, 2, 8)]
    for qs in segs:
        for ks in segs:
            verdict = decide(qs, ks)
            if verdict is not None:
                assert (BlockKind.FULL if verdict else BlockKind.EMPTY) == _brute_kind(mask_mod, qs, ks), (qs, ks)
    if mask_name in ("causal", "window", "prefix"):
        big = [Segment(0, 1, 1 << 20), Segment(1 << 20, 1, 1 << 20), Segment(1 << 22, 1, 1 << 20)]
        verdicts = [decide(a, b) for a in big for b in big]
        # undecided: only the blocks that truly straddle the mask (diagonals; the window's neighbour)
        assert sum(v is None for v in verdicts) == (4 if mask_name == "window" else 3)


def test_untraceable_mask_falls_back_to_dense():
    from ringflex.mod.ranges import block_decider

    def data_dependent(b, h, q, kv):
        return q >= kv if bool((q > 100).all()) else q >= 0
    assert block_decider(data_dependent, 1, 1) is None
    assert int(classify(data_dependent, 1, 1, Segment(0, 1, 8), Segment(8, 1, 8))) == BlockKind.FULL


def _unshard_unequal(rank, world_size):
    messages = []
    for x, dim in ((torch.zeros(1, 2, 4 + 2 * rank), 2), (torch.zeros(1, 2, 4, dtype=torch.float64 if rank else torch.float32), 2),
                   (torch.zeros(1, 2, 4), 5 if rank else 2), (torch.zeros(2, 2, 2), 2 if rank else 1),
                   (torch.zeros((1,) * 9) if rank else torch.zeros((1,) * 8), 0), (None if rank else torch.zeros(1), 0)):
        try:
            ringflex.unshard(x, dim, layout="contiguous")
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_unshard_of_unequal_shards_raises_on_every_rank():
    """Shards that differ in shape or dtype, a dim that is none of a rank's, or ranks that
    gather along different dims: the same error on every rank, no hang."""
    messages = run_world(2, _unshard_unequal, timeout=60)
    assert messages[0] == messages[1]
    shapes, dtypes, dims, other_dims, too_many_dims, not_a_tensor = messages[0]
    assert "rank 0: (1, 2, 4) float32 along dim 2, rank 1: (1, 2, 6) float32 along dim 2" in shapes
    assert "rank 0: (1, 2, 4) float32 along dim 2, rank 1: (1, 2, 4) float64 along dim 2" in dtypes
    assert dims == "rank 1: unshard: dim must be an int in [-3, 3) for x of shape (1, 2, 4), got 5"
    assert "rank 0: (2, 2, 2) float32 along dim 1, rank 1: (2, 2, 2) float32 along dim 2" in other_dims
    assert too_many_dims == "rank 1: unshard supports tensors of at most 8 dims, got 9"  # rank 0 waited
    assert not_a_tensor == "rank 1: unshard: x must be a torch.Tensor, got NoneType"
    with pytest.raises(ValueError, match=r"shard: dim must be an int in \[-3, 3\)"):
        ringflex.shard(torch.zeros(1, 2, 4), 3)


def _unshard_in_other_layouts(rank, world_size):
    full = [torch.randn(1, 2, 4 * world_size, 8, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            for i in range(3)]
    q, k, v = (ringflex.shard(t, 2) for t in full)
    messages = []
    for layout in ("striped" if rank == 1 else "zigzag", "zigzig" if rank == 1 else "zigzag"):
        try:
            ringflex.unshard(q, 2, layout=layout)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    out = ringflex.unshard(ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal), 2)  # the group still works
    return messages, (out - attention(*full, mask_mod=mods.causal)).abs().max().item()


def test_unshard_in_another_layout_raises_on_every_rank():
    """A layout that differs on one rank, or is misspelt there, is refused on every rank before
    the gather: the odd rank's result came out in another order, or it alone raised."""
    results = run_world(3, _unshard_in_other_layouts, timeout=60)
    assert all(messages == results[0][0] for messages, _ in results)
    other, misspelt = results[0][0]
    assert other == ("unshard: the ranks differ in layout (rank 0: 'zigzag', rank 1: 'striped', rank 2: 'zigzag'); "
                     "every rank must gather in the layout the shards were made in")
    assert misspelt == ("rank 1: unshard: layout must be one of ('contiguous', 'zigzag', 'striped') or a ringflex.Sharding, "
                        "got 'zigzig'")
    assert all(error < 1e-12 for _, error in results)
    with pytest.raises(ValueError, match="unshard: layout must be one of"):
        ringflex.unshard(torch.zeros(1, 2, 4), 2, layout="zigzig")  # one process: no gather, the same check
