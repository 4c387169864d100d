"""The flex_attention hop kernel (compiled) matches the reference kernel, forward and backward,
for every mod of the matrix at global offsets and striped positions; learnable biases and
gathers cuDNN cannot run get their gradients; ``auto`` takes it where cuDNN cannot run a call."""

import pytest
import torch

from support.cases import Case, cases, make_inputs
from support.oracle import attention
from test_cudnn_kernel import L, SEGMENTS, SEQ, _check, _err, _packed
import ringflex
from ringflex import mods
from ringflex.kernels.flex import FlexKernel, flex_unavailable_reason

needs_flex = pytest.mark.skipif(not torch.cuda.is_available() or flex_unavailable_reason(torch.zeros(1, device="cuda")),
                                reason="needs a CUDA GPU and Triton")


@pytest.mark.gpu
@needs_flex
@pytest.mark.parametrize("segs", ["offsets", "striped"])
@pytest.mark.parametrize("name", sorted(cases(SEQ)))
def test_matches_reference(name, segs):
    case = cases(SEQ, device="cuda")[name]
    q_seg, kv_seg = SEGMENTS[segs]
    if case.kv_len_ratio != 1.0:
        kv_seg = type(kv_seg)(kv_seg.start // 2, kv_seg.stride, L)
    _check(f"flex {name}/{segs}", case, q_seg, kv_seg, FlexKernel())


@pytest.mark.gpu
@needs_flex
def test_packed_documents_match_reference():
    _check("flex packed", _packed("cuda"), *SEGMENTS["offsets"], FlexKernel())


def _relative_bias(table):
    return lambda score, b, h, q_idx, kv_idx: score + table[h, (q_idx - kv_idx).clamp(-4, 4) + 4]


@pytest.mark.gpu
@needs_flex
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_learnable_bias_runs_on_flex_with_its_gradient(dtype):
    """cuDNN gives no gradient for a tensor the score_mod reads: ``auto`` says so and takes
    flex_attention, whose gradients (the table's too) match autograd through the definition."""
    table = torch.randn(4, 9, device="cuda", requires_grad=True)
    q, k, v, dout = make_inputs(Case(), 512, batch=1, head_dim=64)
    inputs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    ringflex.config._WARNED.clear()
    with pytest.warns(UserWarning, match="using flex_attention .*the score_mod reads a tensor that requires grad"):
        out, lse = ringflex.ring_flex_attention(*inputs, score_mod=_relative_bias(table), mask_mod=mods.causal,
                                                return_lse=True)
    dlse = torch.randn(lse.shape, device="cuda")
    torch.autograd.backward([out, lse], [dout.to("cuda", dtype), dlse])
    exact_table = table.detach().cpu().double().requires_grad_()
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want, want_lse = attention(*exact, _relative_bias(exact_table), mods.causal, return_lse=True)
    torch.autograd.backward([want, want_lse], [dout.double(), dlse.cpu().double()])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for got, expected in zip([out, lse, *(t.grad for t in inputs), table.grad],
                             [want, want_lse, *(t.grad for t in exact), exact_table.grad]):
        assert _err(got.cpu(), expected) < tol


@pytest.mark.gpu
@needs_flex
def test_auto_takes_flex_for_a_gather_cudnn_cannot_run():
    table = torch.randn(4, 9, device="cuda")  # frozen: cuDNN cannot gather by q_idx - kv_idx
    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16)
    ringflex.config._WARNED.clear()
    with pytest.warns(UserWarning, match="using flex_attention"):
        ringflex.ring_flex_attention(q, q, q, score_mod=_relative_bias(table))


@pytest.mark.gpu
@needs_flex
def test_new_offsets_and_documents_do_not_recompile():
    """Positions reach the mods as tensors and document ids are captured tensors: hops at new
    offsets and new packed batches reuse the compiled kernels."""
    torch._dynamo.utils.counters.clear()
    kernel = FlexKernel()
    q = torch.randn(1, 4, L, 64, device="cuda", dtype=torch.bfloat16)
    for step, (q_seg, kv_seg) in enumerate(list(SEGMENTS.values()) * 2):
        doc_ids = mods.document_ids([100 + 7 * step, 300, 2000], device="cuda")
        kernel.forward(q, q, q, q_seg, kv_seg, ringflex.kernels.base.Mods(None, mods.document(doc_ids)), 0.125, True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 2, f"{frames} graphs compiled"  # a second compile may make the lengths dynamic
