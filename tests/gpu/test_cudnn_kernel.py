"""The cuDNN hop kernel matches the reference kernel, forward and backward, for every mod of
the matrix at global offsets and striped positions. The planning tests run on CPU too."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared test matrix lives in tests/
from cases import cases, make_inputs  # noqa: E402
from ringflex import mods
from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel, band_runs, cudnn_unavailable_reason, exact_runs, split_runs
from ringflex.kernels.reference import ReferenceKernel
from ringflex.plan import Segment, evaluate_mask
from ringflex.trace import diagonal_band, trace_mask_mod


def _cudnn_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cudnn  # noqa: F401
    except ImportError:
        return False
    return True


needs_cudnn = pytest.mark.skipif(not _cudnn_ready(), reason="needs a CUDA GPU and nvidia-cudnn-frontend")

L = 256  # local length of a hop
SEQ = 4 * L  # global length: the positions below stay inside it
SEGMENTS = {
    "diagonal": (Segment(0, 1, L), Segment(0, 1, L)),
    "offsets": (Segment(2 * L + 44, 1, L), Segment(L + 100, 1, L)),  # q later than kv, partly overlapping
    "striped": (Segment(3, 4, L), Segment(1, 4, L)),
    "striped_late_kv": (Segment(1, 4, L), Segment(2, 4, L)),  # every key one position after its query
}


def _case_inputs(case, dtype, head_dim=64, batch=2, seed=0):
    q, k, v, dout = make_inputs(case, SEQ, batch=batch, head_dim=head_dim, dtype=torch.float32, seed=seed)
    return [t[:, :, :L].to("cuda", dtype).contiguous() for t in (q, k, v, dout)]


def _err(got, want):
    """Largest error relative to the largest reference value, or absolute below 1 (bf16 keeps
    about 3 digits; a gradient that should be 0 is 1e-3-ish noise, not a relative error)."""
    got, want = got.float(), want.float()
    assert not got.isnan().any(), "NaN in the cuDNN result"
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite), "non-finite values differ"
    return ((got - want).abs()[finite].max() / want.abs()[finite].max().clamp_min(1.0)).item() if finite.any() else 0.0


def _check(name, case, q_seg, kv_seg, kernel, dtype=torch.bfloat16, head_dim=64, masked=True, tol=2e-2):
    q, k, v, dout = _case_inputs(case, dtype, head_dim)
    m = Mods(case.score_mod, case.mask_mod)
    scale = head_dim ** -0.5
    ref = ReferenceKernel()
    want_out, want_lse = ref.forward(q, k, v, q_seg, kv_seg, m, scale, masked)
    out, lse = kernel.forward(q, k, v, q_seg, kv_seg, m, scale, masked)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    errors = {"out": _err(out, want_out), "lse": (lse - want_lse).abs()[want_lse.isfinite()].max().item()
              if want_lse.isfinite().any() else 0.0}
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    # The backward gets the GLOBAL output and lse; here the hop is the whole row set.
    global_out = want_out.to(q.dtype)
    grads = kernel.backward(q, k, v, global_out, want_lse, dout, q_seg, kv_seg, m, scale, masked)
    want = ref.backward(q, k, v, global_out, want_lse, dout, q_seg, kv_seg, m, scale, masked)
    for label, g, w, t in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.shape == t.shape
        errors[label] = _err(g, w)
    print(f"{name}: " + " ".join(f"{k}={e:.2e}" for k, e in errors.items()))
    assert errors["lse"] < 0.02
    for label in ("out", "dq", "dk", "dv"):
        assert errors[label] < tol, f"{label} error {errors[label]:.3g}"


@needs_cudnn
@pytest.mark.parametrize("segs", sorted(SEGMENTS))
@pytest.mark.parametrize("name", sorted(cases(SEQ)))
def test_matches_reference(name, segs):
    case = cases(SEQ, device="cuda")[name]
    q_seg, kv_seg = SEGMENTS[segs]
    if case.kv_len_ratio != 1.0:
        kv_seg = Segment(kv_seg.start // 2, kv_seg.stride, L)
    _check(f"{name}/{segs}", case, q_seg, kv_seg, CudnnKernel(split_depth=1))


@needs_cudnn
@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("name", ["causal_softcap", "documents", "prefix_lm", "sliding_window"])
def test_split_depths(name, depth):
    case = cases(SEQ, device="cuda")[name]
    _check(f"{name}/depth{depth}", case, *SEGMENTS["offsets"], CudnnKernel(split_depth=depth))


@needs_cudnn
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_128_and_fp16(dtype):
    case = cases(SEQ, device="cuda")["causal_softcap"]
    _check(f"causal_softcap/d128/{dtype}", case, *SEGMENTS["diagonal"], CudnnKernel(), dtype=dtype, head_dim=128)


@needs_cudnn
def test_full_block_skips_the_mask():
    case = cases(SEQ, device="cuda")["alibi"]  # masked=False: the planner proved the block FULL
    _check("alibi/unmasked", case, *SEGMENTS["offsets"], CudnnKernel(), masked=False)


@needs_cudnn
def test_rows_without_keys_give_zero_not_nan():
    case = cases(SEQ, device="cuda")["late_queries"]
    q, k, v, dout = _case_inputs(case, torch.bfloat16)
    m = Mods(None, case.mask_mod)
    seg = Segment(0, 1, L)  # every query is in the first half: nothing is visible
    for kernel in (CudnnKernel(split_depth=0), CudnnKernel()):
        out, lse = kernel.forward(q, k, v, seg, seg, m, 0.125, True)
        assert torch.equal(out, torch.zeros_like(out)) and lse.isneginf().all()
        grads = kernel.backward(q, k, v, out, lse, dout, seg, seg, m, 0.125, True)
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@needs_cudnn
def test_graphs_are_reused_across_offsets():
    from ringflex.kernels import cudnn as module

    case = cases(SEQ, device="cuda")["causal_softcap"]
    kernel = CudnnKernel(split_depth=0)
    q, k, v, _ = _case_inputs(case, torch.bfloat16)
    m = Mods(case.score_mod, case.mask_mod)
    kernel.forward(q, k, v, Segment(0, 1, L), Segment(0, 1, L), m, 0.125, True)
    built = len(module._GRAPHS)
    for start in (L, 3 * L, 17):
        kernel.forward(q, k, v, Segment(start, 1, L), Segment(0, 1, L), m, 0.125, True)
    assert len(module._GRAPHS) == built


@needs_cudnn
def test_unavailable_reasons():
    q = torch.zeros(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    assert cudnn_unavailable_reason(q, q, q, Mods(mods.softcap(2.0), mods.causal)) is None
    assert "float16 or bfloat16" in cudnn_unavailable_reason(q.float(), q.float(), q.float(), Mods())
    assert "CUDA" in cudnn_unavailable_reason(q.cpu(), q.cpu(), q.cpu(), Mods())
    table = torch.zeros(64, 64, device="cuda")
    reason = cudnn_unavailable_reason(q, q, q, Mods(lambda s, b, h, qi, ki: s + table[qi, ki]))
    assert "no gather" in reason
    assert "sin" in cudnn_unavailable_reason(q, q, q, Mods(lambda s, b, h, qi, ki: torch.sin(s)))


def test_unavailable_without_cuda():
    q = torch.zeros(1, 2, 8, 8)
    assert "CUDA" in cudnn_unavailable_reason(q, q, q, Mods())


# ----------------------------------------------------------------------------- planning (CPU)

def _allowed(mask_mod, q_seg, kv_seg):
    return evaluate_mask(mask_mod, 1, 1, q_seg.positions(), kv_seg.positions())[0, 0]


def _band_keeps(run, n_q, n_k):
    """The elements a run computes (rows x cols, inside cuDNN's band if any)."""
    keep = torch.zeros(n_q, n_k, dtype=torch.bool)
    i = torch.arange(run.rows[1] - run.rows[0]).view(-1, 1)
    j = torch.arange(run.cols[1] - run.cols[0]).view(1, -1)
    inside = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if run.band is not None:
        left, right = run.band
        if right is not None:
            inside &= j <= i + right
        if left is not None:
            inside &= j >= i - (left - 1)
    keep[run.rows[0]:run.rows[1], run.cols[0]:run.cols[1]] = inside
    return keep


@pytest.mark.parametrize("mask_mod", [mods.causal, mods.sliding_window(7), lambda b, h, q, kv: q > kv,
                                      lambda b, h, q, kv: (kv - q <= 5) & (q - kv <= 2),
                                      lambda b, h, q, kv: q - kv >= 9], ids=["causal", "window", "strict",
                                                                          "two_sided", "far"])
def test_band_runs_compute_exactly_the_mask(mask_mod):
    band = diagonal_band(trace_mask_mod(mask_mod))
    for q_start in range(0, 60, 7):
        for kv_start in range(0, 60, 5):
            for stride in (1, 3):
                q_seg, kv_seg = Segment(q_start, stride, 20), Segment(kv_start, stride, 24)
                runs = band_runs(band, q_seg, kv_seg)
                allowed = _allowed(mask_mod, q_seg, kv_seg)
                if runs is None:  # the generic path takes it
                    continue
                assert len(runs) <= 1
                computed = _band_keeps(runs[0], 20, 24) if runs else torch.zeros_like(allowed)
                assert torch.equal(computed, allowed), (q_seg, kv_seg, runs)
                for run in runs:
                    if run.band is not None and run.band[0] is not None:
                        assert run.rows[1] - run.rows[0] <= run.cols[1] - run.cols[0]
                    assert run.band is None or run.band[1] is None or run.band[1] >= 0


def _coverage(runs, shape):
    """How often each pair is computed, and whether a call without a select computes it."""
    count = torch.zeros(shape, dtype=torch.int32)
    unmasked = torch.zeros(shape, dtype=torch.bool)
    for run in runs:
        keep = _band_keeps(run, *shape)
        count += keep.int()
        if not run.masked:
            unmasked |= keep
    return count, unmasked


DOC = mods.document_ids([100, 30, 200, 70, 112])
PLAN_MASKS = {"causal": mods.causal, "documents": mods.document(DOC), "prefix_lm": mods.prefix_lm(300),
              "late": lambda b, h, q, kv: (q >= 300) & (kv <= q)}


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(PLAN_MASKS))
def test_split_runs_cover_every_visible_pair_once(name, depth):
    mask_mod = PLAN_MASKS[name]
    q_seg, kv_seg = Segment(128, 1, 384), Segment(0, 1, 512)
    runs = split_runs(Mods(None, mask_mod), trace_mask_mod(mask_mod), 1, 1, q_seg, kv_seg, depth, "cpu")
    allowed = _allowed(mask_mod, q_seg, kv_seg)
    count, unmasked = _coverage(runs, allowed.shape)
    assert (count <= 1).all() and (count[allowed] == 1).all() and allowed[unmasked].all()
    assert len(runs) <= 1 << depth


@pytest.mark.parametrize("name", sorted(PLAN_MASKS))
def test_exact_runs_cover_every_visible_pair_once(name):
    mask_mod = PLAN_MASKS[name]
    for q_seg, kv_seg in [(Segment(128, 1, 384), Segment(0, 1, 512)), (Segment(1, 4, 128), Segment(2, 4, 128))]:
        runs = exact_runs(Mods(None, mask_mod), trace_mask_mod(mask_mod), q_seg, kv_seg, "cpu")
        allowed = _allowed(mask_mod, q_seg, kv_seg)
        count, unmasked = _coverage(runs, allowed.shape)
        assert (count <= 1).all() and (count[allowed] == 1).all() and allowed[unmasked].all()
        if q_seg.stride == 1:  # keys every row sees (here enough of them), then a causal band: no select
            assert not any(run.masked for run in runs)
