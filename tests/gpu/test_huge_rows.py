"""Rows whose every key gets a huge score (additive -1e30 / finfo.min masks) on the GPU's
kernels: cuDNN and compiled flex_attention give softmax's answer against the float64 oracle,
forward and backward, as a hop and as a call (``tests/test_huge_scores.py`` checks the
same on CPU with both kernels emulated). On the GPU, cuDNN and flex_attention also scale
the scores by log2(e), which turns finfo.min into -inf: these rows must not come out as rows
that see no key."""
import warnings

import pytest
import torch

from test_huge_scores import (HOP_PROBLEMS, SEQ, TOLERANCE, _error, _inputs, _oracle,  # noqa: E402
                              kernel_errors, problems)
import ringflex

pytestmark = pytest.mark.gpu


def _kernel(backend):
    if backend == "cudnn":
        from ringflex.kernels.cudnn import CudnnKernel
        return CudnnKernel()
    from ringflex.kernels.flex import FlexKernel
    return FlexKernel()


def _skip_unless(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ringflex.kernels import select_kernel
    try:
        select_kernel(backend, *(torch.zeros(1, 1, 8, 8, device="cuda", dtype=torch.bfloat16) for _ in range(3)),
                      ringflex.kernels.base.Mods())
    except ValueError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", HOP_PROBLEMS)
@pytest.mark.parametrize("backend", ["cudnn", "flex"])
def test_a_hop_gives_softmaxs_answer(backend, name, dtype):
    _skip_unless(backend)
    if backend == "cudnn" and dtype == torch.float32:
        pytest.skip("cuDNN runs fp16 and bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # such rows run on the reference kernel, said once
        errors = kernel_errors(_kernel(backend), name, dtype, device="cuda")
    assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("name", sorted(problems(SEQ)))
@pytest.mark.parametrize("backend", ["cudnn", "flex"])
def test_a_call_gives_softmaxs_answer(backend, name):
    """A whole call (one rank), with the LSE returned and read by the loss, and sinks."""
    _skip_unless(backend)
    score_mod, mask_mod, sinks = problems(SEQ)[name]
    q, k, v, dout, dlse = _inputs(SEQ, torch.bfloat16)
    want = _oracle(q, k, v, dout, dlse, score_mod, mask_mod, sinks)
    inputs = [t.cuda().requires_grad_() for t in (q, k, v)]
    gpu_sinks = None if sinks is None else sinks.cuda().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = ringflex.ring_flex_attention(*inputs, score_mod=score_mod, mask_mod=mask_mod, backend=backend,
                                                return_lse=True, sinks=gpu_sinks)
        torch.autograd.backward([out, lse], [dout.cuda(), dlse.cuda()])
    got = [out, lse] + [t.grad for t in inputs] + ([] if sinks is None else [gpu_sinks.grad])
    errors = [_error(g.cpu(), w) for g, w in zip(got, want)]
    assert max(errors) < TOLERANCE[torch.bfloat16], errors
