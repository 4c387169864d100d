"""The fused (Triton) log-sum-exp merge and sum of parts match torch and an fp64 oracle."""
import math

import pytest
import torch

from support.two_ranges import mismatches
from ringflex.kernels import fused_merge
from ringflex.kernels.merge import RowSum, contiguous_rows, merge_in_torch, merge_parts, sum_each, sum_parts



def _parts(dim, length, dtype_a, dtype_b):
    """Rows 3:3+length of larger tensors (views, as the ring merges them), lse with -inf rows."""
    g = torch.Generator(device="cuda").manual_seed(dim + length)
    make = lambda dtype: torch.randn(2, 3, length + 5, dim, device="cuda", generator=g).to(dtype).narrow(2, 3, length)  # noqa: E731
    lse = lambda: torch.randn(2, 3, length + 5, device="cuda", generator=g).mul(4).narrow(2, 3, length)  # noqa: E731
    a, b, lse_a, lse_b = make(dtype_a), make(dtype_b), lse(), lse()
    lse_a[:, :, ::7] = -math.inf  # only b sees keys
    lse_b[:, :, ::5] = -math.inf  # only a (and, every 35th row, neither)
    return a, b, lse_a, lse_b


def _oracle(a, b, lse_a, lse_b):
    merged = torch.logaddexp(lse_a.double(), lse_b.double())
    finite = torch.where(merged.isneginf(), 0.0, merged)
    out = a.double() * (lse_a.double() - finite).exp().unsqueeze(-1) + b.double() * (lse_b.double() - finite).exp().unsqueeze(-1)
    return out, merged


@pytest.mark.gpu
@pytest.mark.parametrize("dim,length", [(128, 1000), (64, 32), (80, 7)])
@pytest.mark.parametrize("dtypes", [("bf16", "bf16", "bf16"), ("fp16", "fp16", "fp16"), ("fp32", "fp32", "bf16"),
                                    ("bf16", "fp32", "bf16"), ("in place", "fp32", "bf16")])
def test_fused_merge_matches_torch_and_the_oracle(dim, length, dtypes):
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    out_name, a_name, b_name = dtypes
    a, b, lse_a, lse_b = _parts(dim, length, names[a_name], names[b_name])
    want, want_lse = _oracle(a, b, lse_a, lse_b)
    results = []
    for merge in (merge_parts, merge_in_torch):
        a_, lse_a_ = a.clone(), lse_a.clone()
        d = a_ if out_name == "in place" else torch.empty(a.shape, dtype=names[out_name], device="cuda")
        parts = [(a_, lse_a_, None), (b, lse_b, None)]
        assert fused_merge.applies(d, parts, lse_a_)
        merge(d, parts, lse_a_)
        results.append((d, lse_a_))
    (fused, fused_lse), (torch_out, torch_lse) = results
    assert fused_merge.available()
    torch.testing.assert_close(fused_lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert not fused.isnan().any()
    # rounded once from fp32 weights: as close to the oracle as the torch merge, within a unit of rounding
    err, torch_err = (fused.double() - want).abs().max().item(), (torch_out.double() - want).abs().max().item()
    assert err <= torch_err + 2 * torch.finfo(fused.dtype).eps * want.abs().max().item(), (err, torch_err)
    torch.testing.assert_close(fused, torch_out)


@pytest.mark.gpu
@pytest.mark.parametrize("with_res", ["both", "a", "b"])
def test_fused_merge_weighs_huge_lse_by_their_res(with_res):
    """Rows whose LSE is -1e30 in both parts (every score -1e30): the lse alone rounds the
    log-sums away, the res keeps them (log 3, log 5). Merged 3 : 5, lse -1e30, res log 8, as
    in torch; a part without res counts 1, and a missing res_a is not written."""
    a, b, lse_a, lse_b = _parts(64, 100, torch.bfloat16, torch.bfloat16)
    lse_a[:, :, :50], lse_b[:, :, :50] = -1e30, -1e30
    res_a, res_b = (torch.full_like(lse_a, math.log(n)) if with_res in ("both", side) else None
                    for n, side in ((3, "a"), (5, "b")))
    results = []
    for merge in (fused_merge.merge, merge_in_torch):
        d, lse, res = torch.empty_like(a), lse_a.clone(), None if res_a is None else res_a.clone()
        merge(d, [(a, lse, res), (b, lse_b, res_b)], lse, res)
        results.append((d, lse, res))
    (fused, fused_lse, fused_res), (torch_out, torch_lse, torch_res) = results
    weights = {"both": (3, 5), "a": (3, 1), "b": (1, 5)}[with_res]
    want = (weights[0] * a.double() + weights[1] * b.double())[:, :, :50] / sum(weights)
    torch.testing.assert_close(fused[:, :, :50].double(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused, torch_out)
    torch.testing.assert_close(fused_lse, torch_lse)
    assert torch.equal(fused_lse[:, :, :50], lse_a[:, :, :50])
    if res_a is not None:
        torch.testing.assert_close(fused_res, torch_res)
        torch.testing.assert_close(fused_res[:, :, :50], torch.full_like(fused_res[:, :, :50], math.log(sum(weights))))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [3, 4])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_merge_of_several_parts(count, in_place):
    """Three or four parts (row views, some rows seen by none, one part with a res) merge as
    torch merges them and within a rounding of the fp64 oracle; in place into the first part
    and its lse, as the ring's adopted first hop."""
    g = torch.Generator(device="cuda").manual_seed(count)
    length = 300
    parts = []
    for i in range(count):
        x = torch.randn(2, 3, length + 5, 128, device="cuda", generator=g).to(torch.bfloat16).narrow(2, 2, length)
        lse = torch.randn(2, 3, length, device="cuda", generator=g).mul(4)
        lse[:, :, i::(5 + i)] = -math.inf
        res = torch.randn(2, 3, length, device="cuda", generator=g).mul(0.01) if i == 1 else None
        parts.append((x, lse, res))
    lses = torch.stack([lse.double() + (0 if res is None else res.double()) for _, lse, res in parts])
    want_lse = torch.logsumexp(lses, 0)
    finite = torch.where(want_lse.isneginf(), 0.0, want_lse)
    want = sum(x.double() * torch.exp(l - finite).unsqueeze(-1) for (x, _, _), l in zip(parts, lses))
    results = []
    for merge in (fused_merge.merge, merge_in_torch):
        copies = [(x.clone(), lse.clone(), res) for x, lse, res in parts]
        d = copies[0][0] if in_place else torch.empty(parts[0][0].shape, dtype=torch.bfloat16, device="cuda")
        lse, res = copies[0][1], torch.zeros(2, 3, length, device="cuda")
        merge(d, copies, lse, res)
        results.append((d, lse, res))
    (fused, fused_lse, fused_res), (torch_out, torch_lse, torch_res) = results
    torch.testing.assert_close(fused, torch_out)
    torch.testing.assert_close(fused_lse + fused_res, torch_lse + torch_res)
    torch.testing.assert_close((fused_lse.double() + fused_res.double()), want_lse, rtol=1e-6, atol=1e-6)
    assert (fused.double() - want).abs().max().item() <= 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()


@pytest.mark.gpu
def test_fused_merge_of_more_rows_than_one_launch_takes(monkeypatch):
    """Beyond 65535 row blocks (2M rows) the merge launches on consecutive row ranges."""
    monkeypatch.setattr(fused_merge, "_MAX_ROWS", 64)
    a, b, lse_a, lse_b = _parts(128, 1000, torch.bfloat16, torch.bfloat16)
    want, want_lse = _oracle(a, b, lse_a, lse_b)
    d = torch.empty(a.shape, dtype=torch.bfloat16, device="cuda")
    fused_merge.merge(d, [(a, lse_a, None), (b, lse_b, None)], lse_a)
    torch.testing.assert_close(lse_a.double(), want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d, want.to(torch.bfloat16))


def _compiled(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(cache[0]) for cache in caches.values())


@pytest.mark.gpu
def test_fused_merge_compiles_once_for_any_rows():
    """Packed batches merge row spans of every length at every offset: one compiled kernel
    serves them all (a new specialisation would take tens of ms in a training step)."""
    kernel = fused_merge._kernels()[0]
    seen = None
    for length in range(1, 40):
        a, b, lse_a, lse_b = _parts(128, length, torch.bfloat16, torch.bfloat16)
        want, _ = _oracle(a, b, lse_a, lse_b)
        d = torch.empty(a.shape, dtype=torch.bfloat16, device="cuda")
        fused_merge.merge(d, [(a, lse_a, None), (b, lse_b, None)], lse_a)
        torch.testing.assert_close(d, want.to(torch.bfloat16))
        seen = _compiled(kernel) if seen is None else seen
    assert _compiled(kernel) == seen


@pytest.mark.gpu
@pytest.mark.parametrize("dim,length", [(128, 1000), (64, 32), (80, 7)])
@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("into", ["bf16", "fp32", "in place"])
def test_fused_sum_rounds_once(dim, length, count, into):
    """Two to four bf16 parts (row views, as the ring sums them), summed in fp32 and rounded
    once: into a bf16 result, an fp32 accumulator, or the last part itself; the torch path
    gives the same numbers."""
    names = {"bf16": torch.bfloat16, "fp32": torch.float32}
    g = torch.Generator(device="cuda").manual_seed(dim + length + count)
    parts = [torch.randn(2, 3, length + 5, dim, device="cuda", generator=g).to(torch.bfloat16).narrow(2, 3, length)
             for _ in range(count)]
    want = sum(p.double() for p in parts)
    in_torch = torch.empty(parts[0].shape, dtype=names.get(into, torch.bfloat16))
    sum_parts(in_torch, [p.cpu() for p in parts], torch.float32)  # on the CPU: the torch path
    d = parts[-1] if into == "in place" else torch.empty(parts[0].shape, dtype=names[into], device="cuda")
    assert fused_merge.sum_applies(d, parts)
    fused_merge.add(d, parts)
    assert torch.equal(d.cpu(), in_torch), "the torch path"
    # rounded once: to the nearest bf16 of the exact sum (bf16 parts sum exactly in fp32 unless
    # their exponents lie far apart, which only an fp32 result shows)
    torch.testing.assert_close(d.cpu(), want.cpu().to(d.dtype), rtol=0 if d.dtype == torch.bfloat16 else 1e-6,
                               atol=0 if d.dtype == torch.bfloat16 else 1e-6)


@pytest.mark.gpu
def test_fused_sum_of_more_rows_than_one_launch_takes(monkeypatch):
    monkeypatch.setattr(fused_merge, "_MAX_ROWS", 64)
    parts = [torch.randn(1, 2, 1000, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
    d = torch.empty_like(parts[0])
    sum_parts(d, parts, torch.float32)
    torch.testing.assert_close(d, sum(p.float() for p in parts).to(torch.bfloat16), rtol=0, atol=0)


def _launches_of(monkeypatch, kernel: int) -> list:
    """Records each launch of the fused kernel ``kernel`` (0 merge, 1 sum, 2 two sums) from now on."""
    launcher, seen = fused_merge._kernels()[kernel], []
    real = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda *args: seen.append(args) or real(*args))
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("dims,length", [((128, 128), 1000), ((192, 128), 33), ((64, 80), 7)])
def test_two_sums_in_one_launch(monkeypatch, count, dims, length):
    """A block's dK and dV (head dims apart, dK's parts in fp32 as with the LSE's share, dV's
    in bf16; rows of larger tensors) summed by one launch: bit for bit each sum alone."""
    g = torch.Generator(device="cuda").manual_seed(count + length)
    parts = [[torch.randn(2, 3, length + 5, dim, device="cuda", generator=g).to(dtype).narrow(2, 2, length)
              for _ in range(count)] for dim, dtype in zip(dims, (torch.float32, torch.bfloat16))]
    alone = [torch.empty(p[0].shape, dtype=torch.bfloat16, device="cuda") for p in parts]
    for d, p in zip(alone, parts):
        fused_merge.add(d, p)
    together = [torch.empty_like(d) for d in alone]
    pairs, singles = _launches_of(monkeypatch, 2), _launches_of(monkeypatch, 1)
    assert fused_merge.pair_applies((together[0], parts[0]), (together[1], parts[1]))
    sum_each(list(zip(together, parts)), torch.float32)
    assert (len(pairs), len(singles)) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


@pytest.mark.gpu
def test_sums_that_one_launch_cannot_take_together_go_apart(monkeypatch):
    """Different rows or part counts: a launch each; two whole tensors: torch's add each."""
    a, b = (torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = torch.randn(1, 2, 80, 128, device="cuda", dtype=torch.bfloat16).narrow(2, 8, 64)
    pairs, singles = _launches_of(monkeypatch, 2), _launches_of(monkeypatch, 1)
    sum_each([(torch.empty_like(a), [a, rows]), (torch.empty_like(a), [a, rows, b])], torch.float32)
    sum_each([(torch.empty_like(a), [a, rows]), (torch.empty(1, 2, 32, 128, device="cuda"), [a[:, :, :32]] * 2)],
             torch.float32)
    sum_each([(torch.empty_like(a), [a, b]), (torch.empty_like(a), [b, a])], torch.float32)
    assert (len(pairs), len(singles)) == (0, 4)
    assert not fused_merge.pair_applies((a, [a, rows]), (a, [a, rows, b]))


@pytest.mark.gpu
def test_a_blocks_dk_and_dv_sum_in_one_launch_per_rows(monkeypatch):
    """The own block's gradient in backward: shares over two row ranges, then the own hops'
    gradient over every row. The sum of each range's dK and dV is one launch, so two in all."""
    shape = (1, 4, 256, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda n: torch.randn(*shape[:2], n, shape[3], device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    ranges = [(0, 64), (192, 256)]
    shares = [(r, make(r[1] - r[0]), make(r[1] - r[0])) for r in ranges]
    own = (make(256), make(256))
    want = [o.double().clone() for o in own]
    for (lo, hi), dk, dv in shares:
        for w, part in zip(want, (dk, dv)):
            w[:, :, lo:hi] += part.double()
    pairs, singles = _launches_of(monkeypatch, 2), _launches_of(monkeypatch, 1)
    total = RowSum([shape, shape], torch.bfloat16, torch.float32, "cuda", ranges + [(0, 256)])
    for r, dk, dv in shares:
        total.add(r, dk, dv, reused=True)
    total.add((0, 256), *own)
    got = total.result()
    assert (len(pairs), len(singles)) == (2, 0)
    assert all(torch.equal(a, w.to(torch.bfloat16)) for a, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_copied_contiguous_by_the_fused_kernel(dtype):
    """A block's rows copied to send: bit for bit torch's copy, values that do not fit a
    narrower dtype included; a contiguous tensor is sent as it is."""
    whole = torch.randn(2, 3, 100, 80, device="cuda").mul(1e4).to(dtype)
    whole[0, 0, 40, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    view = whole.narrow(2, 37, 50)
    copy = contiguous_rows(view)
    assert copy.is_contiguous() and torch.equal(copy.nan_to_num(), view.contiguous().nan_to_num())
    assert copy[0, 0, 3, 2].isnan() and contiguous_rows(copy) is copy
    lse = torch.randn(2, 3, 100, device="cuda").narrow(2, 37, 50)  # [B, H, L]: torch copies it
    assert torch.equal(contiguous_rows(lse), lse.contiguous())


@pytest.mark.gpu
def test_direct_launches_match_the_jit_for_every_specialisation():
    """After the first launch of a specialisation, the kernels launch through the compiled
    launcher (``kernels.launch``): the same sums as the JIT, for aligned and unaligned rows
    (a pointer's alignment is part of what Triton compiles for) and for new lengths and strides."""
    adder = fused_merge._kernels()[1]
    adder.compiled.clear()
    for offset, length in [(0, 64), (0, 64), (1, 64), (1, 64), (0, 100), (3, 37)]:
        shape = (2, 3, length, 64)
        flat = torch.randn(math.prod(shape) + 8, device="cuda", dtype=torch.bfloat16)
        a = flat[offset:offset + math.prod(shape)].view(shape)  # offset 1 or 3: not 16-byte aligned
        b = torch.randn(2, 3, length + 5, 64, device="cuda", dtype=torch.bfloat16).narrow(2, 2, length)  # rows
        d = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        fused_merge.add(d, [a, b])
        assert torch.equal(d, (a.float() + b.float()).to(d.dtype))
    # one compiled kernel per specialisation (aligned and unaligned rows): the launches after
    # the first of each went straight to the launcher
    assert len(adder.compiled) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("ranges", [((3, 20), (50, 33)), ((0, 1), (1, 1000)), ((7, 64), (700, 64))])
def test_two_row_ranges_in_one_launch(ranges):
    """A joined call's results over two row ranges of the same tensors: the merge, the sum and
    the pair of sums over both in one launch, bit for bit as over each range alone."""
    g = torch.Generator(device="cuda").manual_seed(sum(n for r in ranges for n in r))
    assert mismatches(ranges, (1, 2, 4), "cuda", g) == []
