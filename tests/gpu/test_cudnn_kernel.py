"""The cuDNN hop kernel matches the reference kernel, forward and backward, for every mod of
the matrix at global offsets and striped positions. The planning tests, and the lowering on an
emulated cuDNN, run on CPU too."""
import dataclasses
import math
import warnings
import weakref
from typing import Tuple

import pytest
import torch

from support.cases import Case, cases, make_inputs
from support.emulated_cudnn import emulate, on_every_ring_call
from support.oracle import visible_extent
from test_numerics import score_ignoring_mods
from test_trace import EXTRA_SCORE_MODS
from ringflex import mods
from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel, cudnn_unavailable_reason
from ringflex.kernels.cudnn.blocks import Run, band_runs, exact_runs, plan, split_runs
from ringflex.kernels.cudnn.lowering import traced
from ringflex.kernels.reference import ReferenceKernel
from ringflex.mod.band import diagonal_band
from ringflex.mod.trace import trace_mask_mod
from ringflex.plan.blocks import evaluate_mask
from ringflex.plan.layout import Segment


def _cudnn_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cudnn  # noqa: F401
    except ImportError:
        return False
    return True


needs_cudnn = pytest.mark.skipif(not _cudnn_ready(), reason="needs nvidia-cudnn-frontend")

L = 256  # local length of a hop
SEQ = 4 * L  # global length: the positions below stay inside it
SEGMENTS = {
    "diagonal": (Segment(0, 1, L), Segment(0, 1, L)),
    "offsets": (Segment(2 * L + 44, 1, L), Segment(L + 100, 1, L)),  # q later than kv, partly overlapping
    "striped": (Segment(3, 4, L), Segment(1, 4, L)),
    "striped_late_kv": (Segment(1, 4, L), Segment(2, 4, L)),  # every key one position after its query
}

# Packed documents with boundaries 0, 200, 300, 350, 384, 444, 445, 512: several in one block,
# one that began in an earlier block, a one-token document.
def _packed(device="cpu", kv_heads=4):
    return Case(mask_mod=mods.document(mods.document_ids([200, 100, 50, 34, 60, 1, 67, 512], device=device)),
                q_heads=4, kv_heads=kv_heads)


PACKED = _packed()
PACKED_SEGMENTS = {
    "diagonal": (Segment(0, 1, L), Segment(0, 1, L)),  # two documents: one batch of causal runs
    "earlier": (Segment(L, 1, L), Segment(L // 2, 1, L)),  # a full run and three causal runs
    "one_token": (Segment(384, 1, L), Segment(384, 1, L)),  # three documents batched; the one-token run alone (by the reference kernel in bwd)
}
PACKED_CALLS = {"diagonal": (1, 1), "earlier": (2, 2), "one_token": (2, 1)}  # cuDNN calls, fwd / bwd


def _case_inputs(case, dtype, head_dim=64, batch=2, seed=0, bshd=False):
    """The case's q, k, v, dout on the GPU, in [B, H, S, D] memory or, with ``bshd``, in
    [B, S, H, D] memory (as models pass them: ``view(B, S, H, D).transpose(1, 2)``)."""
    q, k, v, dout = make_inputs(case, SEQ, batch=batch, head_dim=head_dim, dtype=torch.float32, seed=seed)
    tensors = [t[:, :, :L].to("cuda", dtype).contiguous() for t in (q, k, v, dout)]
    return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors] if bshd else tensors


def _err(got, want):
    """Largest error relative to the largest reference value, or absolute below 1 (bf16 keeps
    about 3 digits; a gradient that should be 0 is 1e-3-ish noise, not a relative error)."""
    got, want = got.float(), want.float()
    assert not got.isnan().any(), "NaN in the cuDNN result"
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite), "non-finite values differ"
    return ((got - want).abs()[finite].max() / want.abs()[finite].max().clamp_min(1.0)).item() if finite.any() else 0.0


def _check(name, case, q_seg, kv_seg, kernel, dtype=torch.bfloat16, head_dim=64, masked=True, tol=2e-2, batch=2,
           bshd=False):
    q, k, v, dout = _case_inputs(case, dtype, head_dim, batch, bshd=bshd)
    m = Mods(case.score_mod, case.mask_mod)
    scale = head_dim ** -0.5
    ref = ReferenceKernel()
    want_out, want_lse, _ = ref.forward(q, k, v, q_seg, kv_seg, m, scale, masked)
    out, lse, _ = kernel.forward(q, k, v, q_seg, kv_seg, m, scale, masked)
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
    assert errors["lse"] < 0.02, f"{name}: {errors}"
    for label in ("out", "dq", "dk", "dv"):
        assert errors[label] < tol, f"{name}: {label} error {errors[label]:.3g}"


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("segs", sorted(SEGMENTS))
@pytest.mark.parametrize("name", sorted(cases(SEQ)))
def test_matches_reference(name, segs):
    case = cases(SEQ, device="cuda")[name]
    q_seg, kv_seg = SEGMENTS[segs]
    if case.kv_len_ratio != 1.0:
        kv_seg = Segment(kv_seg.start // 2, kv_seg.stride, L)
    _check(f"{name}/{segs}", case, q_seg, kv_seg, CudnnKernel(split_depth=1))


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("name", ["causal_softcap", "documents", "prefix_lm", "sliding_window"])
def test_split_depths(name, depth):
    case = cases(SEQ, device="cuda")[name]
    _check(f"{name}/depth{depth}", case, *SEGMENTS["offsets"], CudnnKernel(split_depth=depth))


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("name", ["no_mask", "causal_softcap", "documents", "sliding_window"])
def test_deterministic_algorithms_make_the_backward_repeat_bitwise(name, monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` builds cuDNN's backward without atomics
    (its dQ otherwise differs from run to run in the last bits): the gradients repeat bit for
    bit, and still match the reference (plain, score_mod, ragged batch and band graphs)."""
    case = cases(SEQ, device="cuda")[name]
    q_seg, kv_seg = SEGMENTS["offsets"] if name != "documents" else PACKED_SEGMENTS["earlier"]
    if name == "documents":
        case = _packed("cuda")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    _check(f"{name}/deterministic", case, q_seg, kv_seg, CudnnKernel())
    q, k, v, dout = _case_inputs(case, torch.bfloat16, head_dim=128, batch=1)
    m, kernel = Mods(case.score_mod, case.mask_mod), CudnnKernel()
    out, lse, _ = kernel.forward(q, k, v, q_seg, kv_seg, m, 0.125, True)
    first = kernel.backward(q, k, v, out, lse, dout, q_seg, kv_seg, m, 0.125, True)
    for _ in range(3):
        again = kernel.backward(q, k, v, out, lse, dout, q_seg, kv_seg, m, 0.125, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("dims", [(160, 160), (192, 128), (256, 256), (256, 128), (224, 128), (64, 256)],
                         ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("name", ["no_mask", "causal", "sliding_window", "documents", "causal_softcap"])
def test_head_dims_up_to_256_match_reference(name, dims):
    """Query / key and value head dims up to 256, equal or not (an H100 runs them all). The
    ragged batch's backward with q/k 256 or 224 and v 128 came out wrong (dQ 0.2 off): such
    blocks take a call per document instead (``batches.ragged_applies``)."""
    d_qk, d_v = dims
    case = _packed("cuda") if name == "documents" else cases(SEQ, device="cuda")[name]
    q_seg, kv_seg = PACKED_SEGMENTS["earlier"] if name == "documents" else SEGMENTS["offsets"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, 4, L, d_qk, device="cuda", generator=g).bfloat16() for _ in range(2))
    v, dout = (torch.randn(1, 4, L, d_v, device="cuda", generator=g).bfloat16() for _ in range(2))
    m, scale, ref = Mods(case.score_mod, case.mask_mod), d_qk ** -0.5, ReferenceKernel()
    want_out, want_lse, _ = ref.forward(q, k, v, q_seg, kv_seg, m, scale, True)
    out, *_ = CudnnKernel().forward(q, k, v, q_seg, kv_seg, m, scale, True)
    assert _err(out, want_out) < 2e-2
    out = want_out.to(q.dtype)
    grads = CudnnKernel().backward(q, k, v, out, want_lse, dout, q_seg, kv_seg, m, scale, True)
    for label, got, want in zip(("dq", "dk", "dv"), grads, ref.backward(q, k, v, out, want_lse, dout, q_seg, kv_seg, m,
                                                                        scale, True)):
        assert _err(got, want) < 2e-2, label


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_128_and_fp16(dtype):
    case = cases(SEQ, device="cuda")["causal_softcap"]
    _check(f"causal_softcap/d128/{dtype}", case, *SEGMENTS["diagonal"], CudnnKernel(), dtype=dtype, head_dim=128)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("mask_mod,q_seg,kv_seg", [
    (mods.sliding_window(512), Segment(1024, 1, 512), Segment(512, 1, 1024)),  # a window over two blocks
    (mods.sliding_window(300), Segment(1200, 1, 600), Segment(600, 1, 1200)),  # blocks longer than the window
    (lambda b, h, q, kv: (kv >= 700) & (kv <= q), Segment(1024, 1, 512), Segment(512, 1, 1024))],  # a document
    ids=["window_two_blocks", "window_longer_blocks", "document_begun_earlier"])
def test_bands_split_off_the_diagonal_match_reference(mask_mod, q_seg, kv_seg):
    """Bands whose right bound is off the diagonal run as two calls (``band_runs``)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda n: torch.randn(1, 4, n, 64, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, dout = make(q_seg.length), make(kv_seg.length), make(kv_seg.length), make(q_seg.length)
    m, kernel, ref = Mods(None, mask_mod), CudnnKernel(), ReferenceKernel()
    assert len(plan(traced(m, True, "cuda"), m, q, k, q_seg, kv_seg, kernel.split_depth)) == 2
    want_out, want_lse, _ = ref.forward(q, k, v, q_seg, kv_seg, m, 0.125, True)
    out, lse, _ = kernel.forward(q, k, v, q_seg, kv_seg, m, 0.125, True)
    assert _err(out, want_out) < 2e-2 and (lse - want_lse).abs()[want_lse.isfinite()].max() < 2e-2
    global_out = want_out.to(q.dtype)
    grads = kernel.backward(q, k, v, global_out, want_lse, dout, q_seg, kv_seg, m, 0.125, True)
    for got, want in zip(grads, ref.backward(q, k, v, global_out, want_lse, dout, q_seg, kv_seg, m, 0.125, True)):
        assert _err(got, want) < 2e-2


@pytest.mark.gpu
@needs_cudnn
def test_full_block_skips_the_mask():
    case = cases(SEQ, device="cuda")["alibi"]  # masked=False: the planner proved the block FULL
    _check("alibi/unmasked", case, *SEGMENTS["offsets"], CudnnKernel(), masked=False)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("segs", sorted(PACKED_SEGMENTS))
def test_packed_documents_in_ragged_batches_match_reference(segs):
    # One batch runs as ragged batches (inputs in [B, S, H, D] memory copied for them); two
    # batches, and GQA in the backward, as a call per document.
    for batch, kv_heads, bshd in ((1, 4, False), (1, 4, True), (2, 4, False), (1, 2, False)):
        _check(f"packed/{segs}/batch {batch}/kv heads {kv_heads}/bshd {bshd}", _packed("cuda", kv_heads),
               *PACKED_SEGMENTS[segs], CudnnKernel(), batch=batch, bshd=bshd)


@pytest.mark.gpu
@needs_cudnn
def test_rows_without_keys_give_zero_not_nan():
    case = cases(SEQ, device="cuda")["late_queries"]
    q, k, v, dout = _case_inputs(case, torch.bfloat16)
    m = Mods(None, case.mask_mod)
    seg = Segment(0, 1, L)  # every query is in the first half: nothing is visible
    for kernel in (CudnnKernel(split_depth=0), CudnnKernel()):
        out, lse, _ = kernel.forward(q, k, v, seg, seg, m, 0.125, True)
        assert torch.equal(out, torch.zeros_like(out)) and lse.isneginf().all()
        grads = kernel.backward(q, k, v, out, lse, dout, seg, seg, m, 0.125, True)
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("segs", ["diagonal", "offsets"])
@pytest.mark.parametrize("name", ["mask", "score", "padding"])
def test_batch_dependent_mods_match_reference(name, segs):
    """Values per batch element: cuDNN read them wrong in their compact form (docs/cudnn.md)."""
    q_seg, kv_seg = SEGMENTS[segs]
    lengths = torch.tensor([kv_seg.start + L // 4, kv_seg.start + 3 * L // 4], device="cuda")
    case = {"mask": Case(mask_mod=lambda b, h, q, kv: (b == 0) | (kv <= q)),
            "score": Case(score_mod=lambda score, b, h, q, kv: score + b * 0.5, mask_mod=mods.causal),
            "padding": Case(mask_mod=lambda b, h, q, kv: (kv < lengths[b]) & (kv <= q))}[name]
    _check(f"{name}/{segs}", case, q_seg, kv_seg, CudnnKernel(), batch=2)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("segs", ["diagonal", "offsets"])
@pytest.mark.parametrize("name", ["keys kept per batch element", "bias per head and query"])
def test_tables_of_two_indices_match_reference(name, segs):
    """Tables cuDNN takes as hoisted inputs of two dims: [B, 1, 1, S_kv] (an attention mask of
    [B, S_kv], as models pass them) and [1, H, S_q, 1]."""
    g = torch.Generator().manual_seed(0)
    kept = (torch.rand(2, SEQ, generator=g) < 0.8).to("cuda")
    per_query = torch.randn(4, SEQ, generator=g).to("cuda")
    case = {"keys kept per batch element": Case(mask_mod=lambda b, h, q, kv: kept[b, kv] & (kv <= q)),
            "bias per head and query": Case(score_mod=lambda score, b, h, q, kv: score + per_query[h, q],
                                            mask_mod=mods.causal)}[name]
    _check(f"{name}/{segs}", case, *SEGMENTS[segs], CudnnKernel(), batch=2)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("name", ["alibi", "causal_softcap", "late_queries"])
def test_one_batch_and_one_head_match_reference(name):
    """Rows of a one-head block's stats, which the split calls take, are contiguous to torch
    but not packed to cuDNN (docs/cudnn.md)."""
    case = dataclasses.replace(cases(SEQ, device="cuda")[name], q_heads=1, kv_heads=1)
    _check(f"{name}/one head", case, *SEGMENTS["offsets"], CudnnKernel(), batch=1)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("name", sorted(cases(SEQ)) + ["packed"])
def test_gradients_through_the_lse_match_reference(name):
    """A loss that reads the LSE (one rank): cuDNN's second backward call per hop, over zero
    values, gives the LSE's share of dq and dk (``parallel.compute.lse_as_attention``); "packed": its
    documents in ragged batches."""
    import ringflex

    case = _packed("cuda") if name == "packed" else cases(SEQ, device="cuda")[name]
    q, k, v, dout = make_inputs(case, SEQ, batch=1, head_dim=64)
    dlse = torch.randn(dout.shape[:3], generator=torch.Generator().manual_seed(1))
    results = {}
    for backend, dtype in (("cudnn", torch.bfloat16), ("reference", torch.float32)):
        inputs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
        out, lse = ringflex.ring_flex_attention(*inputs, score_mod=case.score_mod, mask_mod=case.mask_mod,
                                                enable_gqa=True, return_lse=True, backend=backend)
        torch.autograd.backward([out, lse], [dout.to("cuda", dtype), dlse.cuda()])
        results[backend] = [out, lse.where(lse.isfinite(), 0.0)] + [t.grad for t in inputs]
    errors = [_err(got, want) for got, want in zip(results["cudnn"], results["reference"])]
    assert max(errors) < 2e-2, errors


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("name", sorted(cases(SEQ)) + ["packed"])
def test_attention_sinks_match_reference(name):
    """Sinks on cuDNN (one rank): the hops' backward over the output and LSE that include the
    sink, and the sinks' gradient, against the reference kernel."""
    import ringflex

    case = _packed("cuda") if name == "packed" else cases(SEQ, device="cuda")[name]
    q, k, v, dout = make_inputs(case, SEQ, batch=1, head_dim=64)
    sinks = torch.randn(case.q_heads, generator=torch.Generator().manual_seed(2))
    results = {}
    for backend, dtype in (("cudnn", torch.bfloat16), ("reference", torch.float32)):
        inputs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)] + [sinks.cuda().requires_grad_()]
        out, lse = ringflex.ring_flex_attention(*inputs[:3], score_mod=case.score_mod, mask_mod=case.mask_mod,
                                                enable_gqa=True, return_lse=True, backend=backend, sinks=inputs[3])
        out.backward(dout.to("cuda", dtype))
        results[backend] = [out, lse] + [t.grad for t in inputs]
    errors = [_err(got, want) for got, want in zip(results["cudnn"], results["reference"])]
    assert max(errors) < 2e-2, errors


@pytest.mark.gpu
@needs_cudnn
def test_graphs_are_reused_across_offsets():
    from ringflex.kernels import cudnn as module

    case = cases(SEQ, device="cuda")["causal_softcap"]
    kernel = CudnnKernel(split_depth=0)
    q, k, v, _ = _case_inputs(case, torch.bfloat16)
    m = Mods(case.score_mod, case.mask_mod)
    kernel.forward(q, k, v, Segment(0, 1, L), Segment(0, 1, L), m, 0.125, True)
    built = len(module.graphs._GRAPHS)
    for start in (L, 3 * L, 17):
        kernel.forward(q, k, v, Segment(start, 1, L), Segment(0, 1, L), m, 0.125, True)
    assert len(module.graphs._GRAPHS) == built


def _check_cut_hops(dev: str, dtype: torch.dtype) -> None:
    """A hop as the ring runs it for a document that straddles two ranks: its queries are rows
    of the rank's block, its keys rows of a received block, which holds a power of two of rows
    (``plan.blocks.widened``), and the backward reads rows of the rank's whole output and lse. One
    ragged call each way (a batch of one over the cut block); new documents whose parts fall
    in the same size classes build no graph; all match the reference kernel."""
    from ringflex.kernels import cudnn as module
    from ringflex.kernels.merge import rows
    from ringflex.plan.blocks import widened

    n = 1024
    g = torch.Generator(device=dev).manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device=dev, generator=g).to(dtype)  # noqa: E731
    q_block, dout_block, k_block, v_block = (make(1, 4, n, 64) for _ in range(4))  # this rank's; the previous one's
    out_block, lse_block = make(1, 4, n, 64), make(1, 4, n).float()
    kernel, ref, graphs, earlier = CudnnKernel(), ReferenceKernel(), [], set(module.graphs._GRAPHS)
    for before, after in ((300, 200), (280, 220), (310, 190)):  # the document's rows on either side
        m = Mods(None, mods.document(mods.document_ids([n - before, before + after, n - after], device=dev)))
        lo, hi = widened((n - before, n), n)
        k, v = (rows(t[:, :, lo:hi].contiguous(), (n - before - lo, hi - lo)) for t in (k_block, v_block))
        q, dout, out, lse = (rows(t, (0, after)) for t in (q_block, dout_block, out_block, lse_block))
        q_seg, kv_seg = Segment(n, 1, after), Segment(n - before, 1, before)
        want_out, want_lse, _ = ref.forward(q, k, v, q_seg, kv_seg, m, 0.125, True)
        got_out, got_lse, _ = kernel.forward(q, k, v, q_seg, kv_seg, m, 0.125, True)
        assert _err(got_out, want_out) < 2e-2 and (got_lse - want_lse).abs().max() < 2e-2
        out.copy_(want_out)
        lse.copy_(want_lse)
        grads = kernel.backward(q, k, v, out, lse, dout, q_seg, kv_seg, m, 0.125, True)
        for got, want in zip(grads, ref.backward(q, k, v, out, lse, dout, q_seg, kv_seg, m, 0.125, True)):
            assert _err(got, want) < 2e-2
        graphs.append(set(module.graphs._GRAPHS))
    assert graphs[0] == graphs[1] == graphs[2]
    assert len(graphs[0] - earlier) == 2 and all(key[7] is not None for key in graphs[0] - earlier)  # ragged, fwd and bwd


@pytest.mark.gpu
@needs_cudnn
def test_hops_cut_to_a_straddling_document_match_reference_and_reuse_graphs():
    _check_cut_hops("cuda", torch.bfloat16)


@pytest.mark.gpu
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
    wide = torch.zeros(1, 2, 64, 256, device="cuda", dtype=torch.bfloat16)
    assert cudnn_unavailable_reason(wide, wide, q, Mods()) is None
    too_wide = torch.zeros(1, 2, 64, 264, device="cuda", dtype=torch.bfloat16)
    assert "at most 256" in cudnn_unavailable_reason(too_wide, too_wide, q, Mods())


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
                assert len(runs) <= 2
                computed = sum((_band_keeps(run, 20, 24).int() for run in runs), torch.zeros(20, 24, dtype=torch.int))
                assert torch.equal(computed, allowed.int()), (q_seg, kv_seg, runs)  # every pair once
                for run in runs:
                    if run.band is not None and run.band[0] is not None:
                        assert run.rows[1] - run.rows[0] <= run.cols[1] - run.cols[0]
                    assert run.band is None or run.band[1] is None or run.band[1] >= 0
                    if len(runs) == 2:  # no right bound off the diagonal beside a left bound
                        assert run.band is None or None in run.band or run.band[1] == 0


@pytest.mark.parametrize("mask_mod,q_seg,kv_seg,splits", [
    (mods.sliding_window(300), Segment(600, 1, 300), Segment(300, 1, 600), True),  # a window over two blocks
    (mods.sliding_window(300), Segment(1200, 1, 600), Segment(600, 1, 1200), True),  # blocks longer than it
    (lambda b, h, q, kv: q - kv >= -400, Segment(0, 1, 500), Segment(0, 1, 1000), True),  # keys up to 400 ahead
    (mods.sliding_window(100), Segment(600, 1, 300), Segment(300, 1, 600), False)])  # too narrow to split
def test_band_runs_keep_the_right_bound_on_the_diagonal(mask_mod, q_seg, kv_seg, splits):
    """cuDNN's backward of a band whose right bound is off the diagonal costs 1.2x to 1.9x as
    much per pair (docs/benchmarks.md): such a band splits where that leaves a call of at
    least _MIN_FULL keys, and the calls still compute every visible pair once."""
    runs = band_runs(diagonal_band(trace_mask_mod(mask_mod)), q_seg, kv_seg)
    count, _ = _coverage(runs, (q_seg.length, kv_seg.length))
    assert torch.equal(count, _allowed(mask_mod, q_seg, kv_seg).int()), runs
    off_diagonal = [run for run in runs if run.band is not None and (run.band[1] or 0) > 0]
    assert (len(runs), len(off_diagonal)) == ((2, 0) if splits else (1, 1)), runs


def test_a_window_over_two_blocks_runs_as_two_one_sided_bands():
    """The block a ring's window hop covers (queries against their own and the previous block
    of keys) as two calls whose right bound is the diagonal or absent."""
    window = diagonal_band(trace_mask_mod(mods.sliding_window(4096)))
    runs = band_runs(window, Segment(8192, 1, 4096), Segment(4096, 1, 8192))
    assert runs == (Run((0, 4096), (1, 4097), band=(1, None)), Run((1, 4096), (4097, 8192), band=(None, 0)))
    whole = band_runs(window, Segment(0, 1, 16384), Segment(0, 1, 16384))  # the diagonal: one call
    assert whole == (Run((0, 16384), (0, 16384), band=(4096, 0)),)
    longer = band_runs(window, Segment(16384, 1, 8192), Segment(8192, 1, 16384))  # blocks longer than the window
    assert longer == (Run((0, 4096), (4097, 8193), band=(1, None)), Run((1, 8192), (8193, 16384), band=(4096, 0)))


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


def test_exact_runs_give_a_document_one_band_call_per_block():
    """A document that began before the block's first key runs as one call with cuDNN's band
    (every key from the block's start to the diagonal), not as a full call, a band call and a merge."""
    mask_mod = PLAN_MASKS["documents"]
    q_seg, kv_seg = Segment(128, 1, 384), Segment(0, 1, 512)  # rows of 4 documents; the first began at 100
    runs = exact_runs(Mods(None, mask_mod), trace_mask_mod(mask_mod), q_seg, kv_seg, "cpu")
    assert [(r.rows, r.cols, r.band) for r in runs] == [
        ((0, 2), (100, 130), (None, 28)), ((2, 202), (130, 330), (None, 0)), ((202, 272), (330, 400), (None, 0)),
        ((272, 384), (400, 512), (None, 0))]


def test_exact_plans_take_many_documents_but_few_calls_outside_a_batch():
    """Forty documents in a block are one exact plan (their runs join one ragged batch); a
    2-D neighbourhood, whose fifty row groups would each be a call with a select, is not."""
    block = Segment(0, 1, 800)
    documents = mods.document(mods.document_ids([20] * 40))
    runs = exact_runs(Mods(None, documents), trace_mask_mod(documents), block, block, "cpu")
    assert len(runs) == 40 and not any(run.masked for run in runs)
    neighbourhood = mods.image_neighbourhood(50, 16, 1)
    assert exact_runs(Mods(None, neighbourhood), trace_mask_mod(neighbourhood), block, block, "cpu") is None


def test_a_block_too_large_to_evaluate_whole_is_planned_from_its_tiles():
    """More pairs than one dense pass may evaluate (2^28): the tiles the mask's formula settles
    still give the exact plan, one causal band per document."""
    q_seg, kv_seg = Segment(32768, 1, 16384), Segment(16384, 1, 32768)
    documents = mods.document(mods.document_ids([20000, 9000, 14000, 6000, 100000]))
    runs = exact_runs(Mods(None, documents), trace_mask_mod(documents), q_seg, kv_seg, "cpu")
    assert q_seg.length * kv_seg.length > 1 << 28
    assert [(r.rows, r.cols, r.band) for r in runs] == [  # documents from positions 29000, 43000 and 49000
        ((0, 10232), (12616, 16385), None), ((1, 10232), (16385, 26616), (None, 0)),
        ((10232, 16232), (26616, 32616), (None, 0)), ((16232, 16384), (32616, 32768), (None, 0))]


def test_the_kernel_plans_within_exactly_planned_blocks_only():
    kernel, q_seg, kv_seg = CudnnKernel(), Segment(128, 1, 384), Segment(0, 1, 512)
    neighbourhood = lambda b, h, q, kv: ((q // 32 - kv // 32).abs() <= 1) & ((q % 32 - kv % 32).abs() <= 1)  # noqa: E731
    assert kernel.plans_within(PLAN_MASKS["documents"], False, q_seg, kv_seg, "cpu")
    assert not kernel.plans_within(PLAN_MASKS["documents"], True, q_seg, kv_seg, "cpu")  # a score_mod: selects
    assert kernel.plans_within(mods.causal, False, q_seg, kv_seg, "cpu")  # native band calls
    assert not kernel.plans_within(mods.sliding_window(8), False, Segment(0, 1, 64), Segment(0, 1, 16), "cpu")  # s_q > s_kv
    assert not kernel.plans_within(neighbourhood, False, q_seg, kv_seg, "cpu")  # too fragmented to plan exactly


@pytest.mark.parametrize("mask_mod", [PLAN_MASKS["documents"], mods.causal, mods.sliding_window(100)])
def test_the_kernel_reports_the_part_of_a_block_its_calls_reach(mask_mod):
    """``plans_within`` gives the local rows and keys the calls reach: every visible pair,
    and no row or key outside them (the planner trims the hop to it)."""
    kernel = CudnnKernel()
    for q_seg, kv_seg in [(Segment(128, 1, 384), Segment(0, 1, 512)), (Segment(256, 1, 256), Segment(0, 1, 256)),
                          (Segment(300, 1, 100), Segment(250, 1, 250))]:
        expected = visible_extent(mask_mod, q_seg, kv_seg)
        assert kernel.plans_within(mask_mod, False, q_seg, kv_seg, "cpu") == expected, (q_seg, kv_seg)


# ----------------------------------------------------------------------------- lowering, emulated (CPU)
# On the CPU stand-in for the cuDNN frontend (``support.emulated_cudnn``).

def _emulated(monkeypatch):
    return emulate(monkeypatch)


def _check_emulated(case, segments, depths=(0, 1, 2), batch=2):
    for segs, (q_seg, kv_seg) in segments.items():
        if case.kv_len_ratio != 1.0:
            kv_seg = Segment(kv_seg.start // 2, kv_seg.stride, L)
        q, k, v, dout = (t[:, :, :L].contiguous() for t in make_inputs(case, SEQ, batch=batch, head_dim=16))
        m, ref = Mods(case.score_mod, case.mask_mod), ReferenceKernel()
        want_out, want_lse, _ = ref.forward(q, k, v, q_seg, kv_seg, m, 0.25, True)
        want = ref.backward(q, k, v, want_out, want_lse, dout, q_seg, kv_seg, m, 0.25, True)
        for depth in depths:
            kernel = CudnnKernel(split_depth=depth)
            where = lambda e: f"{segs} depth {depth}: {e}"  # noqa: E731
            out, lse, _ = kernel.forward(q, k, v, q_seg, kv_seg, m, 0.25, True)
            torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4, msg=where)
            assert torch.equal(lse.isneginf(), want_lse.isneginf())
            torch.testing.assert_close(torch.where(lse.isneginf(), 0, lse), torch.where(want_lse.isneginf(), 0, want_lse))
            grads = kernel.backward(q, k, v, want_out, want_lse, dout, q_seg, kv_seg, m, 0.25, True)
            for g, w in zip(grads, want):
                torch.testing.assert_close(g.float(), w, atol=1e-4, rtol=1e-4, msg=where)


@pytest.mark.parametrize("name", sorted(cases(SEQ)))
def test_lowering_matches_reference_emulated(name, monkeypatch):
    module = _emulated(monkeypatch)
    _check_emulated(cases(SEQ)[name], SEGMENTS)
    module.clear_cache()


SLOPES = torch.linspace(0.1, 0.8, 4)
LOWERING_MODS = {  # operand orders and shapes the matrix does not reach
    "select_input_first": Case(score_mod=lambda s, b, h, q, kv: torch.where(q < kv + 3, 0.5, s), mask_mod=mods.causal),
    "input_compared": Case(score_mod=lambda s, b, h, q, kv: s + torch.where(SLOPES[h] > (q - kv) * 0.01, 1.0, -1.0)),
    "not_and_or": Case(mask_mod=lambda b, h, q, kv: ~(q < kv) & ((q % 3 != 1) | (kv % 4 == 0))),
    "bool_arith": Case(score_mod=lambda s, b, h, q, kv: s * (q >= kv) - 2.0 * (q % 2 == 0) + (h == 1)),
    "index_arith": Case(mask_mod=lambda b, h, q, kv: (q // 7 - kv // 7).abs() + (q % 7 - kv % 7).abs() <= 9),
    # booleans multiplied (and) and added (or), and a mask of ints (nonzero): all but the first
    # operand were dropped (a window written as (q >= kv) * (q - kv < 16) ran as causal)
    # integer division at exact multiples (of 41: cuDNN's reciprocal rounds them one low)
    "dilated": Case(score_mod=mods.softcap(5.0), mask_mod=lambda b, h, q, kv: ((q - kv) % 41 == 0) | (q == kv)),
    "divided": Case(mask_mod=lambda b, h, q, kv: (q // 47 == kv // 47) | (kv // -55 == q // -55)),
    "divided_by_tensor": Case(mask_mod=lambda b, h, q, kv: (q - kv) % (kv % 3 + 41) == 0),
    "bool_product": Case(mask_mod=lambda b, h, q, kv: (q >= kv) * (q - kv < 40)),
    "bool_sum": Case(mask_mod=lambda b, h, q, kv: (q - kv >= 300) + (kv % 3 == 0)),
    "bool_min_max": Case(mask_mod=lambda b, h, q, kv: torch.maximum(torch.minimum(q >= kv, q - kv < 60), kv % 5 == 0)),
    "int_mask": Case(score_mod=mods.softcap(5.0), mask_mod=lambda b, h, q, kv: (q - kv) % 3),
    "bool_factors_score": Case(score_mod=lambda s, b, h, q, kv: s * ((q >= kv) * (q % 2 == 0)) + 2.0 * ((kv % 3 == 0) + (q < kv))),
    **{f"score_{name}": Case(score_mod=fn, mask_mod=mods.sliding_window(50)) for name, fn in EXTRA_SCORE_MODS.items()},
}


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("name", ["bool_product", "bool_sum", "bool_min_max", "int_mask", "bool_factors_score",
                                  "dilated", "divided", "divided_by_tensor"])
def test_booleans_and_divisions_match_reference(name):
    for segs in ("offsets", "striped"):
        _check(f"{name} {segs}", LOWERING_MODS[name], *SEGMENTS[segs], CudnnKernel())


@pytest.mark.parametrize("name", sorted(LOWERING_MODS))
def test_lowering_of_operand_orders_emulated(name, monkeypatch):
    module = _emulated(monkeypatch)
    _check_emulated(LOWERING_MODS[name], {k: SEGMENTS[k] for k in ("offsets", "striped")}, depths=(0, 2))
    module.clear_cache()


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("name", sorted(score_ignoring_mods(SEQ, SLOPES)))
def test_score_mods_that_ignore_the_score_match_reference(name):
    """A modified score that was a graph input (a constant, a hoisted bias) got no engine from cuDNN
    (std::bad_cast: H100, frontend 1.32); dq = dk = 0 where the score is ignored."""
    case = Case(*score_ignoring_mods(SEQ, SLOPES.cuda())[name])
    for segs, (q_seg, kv_seg) in SEGMENTS.items():
        _check(f"{name} {segs}", case, q_seg, kv_seg, CudnnKernel())


@pytest.mark.parametrize("name", sorted(score_ignoring_mods(SEQ, SLOPES)))
def test_lowering_of_score_mods_that_ignore_the_score_emulated(name, monkeypatch):
    """Their derivative by the score is 0 (in rows that never read it, for one of them): dq = dk
    = 0 there, no NaN; a result that is a constant or a hoisted input is computed in the graph."""
    module = _emulated(monkeypatch)
    _check_emulated(Case(*score_ignoring_mods(SEQ, SLOPES)[name]), SEGMENTS, depths=(0, 2))
    module.clear_cache()


def test_integers_beyond_float32_are_refused():
    """cuDNN computes in float32, where integers past 2**24 round: document ids 2**24 and 2**24 + 1
    are one document there, a hashed block pattern turns dense, positions past 16.7M tokens tie
    (``auto`` then takes flex_attention, saying why). Ranged over the call's positions, so the
    same mod runs where its integers stay small; narrowing casts, which wrap, are refused."""
    from ringflex.kernels.cudnn import lowering_error
    ids = mods.document_ids([5, 11])
    hashed = Mods(None, lambda b, h, q, kv: ((q * 1000 + kv) % 64 == 0) | (q == kv))
    exact = [(Mods(None, mods.document(ids)), 16), (hashed, 8192), (Mods(None, mods.causal), 2**24),
             (Mods(mods.alibi(mods.alibi_slopes(4) * 2**30), mods.image_neighbourhood(1024, 1024, 3)), 2**20),
             (Mods(None, lambda b, h, q, kv, ids=ids: ids[q - 1] == ids[kv]), 16),  # negative indices: the table's values
             # attention-gym's masks at a million tokens
             (Mods(None, lambda b, h, q, kv: ((q - kv) % 4 == 0) & (q >= kv) & (q - kv < 8192)), 2**20),
             (Mods(None, lambda b, h, q, kv: (kv < 64) | (q < 64) | ((q - kv).abs() < 512)), 2**20),
             (Mods(None, lambda b, h, q, kv: (q // 128) % 4 == (kv // 128) % 4), 2**20),
             (Mods(mods.softcap(50.0), lambda b, h, q, kv: q // 8192 == kv // 8192), 2**20)]
    for mods_, length in exact:
        assert lowering_error(mods_, None, (length, length), 2, 4) is None, mods_
    rounded = [(Mods(None, mods.document(ids + 2**24)), 16), (hashed, 32768), (Mods(None, mods.causal), 2**24 + 2),
               (Mods(mods.softcap(5.0), lambda b, h, q, kv, base=torch.tensor([0, 2**24]): base[b] + q >= kv), 16)]
    for mods_, length in rounded:
        assert "integers past 2**24 round" in lowering_error(mods_, None, (length, length), 2, 4), mods_
    assert "wraps values" in lowering_error(Mods(None, lambda b, h, q, kv: (q - kv).to(torch.uint8) < 16))


@pytest.mark.parametrize("mods_,converted", [
    (Mods(None, mods.causal), False), (Mods(None, mods.sliding_window(50)), False),
    (Mods(None, mods.document(mods.document_ids([100, 156]))), False), (Mods(), False),
    (Mods(None, cases(SEQ)["sparse_rows"].mask_mod), True), (Mods(mods.softcap(5.0), None), True)])
def test_backward_converts_lse_only_where_a_row_may_see_no_key_emulated(mods_, converted, monkeypatch):
    """The -inf -> +inf pass over the lse runs before a backward only where a row may see no
    key: a per-element mask or a score_mod. Unmasked and native-band calls skip it."""
    module = _emulated(monkeypatch)
    passes = []
    real = torch.nan_to_num
    monkeypatch.setattr(torch, "nan_to_num", lambda *a, **kw: passes.append(1) or real(*a, **kw))
    q, k, v, dout = (torch.randn(1, 2, L, 16) for _ in range(4))
    seg = Segment(0, 1, L)
    kernel = module.CudnnKernel()
    out, lse, _ = kernel.forward(q, k, v, seg, seg, mods_, 0.25, True)
    kernel.backward(q, k, v, out, lse, dout, seg, seg, mods_, 0.25, True)
    assert bool(passes) == converted
    module.clear_cache()


def _count_calls(module, monkeypatch, q, k, v, dout, q_seg, kv_seg) -> Tuple[int, int]:
    """cuDNN calls of the forward and of the backward of one block."""
    calls = []
    real = module.graphs.Graph.execute
    monkeypatch.setattr(module.graphs.Graph, "execute", lambda self, *a: calls.append(1) or real(self, *a))
    m = Mods(None, PACKED.mask_mod)
    out, lse, _ = module.CudnnKernel().forward(q, k, v, q_seg, kv_seg, m, 0.25, True)
    forward_calls = len(calls)
    module.CudnnKernel().backward(q, k, v, out, lse, dout, q_seg, kv_seg, m, 0.25, True)
    monkeypatch.setattr(module.graphs.Graph, "execute", real)
    return forward_calls, len(calls) - forward_calls


def test_packed_documents_run_as_ragged_batches_emulated(monkeypatch):
    """The documents of a block run as one call (cuDNN's ragged batch), forward and backward,
    and still match the reference."""
    module = _emulated(monkeypatch)
    _check_emulated(PACKED, PACKED_SEGMENTS, depths=(2,), batch=1)
    q, k, v, dout = (t[:, :, :L].contiguous() for t in make_inputs(PACKED, SEQ, batch=1, head_dim=16))
    for name, (q_seg, kv_seg) in PACKED_SEGMENTS.items():
        assert _count_calls(module, monkeypatch, q, k, v, dout, q_seg, kv_seg) == PACKED_CALLS[name], name
    module.clear_cache()


def test_packed_batches_of_any_size_share_graphs_emulated(monkeypatch):
    """A block of 3 and one of 4 documents run on the same graphs (the batch padded with an
    empty sequence), and so do documents of different lengths alone in a block: new packed
    batches in training build no new graphs. All match the reference."""
    module = _emulated(monkeypatch)
    seg = Segment(0, 1, L)
    graphs = []
    for lengths in ((96, 96, 64), (128, 64, 32, 32)):  # the longest document in one bucket (128)
        case = Case(mask_mod=mods.document(mods.document_ids(list(lengths) + [SEQ - L])), q_heads=4, kv_heads=4)
        _check_emulated(case, {"diagonal": (seg, seg)}, depths=(2,), batch=1)
        graphs.append(set(module.graphs._GRAPHS))
    assert graphs[0] == graphs[1] and len(graphs[0]) == 2  # forward and backward
    module.clear_cache()
    graphs = []  # a document begun in the block of keys before: one run alone, of its length
    for first in (L + 70, L + 100):  # both in the bucket of 128 rows
        case = Case(mask_mod=mods.document(mods.document_ids([first, SEQ - first])), q_heads=4, kv_heads=4)
        _check_emulated(case, {"earlier": (Segment(L, 1, L), Segment(0, 1, L))}, depths=(2,), batch=1)
        graphs.append(set(module.graphs._GRAPHS))
    assert graphs[0] == graphs[1] and len(graphs[0]) == 2
    module.clear_cache()


def test_ragged_batches_only_where_cudnn_computes_them_right_emulated(monkeypatch):
    """Two batches, and in the backward grouped key/value heads, take a call per document
    (cuDNN gets those wrong: see ``_ragged_applies``); tensors in [B, S, H, D] strides batch,
    and cuDNN sees a copy with rows of ``head_dim`` elements, the layout measured right."""
    module = _emulated(monkeypatch)
    q_seg, kv_seg = PACKED_SEGMENTS["diagonal"]  # two documents
    q, k, v, dout = (t[:, :, :L].contiguous() for t in make_inputs(PACKED, SEQ, batch=2, head_dim=16))
    assert _count_calls(module, monkeypatch, q, k, v, dout, q_seg, kv_seg) == (2, 2)
    q, k, v, dout = (t[:1] for t in (q, k, v, dout))
    assert _count_calls(module, monkeypatch, q, k[:, :2], v[:, :2], dout, q_seg, kv_seg) == (1, 2)
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout)]
    seen = []
    real = module.batches.Batch.inputs
    monkeypatch.setattr(module.batches.Batch, "inputs", lambda self, tensors: seen.append(tensors) or real(self, tensors))
    assert _count_calls(module, monkeypatch, *bshd, q_seg, kv_seg) == (1, 1)
    assert all(t.stride(2) == t.shape[3] for tensors in seen for t in tensors.values() if t.dim() == 4)
    m, results = Mods(None, PACKED.mask_mod), []
    for inputs in (bshd, (q, k, v, dout)):  # the same numbers either way
        out, lse, _ = module.CudnnKernel().forward(*inputs[:3], q_seg, kv_seg, m, 0.25, True)
        results.append((out, lse, *module.CudnnKernel().backward(*inputs[:3], out, lse, inputs[3], q_seg, kv_seg, m,
                                                                   0.25, True)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    module.clear_cache()


def _diagonal_blocks(n: int, far: int):
    """A zigzag rank's own block: its two chunks of ``n`` rows, at global positions 0 and ``far``,
    each against its own keys."""
    from ringflex.plan.blocks import BlockKind, Hop
    return [Hop((i * n, (i + 1) * n), (i * n, (i + 1) * n), Segment(s, 1, n), Segment(s, 1, n), BlockKind.PARTIAL)
            for i, s in enumerate((0, far))]


def _check_joined_hops(kernel, hops, m, q, k, v, dout, close):
    """``forward_hops`` and ``backward_hops`` against the reference kernel, hop by hop."""
    ref, scale = ReferenceKernel(), 0.25
    parts = [tuple(t[:, :, slice(*h.q_rows)] for t in (q, k, v, dout)) for h in hops]
    wants = [ref.forward(*p[:3], h.q_seg, h.kv_seg, m, scale, True) for h, p in zip(hops, parts)]
    joined_out, joined_lse, _ = kernel.forward_hops(q, k, v, hops, m, scale)
    for h, (want_out, want_lse, _) in zip(hops, wants):
        close(joined_out[:, :, slice(*h.q_rows)], want_out)
        close(joined_lse[:, :, slice(*h.q_rows)], want_lse)
    out, lse = q.new_zeros(*q.shape[:3], v.shape[-1]), torch.full(q.shape[:3], -math.inf, device=q.device)
    for h, (want_out, want_lse, _) in zip(hops, wants):
        out[:, :, slice(*h.q_rows)], lse[:, :, slice(*h.q_rows)] = want_out, want_lse
    got = kernel.backward_hops(q, k, v, out, lse, dout, hops, m, scale)
    for h, p in zip(hops, parts):
        want = ref.backward(*p[:3], out[:, :, slice(*h.q_rows)], lse[:, :, slice(*h.q_rows)], p[3], h.q_seg, h.kv_seg,
                            m, scale, True)
        for g, w, r in zip(got, want, (h.q_rows, h.kv_rows, h.kv_rows)):
            close(g[:, :, slice(*r)], w)


@pytest.mark.parametrize("window", [40, 128])  # a band with a left bound; causal over a chunk
@pytest.mark.parametrize("memory", ["bhsd", "bshd", "grouped_heads"])
def test_a_zigzag_ranks_diagonal_blocks_of_a_band_run_as_one_strided_call_emulated(window, memory, monkeypatch):
    """A rank's own block over zigzag, two diagonal blocks of one shape: one plain call over
    batch-2 views of the block, forward and backward (grouped key/value heads too, which a
    ragged batch cannot take), matching the reference kernel block by block."""
    module = _emulated(monkeypatch)
    n, case = 128, Case(mask_mod=mods.sliding_window(window), q_heads=4, kv_heads=2 if memory == "grouped_heads" else 4)
    q, k, v, dout = (t[:, :, :2 * n] for t in make_inputs(case, SEQ, batch=1, head_dim=16))
    if memory == "bshd":
        q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
    else:
        q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
    hops, m, kernel = _diagonal_blocks(n, 3 * n), Mods(None, case.mask_mod), module.CudnnKernel()
    assert isinstance(kernel._joined(hops, m, q, k, v, q, dout), module.batches.Strided)
    calls = []
    real = module.graphs.Graph.execute
    monkeypatch.setattr(module.graphs.Graph, "execute", lambda self, *a: calls.append(1) or real(self, *a))
    _check_joined_hops(kernel, hops, m, q, k, v, dout,
                       lambda got, want: torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5))
    assert len(calls) == 2  # one forward, one backward
    module.clear_cache()


def test_joined_hops_apart_compute_their_rows_and_keys_alone_emulated(monkeypatch):
    """Two hops of one block with rows and keys between them that neither reads (packed
    documents' or a window's rows that read a neighbour, over zigzag): one call gives each
    hop's rows as the reference kernel does, and no pass writes the rows and keys between
    them, which the ring reads from other steps (``HopKernel.forward_hops``: any value)."""
    from ringflex.plan.blocks import BlockKind, Hop
    module = _emulated(monkeypatch)
    n, case = 64, Case(mask_mod=mods.sliding_window(40), q_heads=4, kv_heads=4)
    q, k, v, dout = (t[:, :, :3 * n].contiguous() for t in make_inputs(case, SEQ, batch=1, head_dim=16))
    hops = [Hop((a, a + n), (a, a + n), Segment(s, 1, n), Segment(s, 1, n), BlockKind.PARTIAL)
            for a, s in ((0, 0), (2 * n, 3 * n))]
    m, kernel = Mods(None, case.mask_mod), module.CudnnKernel()
    assert kernel._joined(hops, m, q, k, v, q, dout) is not None
    unwritten = 7.0
    monkeypatch.setattr(module.batches, "empty_for", lambda calls, rows=None: lambda *shape, **kw: torch.full(
        *shape, unwritten, **kw))
    _check_joined_hops(kernel, hops, m, q, k, v, dout,
                       lambda got, want: torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5))
    between = slice(n, 2 * n)
    out, lse, _ = kernel.forward_hops(q, k, v, hops, m, 0.25)
    grads = kernel.backward_hops(q, k, v, out, lse, dout, hops, m, 0.25)
    assert all(bool((t[:, :, between] == unwritten).all()) for t in (out, lse, *grads))
    module.clear_cache()


def test_runs_of_one_shape_evenly_spaced_make_one_strided_call():
    """Which runs ``batched`` groups, and how: one shape evenly spaced, any native band, as one
    strided call (of an exact plan only at lengths that recur: powers of two); else causal and
    unmasked runs as a ragged batch; the rest alone."""
    from ringflex.kernels.cudnn.batches import batched
    window, causal = (40, 0), (None, 0)

    def kinds(runs, exact=False, ragged=True):
        return sorted(type(c).__name__ for c in batched(tuple(runs), exact, ragged))
    even = [Run((0, 128), (0, 128), band=window), Run((128, 256), (128, 256), band=window)]
    assert kinds(even) == ["Strided"] and kinds(even, ragged=False) == ["Strided"]
    group = batched(tuple(even), False)[0]
    assert group.row_spans == group.col_spans == ((0, 256),) and group.band == window
    apart = [Run((0, 64), (0, 64), band=causal), Run((100, 164), (200, 264), band=causal),
             Run((200, 264), (400, 464), band=causal)]
    assert kinds(apart) == ["Strided"]
    uneven = [Run((0, 64), (0, 64), band=causal), Run((64, 160), (64, 160), band=causal)]
    assert kinds(uneven) == ["Batch"] and kinds(uneven, ragged=False) == ["Run", "Run"]
    assert kinds([dataclasses.replace(r, band=window) for r in uneven]) == ["Run", "Run"]
    overlapping = [Run((0, 64), (0, 64)), Run((32, 96), (32, 96))]
    assert kinds(overlapping) == ["Run", "Run"]
    documents = [Run((0, 96), (0, 96), band=causal), Run((96, 192), (96, 192), band=causal)]
    assert kinds(documents) == ["Strided"] and kinds(documents, exact=True) == ["Batch"]
    assert kinds(documents[:1], exact=True) == ["Batch"] and kinds(documents[:1]) == ["Run"]
    assert kinds([Run((0, 64), (0, 64)), Run((64, 128), (64, 128), masked=True)]) == ["Run", "Run"]


def test_full_graph_cache_says_so_once_emulated(monkeypatch):
    """More call shapes than the cache holds: graphs are rebuilt (slow), and the user is told once."""
    module = _emulated(monkeypatch)
    monkeypatch.setenv("RINGFLEX_CUDNN_GRAPHS", "2")
    monkeypatch.setattr("ringflex.config._WARNED", set())
    kernel = module.CudnnKernel()
    with pytest.warns(UserWarning) as record:
        for length in (8, 16, 24, 8, 16):
            q = torch.randn(1, 1, length, 8, dtype=torch.bfloat16)
            kernel.forward(q, q, q, None, None, Mods(), 1.0, False)
    assert [str(w.message) for w in record if "graph cache is full" in str(w.message)] == [
        "ringflex: the cuDNN graph cache is full (2 graphs): older graphs are dropped and rebuilt when needed "
        "again (0.1 to 1.5 s each); raise RINGFLEX_CUDNN_GRAPHS if this workload has that many call shapes"]
    assert len(module.graphs._GRAPHS) == 2


def test_dropped_graphs_are_freed_emulated(monkeypatch):
    """A graph built with a score_mod keeps no reference cycle through its callbacks (the
    frontend's cycle runs through C++, where Python's collector cannot see it): dropped from
    the cache, it is freed by reference counting alone."""
    import gc
    import weakref

    module = _emulated(monkeypatch)
    q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    seg, m = Segment(0, 1, 16), Mods(score_mod=mods.softcap(5.0), mask_mod=mods.causal)
    gc.collect()
    gc.disable()
    try:
        kernel = module.CudnnKernel()
        out, lse, _ = kernel.forward(q, q, q, seg, seg, m, 1.0, True)
        kernel.backward(q, q, q, out, lse, torch.ones_like(out), seg, seg, m, 1.0, True)
        graphs = [weakref.ref(g.graph) for g in module.graphs._GRAPHS.values()]
        assert len(graphs) >= 2 and all(r() is not None for r in graphs)
        module.graphs._GRAPHS.clear()
        assert all(r() is None for r in graphs)
    finally:
        gc.enable()


def _caller_after_builds(kernel, device) -> "weakref.ref":
    """Builds a forward and a backward graph and returns a weak reference to a local of this
    frame, which ends with it unless a reference cycle holds the frame."""
    import weakref

    local = torch.ones(1)
    q = torch.randn(1, 2, 64, 8, dtype=torch.bfloat16, device=device)
    seg, m = Segment(0, 1, 64), Mods(mask_mod=mods.causal)
    out, lse, _ = kernel.forward(q, q, q, seg, seg, m, 1.0, True)
    kernel.backward(q, q, q, out, lse, torch.ones_like(out), seg, seg, m, 1.0, True)
    return weakref.ref(local)


def _no_frame_outlives_its_call(module, device):
    import gc

    module.clear_cache()
    gc.collect()
    gc.disable()
    try:
        assert _caller_after_builds(module.CudnnKernel(), device)() is None
    finally:
        gc.enable()


def test_building_a_graph_leaves_no_cycle_holding_its_callers_emulated(monkeypatch):
    """Asking the frontend for a heuristic mode that declines leaves the decline's exception
    in a frame its traceback holds, a cycle that keeps every caller's frame and locals until
    Python's collector runs (perhaps inside a CUDA-graph capture, which freeing a CUDAGraph
    invalidates): the kernel asks only for the mode whose plan it runs."""
    _no_frame_outlives_its_call(_emulated(monkeypatch), "cpu")


@pytest.mark.gpu
@needs_cudnn
def test_building_a_graph_leaves_no_cycle_holding_its_callers():
    from ringflex.kernels import cudnn as module

    _no_frame_outlives_its_call(module, "cuda")


def _ring_with_new_documents(rank, world_size, batches):
    """Graphs the emulated cuDNN kernel builds in each ring call (fwd+bwd) over packed
    ``batches`` of document lengths, and the largest error of out, dq, dk, dv against one process."""
    import ringflex
    from support.harness import weigh_cudnn_calls_as_free
    from support.oracle import attention

    module = on_every_ring_call()
    weigh_cudnn_calls_as_free()  # these small calls lend as large ones would
    built, build = [], module.graphs._build
    module.graphs._build = lambda *args: built.append(args[0]) or build(*args)
    per_call, errors = [], []
    for lengths in batches:
        mask = mods.document(mods.document_ids(lengths))
        full = [torch.randn(1, 2, sum(lengths), 16, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                .requires_grad_() for i in range(3)]
        expected = attention(*full, mask_mod=mask)
        expected.sum().backward()
        local = [ringflex.shard(t.detach().float(), world_size, layout="contiguous").requires_grad_() for t in full]
        before = len(built)
        out = ringflex.ring_flex_attention(*local, mask_mod=mask, layout="contiguous")
        out.sum().backward()
        per_call.append(len(built) - before)
        errors += [(got.double() - ringflex.shard(want, world_size, layout="contiguous")).abs().max().item()
                   for got, want in zip([out] + [t.grad for t in local], [expected] + [t.grad for t in full])]
    return per_call, max(errors)


def test_new_packed_batches_in_the_ring_reuse_graphs_emulated():
    """Packed batches change every training step. A document straddling the two ranks makes
    rank 1 read a part of rank 0's block, whose rows follow the documents: the rows that
    travel are widened to a power of two and the kernel's results are allocated with heads a
    power of two rows apart, so a new batch whose documents fall in the same size classes
    builds no new graph on any rank (each used to cost a graph per call, 0.1 to 1.5 s on a
    GPU). In these batches rank 1 lends rank 0 the document's first 64 rows (``lending``), which
    travel widened the same way. Numbers match one process."""
    from support.harness import run_world

    batches = [[390, 320, 314], [385, 330, 309], [387, 325, 312]]  # the straddling part: 122, 127, 125 rows
    for rank, (per_call, error) in enumerate(run_world(2, _ring_with_new_documents, batches)):
        assert per_call[0] > 0 and per_call[1:] == [0, 0], (rank, per_call)
        assert error < 1e-5, (rank, error)


def test_hops_cut_to_a_straddling_document_reuse_graphs_emulated(monkeypatch):
    _emulated(monkeypatch)
    _check_cut_hops("cpu", torch.float32)


def test_deterministic_algorithms_build_a_backward_of_their_own_emulated(monkeypatch):
    """With ``torch.use_deterministic_algorithms(True)`` the backward is built with cuDNN's
    ``use_deterministic_algorithm`` as a graph of its own; the forward is shared, and turning
    the flag off again takes the first backward graph from the cache."""
    module = _emulated(monkeypatch)
    built = []
    build = module.graphs._build
    monkeypatch.setattr(module.graphs, "_build", lambda *a: built.append(a[0]) or build(*a))
    q, k, v, dout = (torch.randn(1, 2, L, 16) for _ in range(4))
    seg, m, kernel = Segment(0, 1, L), Mods(mods.softcap(5.0), None), module.CudnnKernel()  # one call each way
    attention = {}
    monkeypatch.setattr("ringflex.config._WARNED", set())
    for deterministic in (False, True, False):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
        out, lse, _ = kernel.forward(q, k, v, seg, seg, m, 0.25, True)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            kernel.backward(q, k, v, out, lse, dout, seg, seg, m, 0.25, True)
        assert [str(w.message) for w in said if "deterministic" in str(w.message)] == (
            ["ringflex: torch.use_deterministic_algorithms(True) is on, so cuDNN's attention backward runs its "
             "deterministic algorithm (1.2x to 2.1x slower on an H100, docs/reliability.md)"] if deterministic else [])
        for key, g in module.graphs._GRAPHS.items():
            attention[key[:2]] = g.graph.attention
    assert built == [False, True, True]  # forward; backward; deterministic backward
    assert attention[(True, True)]["use_deterministic_algorithm"] is True
    assert "use_deterministic_algorithm" not in attention[(True, False)]
    module.clear_cache()


def test_ragged_backward_needs_equal_head_dims_above_192():
    """Where cuDNN 9.19's ragged backward was measured right (H100): q/k head dims up to 192
    with any value head dim, and wider ones with value heads as wide."""
    from ringflex.kernels.cudnn.batches import ragged_applies

    def applies(d_qk, d_v, backward=True):
        q, v = torch.zeros(1, 2, 8, d_qk), torch.zeros(1, 2, 8, d_v)
        return ragged_applies(q, q, v, v, v) if backward else ragged_applies(q, q, v)
    assert applies(192, 128) and applies(64, 256) and applies(256, 256) and applies(256, 128, backward=False)
    assert not applies(256, 128) and not applies(224, 128)


def _close_in_bf16(got, want):
    assert _err(got, want) < 2e-2


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("starts", [(0, 640), (150, 640)])
def test_two_diagonal_blocks_of_packed_documents_run_as_one_batch(starts):
    """A rank's own block over zigzag: two diagonal blocks of causal documents at distant
    positions, in one call (``forward_hops`` / ``backward_hops``): a ragged batch, or one
    strided call where the blocks hold one document each of one length; they match the
    reference kernel block by block."""
    from ringflex.kernels.cudnn.batches import Batch, Strided
    n = L // 2
    case = dataclasses.replace(_packed("cuda"), mask_mod=mods.and_masks(mods.causal, _packed("cuda").mask_mod))
    q, k, v, dout = _case_inputs(case, torch.bfloat16, batch=1)
    hops = [dataclasses.replace(h, q_seg=Segment(s, 1, n), kv_seg=Segment(s, 1, n))
            for h, s in zip(_diagonal_blocks(n, 0), starts)]
    m, kernel = Mods(None, case.mask_mod), CudnnKernel()
    assert isinstance(kernel._joined(hops, m, q, k, v), Strided if starts == (0, 640) else Batch)
    _check_joined_hops(kernel, hops, m, q, k, v, dout, _close_in_bf16)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("window", [40, 4096])  # a band with a left bound; causal over a chunk
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_two_diagonal_blocks_of_a_band_run_as_one_strided_call(window, kv_heads):
    """A rank's own block over zigzag, a window's two diagonal blocks: one plain cuDNN call
    over batch-2 views of the block (``batches.Strided``), forward and backward, grouped heads
    too, matches the reference kernel block by block."""
    from ringflex.kernels.cudnn.batches import Strided
    n, case = L // 2, Case(mask_mod=mods.sliding_window(window), q_heads=4, kv_heads=kv_heads)
    q, k, v, dout = _case_inputs(case, torch.bfloat16, batch=1)
    hops, m, kernel = _diagonal_blocks(n, 3 * n), Mods(None, case.mask_mod), CudnnKernel()
    assert isinstance(kernel._joined(hops, m, q, k, v, q, dout), Strided)
    _check_joined_hops(kernel, hops, m, q, k, v, dout, _close_in_bf16)
