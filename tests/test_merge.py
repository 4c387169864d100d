"""Accumulating hop results (``ringflex.kernels.merge``): every row is summed or merged in
fp32 in the order its parts arrive and rounded once, whatever the row ranges of the parts."""
import math

import pytest
import torch

from ringflex.kernels.merge import RowMerge, RowSum

LENGTH = 16
# Row ranges of the parts, in arrival order: nested, overlapping, repeated, one row, gaps.
RANGES = [
    [(0, 16)],
    [(0, 16), (8, 16)],
    [(8, 16), (0, 16), (0, 8)],
    [(0, 4), (2, 10), (2, 10), (9, 10), (0, 16)],
    [(4, 12)],  # rows 0:4 and 12:16 get no part
    [(0, 12), (4, 16), (2, 8)],  # rows 4:8 get three parts, the last not whole
    [],
]


def _parts(ranges, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, b - a, 5, generator=g).to(dtype) for a, b in ranges]


def _summed(ranges, parts, acc=torch.float32):
    """The parts' sum over their rows in ``acc``, in arrival order."""
    want = torch.zeros(2, 3, LENGTH, 5, dtype=acc)
    for (a, b), p in zip(ranges, parts):
        want[:, :, a:b] += p.to(acc)
    return want


@pytest.mark.parametrize("ranges", RANGES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_sum_rounds_once(ranges, dtype):
    parts = _parts(ranges, dtype)
    want = _summed(ranges, parts)
    total = RowSum([want.shape], dtype, torch.float32, "cpu", ranges)
    for r, p in zip(ranges, parts):
        total.add(r, p)
    (got,) = total.result()
    assert got.dtype == dtype
    assert torch.equal(got, want.to(dtype))


def _half_ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Half the spacing of bfloat16 numbers at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 8)


@pytest.mark.parametrize("ranges", RANGES)
def test_row_merge_rounds_once(ranges):
    """Against the exact (fp64) merge: the output is off by at most half a bfloat16 step (one
    rounding) plus fp32 noise, and rows no part reached are 0 with lse -inf."""
    outs = _parts(ranges, torch.bfloat16)
    lses = [torch.randn(2, 3, b - a, generator=torch.Generator().manual_seed(i)) for i, (a, b) in enumerate(ranges)]
    if ranges:
        lses[0][0, 0, 0], outs[0][0, 0, 0] = -math.inf, 0.0  # a row of a part that saw no key
    weighted, magnitude = (torch.zeros(2, 3, LENGTH, 5, dtype=torch.float64) for _ in range(2))
    want_lse = torch.full((2, 3, LENGTH), -math.inf, dtype=torch.float64)
    for (a, b), s in zip(ranges, lses):
        want_lse[:, :, a:b] = torch.logaddexp(want_lse[:, :, a:b], s.double())
    for (a, b), o, s in zip(ranges, outs, lses):
        finite = torch.where(want_lse[:, :, a:b].isneginf(), 0.0, want_lse[:, :, a:b])
        term = torch.exp(s.double() - finite).unsqueeze(-1) * o.double()
        weighted[:, :, a:b] += term
        magnitude[:, :, a:b] += term.abs()
    merged = RowMerge((2, 3, LENGTH, 5), torch.bfloat16, torch.float32, "cpu", ranges)
    for r, o, s in zip(ranges, outs, lses):
        merged.add(r, o, s)
    out, lse, _ = merged.result()
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    fp32_noise = 2 ** -20 * magnitude  # the fp32 arithmetic, which matters only where terms cancel
    assert bool(((out.double() - weighted).abs() <= _half_ulp_bf16(weighted) + fp32_noise).all())
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(LENGTH, dtype=torch.bool)
    for a, b in ranges:
        untouched[a:b] = False
    assert bool((out[:, :, untouched] == 0).all()) and bool(lse[:, :, untouched].isneginf().all())


@pytest.mark.parametrize("adopted", [False, True])
def test_up_to_four_outputs_merge_in_one_pass(monkeypatch, adopted):
    """A ring's output over four ranks: its four hop results (the first adopted as the result
    where it can be) merge in one pass, with no fp32 buffer, to the exact merge rounded once."""
    from ringflex.kernels import merge

    passes = []
    real = merge.merge_parts
    monkeypatch.setattr(merge, "merge_parts", lambda d, parts, lse, res=None: passes.append(len(parts)) or
                        real(d, parts, lse, res))
    ranges = [(0, LENGTH)] * 4
    outs = _parts(ranges, torch.bfloat16)
    if not adopted:
        outs[0] = outs[0].float()  # not the result's dtype: kept as it came
    lses = [torch.randn(2, 3, LENGTH, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want_lse = torch.logsumexp(torch.stack([s.double() for s in lses]), 0)
    want = sum(o.double() * torch.exp(s.double() - want_lse).unsqueeze(-1) for o, s in zip(outs, lses))
    merged = RowMerge((2, 3, LENGTH, 5), torch.bfloat16, torch.float32, "cpu", ranges)
    for r, o, s in zip(ranges, outs, lses):
        merged.add(r, o, s.clone())
    out, lse, _ = merged.result()
    assert passes == [4] and merged.acc is None
    assert (out is outs[0]) == adopted
    assert bool(((out.double() - want).abs() <= _half_ulp_bf16(want) + 2 ** -20 * want.abs().max()).all())
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_a_first_output_over_every_row_becomes_the_merged_result():
    """The merge takes a first part over every row as its result (no copy of the rows only it
    covers) and merges the later parts into it: the same numbers as merging aside."""
    ranges = [(0, LENGTH), (4, 12)]
    outs = _parts(ranges, torch.bfloat16)
    lses = [torch.randn(2, 3, b - a, generator=torch.Generator().manual_seed(i)) for i, (a, b) in enumerate(ranges)]
    results = []
    for first in (outs[0].clone(), outs[0].clone().transpose(2, 3).contiguous().transpose(2, 3)):  # adopted, not
        merged = RowMerge((2, 3, LENGTH, 5), torch.bfloat16, torch.float32, "cpu", ranges)
        merged.add(ranges[0], first, lses[0].clone())
        merged.add(ranges[1], outs[1], lses[1])
        out, lse, _ = merged.result()
        assert (out is first) == first.is_contiguous()
        results.append((out, lse))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("first", [(0, LENGTH), (0, 8)])  # adopted as the result, or kept as it came
def test_parts_whose_lse_is_huge_merge_by_what_it_could_not_hold(first):
    """Rows whose every score is -1e30 in both parts, 3 keys in one and 5 in the other: each
    lse is -1e30 alone and its res log 3 or log 5; the merge weighs the parts 3 : 5 (not 1 : 1)
    and keeps -1e30 with res log 8. Rows only the second part reached keep its res."""
    a, b = torch.randn(2, 3, LENGTH, 5), torch.randn(2, 3, LENGTH, 5)
    lse = torch.full((2, 3, LENGTH), -1e30)
    merged = RowMerge((2, 3, LENGTH, 5), torch.float32, torch.float32, "cpu", [first, (0, LENGTH)])
    part_a = [t[:, :, first[0]:first[1]].clone() for t in (a, lse, torch.full_like(lse, math.log(3)))]
    merged.add(first, *part_a)
    merged.add((0, LENGTH), b.clone(), lse.clone(), torch.full_like(lse, math.log(5)))
    out, got_lse, res = merged.result()
    both = slice(*first)
    torch.testing.assert_close(out[:, :, both], (3 * a + 5 * b)[:, :, both] / 8)
    torch.testing.assert_close(res[:, :, both], torch.full_like(res[:, :, both], math.log(8)))
    assert torch.equal(got_lse, lse)
    assert torch.equal(out[:, :, first[1]:], b[:, :, first[1]:])
    assert torch.equal(res[:, :, first[1]:], torch.full_like(res[:, :, first[1]:], math.log(5)))


def test_one_part_covering_everything_is_the_result():
    part = torch.randn(1, 2, LENGTH, 4, dtype=torch.bfloat16)
    total = RowSum([part.shape], torch.bfloat16, torch.float32, "cpu", [(0, LENGTH)])
    total.add((0, LENGTH), part)
    assert total.result()[0] is part


def _row_sum(ranges, parts) -> RowSum:
    """A bf16 RowSum of ``parts`` over ``ranges``, added in order."""
    total = RowSum([(2, 3, LENGTH, 5)], torch.bfloat16, torch.float32, "cpu", ranges)
    for r, p in zip(ranges, parts):
        total.add(r, p)
    return total


def test_the_last_part_over_every_row_becomes_the_result():
    """A last part that covers every row is taken as the result and the parts before it are
    added into it (no copy of the rows only it covers); same values as summing aside."""
    ranges = [(0, 8), (4, 12), (0, LENGTH)]
    parts = _parts(ranges, torch.bfloat16)
    want = _summed(ranges, parts)
    (got,) = _row_sum(ranges, parts).result()
    assert got is parts[-1] and torch.equal(got, want.to(torch.bfloat16))


@pytest.mark.parametrize("whole_last", [False, True])
def test_three_parts_are_summed_in_one_pass_after_a_part_written_in_place(whole_last):
    """A part written into the result (``destination``) and two more: the second is kept as it
    came and the third sums all three into the result, whether or not it covers every row."""
    ranges = [(0, 8), (4, 12), (0, LENGTH) if whole_last else (2, 6)]
    parts = _parts(ranges, torch.bfloat16)
    want = _summed(ranges, parts)
    total = RowSum([want.shape], torch.bfloat16, torch.float32, "cpu", ranges)
    (into,) = total.destination(ranges[0])
    into.copy_(parts[0])
    total.add(ranges[0], into)
    for r, p in zip(ranges[1:], parts[1:]):
        total.add(r, p)
    assert total.acc is None  # nothing widened into fp32 buffers
    (got,) = total.result()
    assert got.data_ptr() == into.data_ptr() and torch.equal(got, want.to(torch.bfloat16))


@pytest.mark.parametrize("count", [4, 5, 8])
def test_up_to_four_parts_are_summed_in_one_pass(monkeypatch, count):
    """Parts of the same rows are kept as they came up to three, and the fourth sums all four
    in one pass (a ring's dq over four ranks: no fp32 buffer); more parts go to an fp32 sum
    of the first four, kept with up to two more until a pass can take four. Bit for bit the
    sum in arrival order, rounded once."""
    from ringflex.kernels import merge

    passes = []
    real = merge.sum_parts
    monkeypatch.setattr(merge, "sum_parts", lambda d, parts, acc: passes.append((len(parts), d.dtype)) or
                        real(d, parts, acc))
    ranges = [(0, LENGTH)] * count
    parts = _parts(ranges, torch.bfloat16)
    want = _summed(ranges, parts)  # before the last part becomes the sum
    total = _row_sum(ranges, parts)
    (got,) = total.result()
    assert torch.equal(got, want.to(torch.bfloat16))
    if count == 4:
        assert passes == [(4, torch.bfloat16)] and total.acc is None and got is parts[-1]
    elif count == 5:
        assert passes == [(4, torch.float32), (2, torch.bfloat16)]
    else:
        assert passes == [(4, torch.float32), (4, torch.float32), (2, torch.bfloat16)]


@pytest.mark.parametrize("last", ["a view", "another dtype", "not last"])
def test_a_part_that_cannot_be_the_result_is_summed_aside(last):
    ranges = [(0, 8), (0, LENGTH)] if last != "not last" else [(0, LENGTH), (0, 8)]
    parts = _parts(ranges, torch.bfloat16)
    if last == "a view":
        parts[-1] = torch.randn(2, 3, 5, LENGTH).to(torch.bfloat16).transpose(2, 3)
    if last == "another dtype":
        parts[-1] = parts[-1].float()
    total = RowSum([(2, 3, LENGTH, 5)], torch.bfloat16, torch.float32, "cpu", ranges)
    for r, p in zip(ranges, parts):
        total.add(r, p)
    (got,) = total.result()
    assert all(got is not p for p in parts) and torch.equal(got, _summed(ranges, parts).to(torch.bfloat16))


def test_parts_must_be_announced():
    total = RowSum([(1, 1, LENGTH, 2)], torch.float32, torch.float32, "cpu", [(0, 8)])
    with pytest.raises(ValueError, match="not announced"):
        total.add((0, 4), torch.zeros(1, 1, 4, 2))
    total.add((0, 8), torch.zeros(1, 1, 8, 2))
    with pytest.raises(ValueError, match="already complete"):
        total.add((0, 8), torch.zeros(1, 1, 8, 2))
    missing = RowSum([(1, 1, LENGTH, 2)], torch.float32, torch.float32, "cpu", [(0, 8)])
    with pytest.raises(RuntimeError, match="before all"):
        missing.result()


@pytest.mark.parametrize("seed", range(20))
def test_random_row_ranges(seed):
    """Random ranges (aligned or not, overlapping, repeated), random arrival order, fp64 and
    bf16 parts: sums are the fp32 (fp64) sums rounded once; merges within half a bf16 step."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (), generator=g))
    ranges = []
    for _ in range(n):
        a = int(torch.randint(0, LENGTH, (), generator=g))
        ranges.append((a, int(torch.randint(a + 1, LENGTH + 1, (), generator=g))))
    for dtype, acc in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        parts = _parts(ranges, dtype, seed)
        want = _summed(ranges, parts, acc)
        total = RowSum([want.shape], dtype, acc, "cpu", ranges)
        for r, p in zip(ranges, parts):
            total.add(r, p)
        assert torch.equal(total.result()[0], want.to(dtype))
    test_row_merge_rounds_once(ranges)


@pytest.mark.parametrize("ranges", RANGES)
def test_parts_written_in_place_give_the_same_result(ranges):
    """A kernel may write a part straight into the result (``destination``) where no part
    reached those rows yet; the result is bit for bit the one of parts added as they came."""
    outs = _parts(ranges, torch.bfloat16)
    lses = [torch.randn(2, 3, b - a, generator=torch.Generator().manual_seed(i)) for i, (a, b) in enumerate(ranges)]
    results = []
    for in_place in (False, True):
        total = RowSum([(2, 3, LENGTH, 5)], torch.bfloat16, torch.float32, "cpu", ranges)
        merged = RowMerge((2, 3, LENGTH, 5), torch.bfloat16, torch.float32, "cpu", ranges)
        for r, o, s in zip(ranges, outs, lses):
            into = total.destination(r) if in_place else None
            total.add(r, *(into[0].copy_(o),) if into else (o.clone(),))  # parts are handed over
            into = merged.destination(r) if in_place else None
            merged.add(r, *(into[0].copy_(o), into[1].copy_(s)) if into else (o.clone(), s.clone()))
        results.append([*total.result(), *merged.result()[:2]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_one_call_over_several_spans_writes_in_place_until_a_span_has_a_part():
    """``targets``: a call that writes several row spans at once (a ragged batch) gets the
    result's own tensors while none of the spans has a part yet, and fresh tensors after."""
    spans = [(0, 4), (8, 12)]
    total = RowSum([(2, 3, LENGTH, 5)], torch.float32, torch.float32, "cpu", spans + [(8, 16)])
    whole, parts = total.targets(spans)
    assert whole is total.out and parts[1][0].data_ptr() == whole[0][:, :, 8].data_ptr()
    made = []  # what the merge's allocator handed out
    allocate = lambda shape, dtype, device: made.append(torch.zeros(shape, dtype=dtype, device=device)) or made[-1]  # noqa: E731
    merged = RowMerge((2, 3, LENGTH, 5), torch.float32, torch.float32, "cpu", [(8, 16)] + spans, allocate)
    merged.add((8, 16), torch.ones(2, 3, 8, 5), torch.zeros(2, 3, 8))
    whole, parts = merged.targets(spans)
    fresh = made[-2:]  # allocated like the result's own, after them
    assert all(w is f for w, f in zip(whole, fresh)) and whole[0] is not merged.out[0]
    assert parts[1][1].data_ptr() == fresh[1][:, :, 8].data_ptr()


def test_merge_without_triton_says_so_once_and_merges_in_torch(monkeypatch, recwarn):
    """Where the fused merge and sum would apply (CUDA tensors) but triton cannot be imported,
    torch's passes run, and the slower path is named once."""
    from ringflex import config
    from ringflex.kernels import fused_merge, merge

    monkeypatch.setattr(fused_merge, "applies", lambda *tensors: True)
    monkeypatch.setattr(fused_merge, "sum_applies", lambda *tensors: True)
    monkeypatch.setattr(fused_merge, "available", lambda: False)
    monkeypatch.setattr(config, "_WARNED", set())
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(1, 2, 8, generator=g) for _ in range(2))
    want, want_lse = torch.empty_like(a), lse_a.clone()
    merge.merge_in_torch(want, [(a, want_lse, None), (b, lse_b, None)], want_lse)
    for _ in range(2):
        d, lse = torch.empty_like(a), lse_a.clone()
        merge.merge_parts(d, [(a, lse, None), (b, lse_b, None)], lse)
        assert torch.equal(d, want) and torch.equal(lse, want_lse)
        merge.sum_parts(d, [a, b, want], torch.float32)
        assert torch.equal(d, a + b + want)
    assert [str(w.message) for w in recwarn].count(
        "ringflex: triton is not installed, so hop results merge and gradient parts sum in torch passes instead of "
        "one fused kernel each (slower); torch's CUDA builds ship it: pip install triton") == 1


def test_passes_over_row_views_go_to_the_fused_kernel(monkeypatch):
    """Where the fused kernel applies (CUDA tensors), two parts over rows of a block and rows
    copied to send go to it, as torch's kernels take twice as long over such views; two whole
    tensors keep torch's add, which is as fast."""
    from ringflex.kernels import fused_merge, merge

    calls = []
    monkeypatch.setattr(fused_merge, "sum_applies", lambda d, parts: True)
    monkeypatch.setattr(fused_merge, "available", lambda: True)
    monkeypatch.setattr(fused_merge, "add", lambda d, parts: calls.append(len(parts)) or d.copy_(sum(parts)))
    whole = [torch.randn(1, 2, 16, 4) for _ in range(2)]
    views = [t.narrow(2, 8, 8) for t in whole]
    merge.sum_parts(torch.empty(1, 2, 16, 4), whole, torch.float32)
    assert calls == []
    merge.sum_parts(views[1], views, torch.float32)
    copy = merge.contiguous_rows(views[0])
    assert calls == [2, 1] and copy.is_contiguous() and torch.equal(copy, views[0])
    assert merge.contiguous_rows(whole[0]) is whole[0]


def test_a_blocks_dk_and_dv_go_to_the_fused_kernel_together(monkeypatch):
    """Where the fused kernel runs (a GPU), each sum of a block's dK over some rows goes to it
    with dV's sum over the same rows beside it, one launch for both: here the own block's
    gradient from two shares and its own hops' (two row ranges, so two launches); torch's add
    where two whole tensors meet, as before."""
    from ringflex.kernels import fused_merge

    launches = []

    def add(d, parts, beside=None):
        launches.append(beside is not None)
        for dest, summed in [(d, parts)] + ([beside] if beside is not None else []):
            dest.copy_(sum(p.double() for p in summed))
    monkeypatch.setattr(fused_merge, "available", lambda: True)
    monkeypatch.setattr(fused_merge, "sum_applies", lambda d, parts: True)  # as on a GPU
    monkeypatch.setattr(fused_merge, "add", add)
    shape, ranges = (1, 2, LENGTH, 4), [(0, 4), (12, 16)]
    g = torch.Generator().manual_seed(0)
    shares = [(r, *(torch.randn(1, 2, r[1] - r[0], 4, generator=g) for _ in range(2))) for r in ranges]
    own = [torch.randn(shape, generator=g) for _ in range(2)]
    want = [o.double() for o in own]
    for (lo, hi), dk, dv in shares:
        for w, part in zip(want, (dk, dv)):
            w[:, :, lo:hi] += part.double()
    total = RowSum([shape, shape], torch.float32, torch.float32, "cpu", ranges + [(0, LENGTH)])
    for r, dk, dv in shares:
        total.add(r, dk, dv, reused=True)
    total.add((0, LENGTH), *own)
    assert launches == [True, True]
    assert all(torch.allclose(got, w.float()) for got, w in zip(total.result(), want))
    launches.clear()
    whole = RowSum([shape, shape], torch.float32, torch.float32, "cpu", [(0, LENGTH)] * 2)
    for _ in range(2):
        whole.add((0, LENGTH), *(torch.randn(shape, generator=g) for _ in range(2)))
    whole.result()
    assert launches == []


def test_rows_apart_of_two_row_ranges_of_the_same_tensors():
    """Two ranges of rows that one launch takes: every tensor of the second lies the same number
    of rows after its counterpart in the first, in memory of the same strides, past its rows."""
    from ringflex.kernels.fused_merge import rows_apart

    a, b = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8)
    first, second = [a[:, :, 2:7], b[:, :, 0:5]], [a[:, :, 20:26], b[:, :, 18:24]]
    assert rows_apart(first, second) == 18
    assert rows_apart(first, [a[:, :, 20:26], b[:, :, 19:25]]) is None  # not one number of rows
    assert rows_apart(first, [a[:, :, 4:9], b[:, :, 2:7]]) is None  # the ranges overlap
    assert rows_apart(first, [a[:, :, 20:26], b.transpose(1, 2).contiguous().transpose(1, 2)[:, :, 18:24]]) is None  # strides
    assert rows_apart([a[:, :, 20:26]], [a[:, :, 2:7]]) is None  # the second before the first
    assert rows_apart([a[:, :, 2:7], b[:, :, 0:5]], [a[:, :, 20:26], b[:, :, 18:24, :4]]) is None  # narrower rows
    assert rows_apart([a[:, :, 2:2]], [a[:, :, 20:26]]) is None  # an empty range


def test_a_joined_calls_two_row_ranges_merge_and_sum_in_one_launch(monkeypatch):
    """A step's joined kernel call gives its two hops' results as rows of one tensor: where the
    fused kernel runs (a GPU), the output merge of both (``add_each``) and the dq sum that the
    own block's gradient, adopted as the result, makes of them are one launch each, to the
    numbers of a pass each; parts added one at a time are a launch each."""
    from ringflex.kernels import fused_merge, merge

    launches = []

    def merged_in_torch(d, parts, lse, res=None, then=None):
        launches.append(("merge", then is not None))
        for job in [(d, parts, lse, res)] + ([then[1]] if then is not None else []):
            merge.merge_in_torch(*job)

    def summed_in_torch(d, parts, beside=None, then=None):
        launches.append(("sum", then is not None))
        for dest, summed in [(d, parts)] + (then[1] if then is not None else []):
            dest.copy_(sum(p.double() for p in summed))
    monkeypatch.setattr(fused_merge, "available", lambda: True)
    monkeypatch.setattr(fused_merge, "_in_rows_of_one_gpu", fused_merge._in_rows_of_elements)  # as on a GPU
    monkeypatch.setattr(fused_merge, "merge", merged_in_torch)
    monkeypatch.setattr(fused_merge, "add", summed_in_torch)
    g = torch.Generator().manual_seed(0)
    ranges = [(0, 4), (10, 14)]
    joined = torch.randn(2, 3, LENGTH, 5, generator=g)  # the joined call's rows 0:4 and 10:14 (hops'), and unread ones
    joined_lse = torch.randn(2, 3, LENGTH, generator=g)
    own, own_lse = torch.randn(2, 3, LENGTH, 5, generator=g), torch.randn(2, 3, LENGTH, generator=g)
    for together in (True, False):
        launches.clear()
        merged = RowMerge((2, 3, LENGTH, 5), torch.float32, torch.float32, "cpu", [(0, LENGTH)] + ranges)
        merged.add((0, LENGTH), own.clone(), own_lse.clone())
        parts = [(r, joined[:, :, r[0]:r[1]], joined_lse[:, :, r[0]:r[1]]) for r in ranges]
        if together:
            merged.add_each(parts)
        else:
            for part in parts:
                merged.add(*part)
        out, lse, _ = merged.result()
        assert launches == ([("merge", True)] if together else [("merge", False)] * 2)
        want_lse = own_lse.clone()
        for a, b in ranges:
            want_lse[:, :, a:b] = torch.logaddexp(own_lse[:, :, a:b], joined_lse[:, :, a:b])
        want = own * torch.exp(own_lse - want_lse).unsqueeze(-1)
        for a, b in ranges:
            want[:, :, a:b] += joined[:, :, a:b] * torch.exp(joined_lse[:, :, a:b] - want_lse[:, :, a:b]).unsqueeze(-1)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
    launches.clear()
    dq = RowSum([(2, 3, LENGTH, 5)], torch.float32, torch.float32, "cpu", ranges + [(0, LENGTH)])
    dq.add_each((r, joined[:, :, r[0]:r[1]]) for r in ranges)  # kept as they came
    dq.add((0, LENGTH), own.clone())  # adopted: the parts kept are summed into it, in one launch
    want = own.clone()
    for a, b in ranges:
        want[:, :, a:b] += joined[:, :, a:b]
    assert launches == [("sum", True)], launches
    torch.testing.assert_close(dq.result()[0], want)
