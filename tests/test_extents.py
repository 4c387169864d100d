"""Row extents from tiles of keys (``ringflex.plan.extents``) against the whole mask evaluated, and
the ranges they come from (``ringflex.mod.ranges``) where the mask computes in floating point."""
import random

import pytest
import torch

import ringflex
from support.harness import run_world
from support.oracle import attention
from ringflex import mods
from ringflex.mod import ranges
from ringflex.plan import extents
from ringflex.mod.ranges import block_decider, tile_ranges
from ringflex.plan.blocks import evaluate_mask
from ringflex.plan.layout import Segment
from ringflex.mod.trace import trace_mask_mod

IDS = mods.document_ids([5, 11, 3, 13, 300, 1, 200, 90, 400, 2000])
FLAGS = torch.arange(len(IDS)) % 7 < 2
SCORES = (torch.arange(len(IDS)) * 0.37) % 1


def float_distance(b, h, q, kv):
    """Hides distance 9, as torch computes it: in float32, 9 * 0.7 is 6.2999997 < 6.3."""
    return (q - kv) * 0.7 >= 6.3


MASKS = {
    "causal": mods.causal,
    "documents": mods.document(IDS),
    "documents_bidirectional": mods.document(IDS, causal_within=False),
    "window": mods.sliding_window(7),
    "wide_window": mods.sliding_window(300),
    "prefix": mods.prefix_lm(90),
    "image": mods.image_neighbourhood(16, 32, 2),
    "late_queries": lambda b, h, q, kv: (q >= 300) & (kv <= q),
    "sparse_rows": lambda b, h, q, kv: (q % 5 != 0) & (kv <= q),
    "flamingo": lambda b, h, q, kv: kv // 64 == q // 128,
    "where": lambda b, h, q, kv: torch.where(q > 200, kv <= q, (q - kv).abs() < 50),
    "decay": lambda b, h, q, kv: torch.exp((kv - q).abs() * -0.05) > 0.1,
    "checkerboard": lambda b, h, q, kv: (q + kv) % 2 == 0,  # leaves every tile open: one dense pass
    "shifted_lookup": lambda b, h, q, kv: IDS[q - 40] == IDS[kv],  # negative indices count from the end
    "flagged_keys": lambda b, h, q, kv: FLAGS[kv] | (kv <= q),  # a bool table
    "scored_keys": lambda b, h, q, kv: (SCORES[kv] > 0.3) & (kv <= q),  # a float table
    "float_distance": float_distance,
    # integers as torch computes them: booleans add as `or`, narrow casts wrap, int64 holds what
    # int32 cannot, and a bool cast to int is a 0/1 mask
    "bool_sum": lambda b, h, q, kv: ((q >= kv) + (kv < 16)) == 1,
    "uint8_distance": lambda b, h, q, kv: (q - kv).to(torch.uint8) < 40,
    "int16_scaled": lambda b, h, q, kv: (q * 1500).to(torch.int16) >= (kv * 1500).to(torch.int16),
    "int64_scaled": lambda b, h, q, kv: q.long() * 3_000_000 >= kv.long() * 3_000_000,
    "int_mask": lambda b, h, q, kv: ((q - kv) % 3 != 0).int(),
}


@pytest.fixture(autouse=True)
def tiles_for_every_block(monkeypatch):
    monkeypatch.setattr(extents, "_DENSE_AREA", 0)


def _dense(mask_mod, q_seg, kv_seg):
    return extents.dense_row_extents(evaluate_mask(mask_mod, 1, 1, q_seg.positions(), kv_seg.positions())[0, 0])


@pytest.mark.parametrize("name", sorted(MASKS))
def test_row_extents_match_the_whole_mask(name):
    mask_mod, rng = MASKS[name], random.Random(name)
    mask = trace_mask_mod(mask_mod)
    for _ in range(12):
        stride = rng.choice([1, 1, 2, 3])
        q_seg = Segment(rng.randrange(0, 500), stride, rng.randrange(1, 400))
        kv_seg = Segment(rng.randrange(0, 500), stride if rng.random() < 0.7 else 1, rng.randrange(1, 600))
        assert torch.equal(extents.row_extents(mask_mod, mask, q_seg, kv_seg, "cpu"), _dense(mask_mod, q_seg, kv_seg)), \
            (q_seg, kv_seg)


@pytest.mark.parametrize("name", ["causal", "documents", "wide_window", "prefix", "late_queries"])
def test_common_masks_are_not_evaluated_on_every_pair(name, monkeypatch):
    """A long block of the common masks: only the tiles its formula leaves open are evaluated."""
    mask_mod, q_seg, kv_seg = MASKS[name], Segment(1024, 1, 1024), Segment(0, 1, 2048)
    expected = _dense(mask_mod, q_seg, kv_seg)
    evaluated = []
    monkeypatch.setattr(extents, "evaluate_mask", lambda *a: evaluated.append(a) or evaluate_mask(*a))
    assert torch.equal(extents.row_extents(mask_mod, trace_mask_mod(mask_mod), q_seg, kv_seg, "cpu"), expected)
    assert not evaluated


@pytest.mark.parametrize("name", sorted(MASKS))
def test_tile_ranges_are_sound(name):
    """Where ``tile_ranges`` says every key of a tile is visible (or none), the mask agrees."""
    mask_mod = MASKS[name]
    q = torch.arange(3, 700, 7, dtype=torch.int32)
    first = torch.arange(0, 690, 23, dtype=torch.int32)
    last = first + torch.arange(len(first), dtype=torch.int32) % 5 * 4  # tiles of 1 to 17 keys
    ranges = tile_ranges(trace_mask_mod(mask_mod), q, first, last)
    assert ranges is not None
    every, some = ranges
    for j, (a, b) in enumerate(zip(first.tolist(), last.tolist())):
        tile = evaluate_mask(mask_mod, 1, 1, q, torch.arange(a, b + 1, dtype=torch.int32))[0, 0]
        assert not (every[:, j] & ~tile.all(1)).any() and not (~some[:, j] & tile.any(1)).any(), (a, b)


def test_a_block_too_large_to_evaluate_whole_has_extents_only_from_its_tiles(monkeypatch):
    monkeypatch.setattr(extents, "_MAX_DENSE", 1024 * 1024 - 1)
    q_seg = kv_seg = Segment(0, 1, 1024)
    settled, unsettled = MASKS["causal"], MASKS["checkerboard"]
    assert torch.equal(extents.row_extents(settled, trace_mask_mod(settled), q_seg, kv_seg, "cpu"),
                       _dense(settled, q_seg, kv_seg))
    assert extents.row_extents(unsettled, trace_mask_mod(unsettled), q_seg, kv_seg, "cpu") is None
    monkeypatch.setattr(extents, "_MAX_TILES", 1023 * 8)  # 1024 queries x 8 tiles: too many to range at once
    extents._EXTENTS.clear()  # the block was evaluated under the limits before
    assert extents.row_extents(settled, trace_mask_mod(settled), q_seg, kv_seg, "cpu") is None


def test_extents_are_computed_once_per_block_and_mask_values():
    """The cuDNN kernel's exact plan and lending read a block's extents: the second looks them
    up, unless the mask's captured values changed since (new document ids)."""
    ids = mods.document_ids([5, 9, 2])
    mask_mod = mods.document(ids)
    mask, seg = trace_mask_mod(mask_mod), Segment(0, 1, 16)
    first = extents.row_extents(mask_mod, mask, seg, seg, "cpu")
    assert extents.row_extents(mask_mod, mask, seg, seg, "cpu") is first
    ids[4:] = 1  # the first document ends a token early
    fresh = extents.row_extents(mask_mod, mask, seg, seg, "cpu")
    assert torch.equal(fresh, _dense(mask_mod, seg, seg)) and not torch.equal(fresh, first)


def _random_mask(rng: random.Random):
    """A mask built at random from the ops the range rules cover: arithmetic on positions,
    lookups into a table, where, min/max/clamp, abs, floor division, remainder, float math."""
    table = torch.tensor([rng.randrange(0, 5) for _ in range(2000)])
    terms = [
        lambda q, kv: q - kv, lambda q, kv: (q - kv).abs(), lambda q, kv: q // 7 - kv // 5,
        lambda q, kv: (q + kv) % 128, lambda q, kv: torch.minimum(q, kv + 9) - torch.maximum(kv, q - 30),
        lambda q, kv: table[kv] - table[q], lambda q, kv: torch.where(q > 300, q - kv, kv - q),
        lambda q, kv: torch.clamp(q - kv, -20, 40), lambda q, kv: torch.exp((kv - q) * 0.01) * 10,
    ]
    compares = {"le": torch.le, "ge": torch.ge, "lt": torch.lt, "eq": torch.eq}
    picks = [(rng.choice(terms), compares[rng.choice(sorted(compares))], rng.choice([-10, 0, 3, 50])) for _ in range(2)]
    both = rng.random() < 0.5

    def mask_mod(b, h, q, kv):
        (t1, c1, v1), (t2, c2, v2) = picks
        first, second = c1(t1(q, kv), v1), c2(t2(q, kv), v2)
        return first & second if both else first | second
    return mask_mod


@pytest.mark.parametrize("seed", range(40))
def test_row_extents_of_random_formulas_match_the_whole_mask(seed):
    rng = random.Random(seed)
    mask_mod = _random_mask(rng)
    mask = trace_mask_mod(mask_mod)
    for _ in range(3):
        stride = rng.choice([1, 2])
        q_seg = Segment(rng.randrange(0, 300), stride, rng.randrange(1, 200))
        kv_seg = Segment(rng.randrange(0, 300), stride, rng.randrange(1, 600))
        assert torch.equal(extents.row_extents(mask_mod, mask, q_seg, kv_seg, "cpu"), _dense(mask_mod, q_seg, kv_seg)), \
            (seed, q_seg, kv_seg)


def _by_definition(allowed):
    """First and last key seen, end of the run from the first one, count: row by row."""
    rows = []
    for row in allowed.tolist():
        seen = [j for j, a in enumerate(row) if a]
        if not seen:
            rows.append([-1, -1, 0, 0])
            continue
        end = seen[0]
        while end < len(row) and row[end]:
            end += 1
        rows.append([seen[0], seen[-1], end, len(seen)])
    return torch.tensor(rows).T


@pytest.mark.parametrize("name", sorted(MASKS))
def test_dense_row_extents_follow_their_definition(name):
    """Rows of one run, of several (checkerboard, flagged and scored keys), and of none."""
    allowed = evaluate_mask(MASKS[name], 1, 1, torch.arange(256, 512), torch.arange(0, 384))[0, 0]
    assert torch.equal(extents.dense_row_extents(allowed), _by_definition(allowed))


def test_a_float_comparison_decided_only_within_rounding_is_left_to_the_mask(monkeypatch):
    """Distances 9 to 23 hold by exact arithmetic (9 * 0.7 >= 6.3) but not as torch computes
    them: the block is not FULL. Integer masks never reach the rounding margin, and keep
    their FULL and EMPTY blocks."""
    decide, block = block_decider(float_distance, 1, 1), (Segment(16, 1, 8), Segment(0, 1, 8))
    allowed = evaluate_mask(float_distance, 1, 1, block[0].positions(), block[1].positions())
    assert decide(*block) is None and not allowed.all() and allowed.any()
    assert decide(Segment(17, 1, 8), Segment(0, 1, 8)) is True and decide(Segment(0, 1, 8), Segment(0, 1, 8)) is False
    half = block_decider(lambda b, h, q, kv: q.half() - kv.half() >= 1, 1, 1)  # 4097 is 4096 in float16
    assert half(Segment(4097, 1, 1), Segment(4096, 1, 1)) is None

    monkeypatch.setattr(ranges, "_widen", None)  # fails if called
    docs = mods.document(mods.document_ids([16, 16]))
    expected = [(mods.causal, 8, 0, True), (mods.causal, 0, 8, False), (mods.sliding_window(16), 8, 0, True),
                (mods.sliding_window(4), 16, 0, False), (mods.prefix_lm(16), 0, 8, True), (mods.prefix_lm(8), 0, 8, False),
                (docs, 8, 0, True), (docs, 16, 0, False), (mods.image_neighbourhood(16, 32, 2), 160, 0, False)]
    for mask_mod, q_start, kv_start, kind in expected:
        assert block_decider(mask_mod, 1, 1)(Segment(q_start, 1, 8), Segment(kv_start, 1, 8)) is kind
    image = block_decider(mods.image_neighbourhood(16, 32, 2), 1, 1)
    assert image(Segment(138, 1, 2), Segment(138, 1, 2)) is True


@pytest.mark.parametrize("name", ["bool_sum", "uint8_distance", "int16_scaled", "int64_scaled", "int_mask",
                                  "exp_growth", "int32_wraps"])
def test_block_decisions_follow_torchs_integer_arithmetic(name):
    """A block decided FULL or EMPTY from ranges is so where the mask is evaluated: bool + bool
    is True + True = True, -1 as uint8 is 255, an int32 product wraps past 2**31 (undecided
    then), exp overflows to inf."""
    mask_mod = {**MASKS, "exp_growth": lambda b, h, q, kv: torch.exp((kv - q).float()) < 0.5,
                "int32_wraps": lambda b, h, q, kv: q * 3_000_000 >= kv * 3_000_000}[name]
    decide = block_decider(mask_mod, 1, 1)
    for q_start, kv_start in [(16, 0), (0, 16), (24, 8), (1000, 0), (800, 900), (5000, 4000), (0, 1000)]:
        q_seg, kv_seg = Segment(q_start, 1, 16), Segment(kv_start, 1, 16)
        allowed = evaluate_mask(mask_mod, 1, 1, q_seg.positions(), kv_seg.positions())
        verdict = decide(q_seg, kv_seg)
        assert verdict is None or (bool(allowed.all()) if verdict else not allowed.any()), (q_seg, kv_seg)


def _float_distance_errors(rank, world_size, layout):
    """Worst absolute error of output and q/k/v gradients on this rank, against one process."""
    torch.manual_seed(0)
    seq_len = 8 * world_size
    q, k, v, dout = (torch.randn(1, 2, seq_len, 8, dtype=torch.float64) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention(*full, mask_mod=float_distance)
    expected.backward(dout)
    local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = ringflex.ring_flex_attention(*local, mask_mod=float_distance, layout=layout, backend="reference")
    out.backward(ringflex.shard(dout, 2, layout=layout))
    return [(got - ringflex.shard(want, 2, layout=layout)).abs().max().item()
            for got, want in zip([out] + [t.grad for t in local], [expected] + [t.grad for t in full])]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_with_a_float_mask_matches_single_process(world_size, layout):
    for rank, errors in enumerate(run_world(world_size, _float_distance_errors, layout)):
        assert max(errors) < 1e-10, (rank, errors)


def test_new_document_ids_that_take_a_freed_tensors_id_are_planned_anew(monkeypatch):
    """Packed batches of one length, each freed before the next, often give the new ids the old
    ids' address and id (version 0 both): the cached extents and exact plans were the old
    batch's (6 of 20 steps in an audit; over 2 ranks one rank planned the other's documents and
    the ring aborted in gloo or hung). Here every tensor takes the same id in the keys."""
    from ringflex.kernels.base import Mods
    from ringflex.kernels.cudnn import blocks

    def same_id_for_all(mask, *rest):
        return (mask.structure, tuple((0, t._version) for t in mask.tensors())) + rest

    monkeypatch.setattr(extents, "mask_key", same_id_for_all)
    monkeypatch.setattr(blocks, "mask_key", same_id_for_all)
    q_seg, kv_seg = Segment(128, 1, 128), Segment(0, 1, 128)  # rank 1's queries, rank 0's keys: 2 ranks, contiguous
    for lengths in ([250, 6], [60, 60, 136], [250, 6]):
        mask_mod = mods.document(mods.document_ids(lengths))
        mask = trace_mask_mod(mask_mod, "cpu")
        truth = mask_mod(0, 0, q_seg.positions("cpu")[:, None], kv_seg.positions("cpu")[None])
        assert torch.equal(extents.row_extents(mask_mod, mask, q_seg, kv_seg, "cpu")[3].long(), truth.sum(1))
        fresh = blocks._grouped_runs(extents._row_extents(mask_mod, mask, q_seg, kv_seg, "cpu"))
        assert blocks.exact_runs(Mods(None, mask_mod), mask, q_seg, kv_seg, "cpu") == fresh
