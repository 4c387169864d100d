"""Rows whose every key gets a huge score (an additive -1e30 or finfo.min mask in a score_mod,
as Hugging Face masks padding) give softmax's answer, as the float64 oracle does: the mean of
V over their highest-scored keys, and softmax's gradients. One fp32 LSE m + log(l) rounds
log(l) away there; the reference kernel keeps it apart (``res``), merges weigh hops by it,
and the cuDNN and flex kernels hand such rows to the reference kernel. Checked per kernel
(reference, cuDNN emulated on CPU, flex through a dense stand-in), through merges and sinks,
and on rings of 1 to 4 ranks with lending, forward and backward, in fp64, fp32 and bf16."""
import math
import warnings

import pytest
import torch
import torch.distributed as dist

import ringflex
from support.emulated_cudnn import emulate
from support.harness import run_world
from support.oracle import attention
from ringflex import config, mods
from ringflex.kernels.base import Mods
from ringflex.kernels.huge import huge_terms
from ringflex.kernels.reference import ReferenceKernel
from ringflex.plan.layout import Segment

HUGE_SCORE = 2.0 ** 100  # -1e30-like, and the same number in fp32 and fp64: a sink of it ties with such keys
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2}


def problems(seq_len: int):
    """name -> (score_mod, mask_mod, sink logit per head or None)."""
    pad = seq_len // 3
    finfo_min = torch.finfo(torch.float32).min

    def every_third_row_ordinary(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx % 3 != 0, score - 1e30, score)

    def left_padding(score, b, h, q_idx, kv_idx):  # the first rows see padding alone
        return score + torch.where(kv_idx < pad, finfo_min, 0.0)

    def huge_in_early_hops(score, b, h, q_idx, kv_idx):  # later rows see ordinary keys too
        return torch.where(kv_idx < seq_len // 2, score - HUGE_SCORE, score)

    def two_magnitudes(score, b, h, q_idx, kv_idx):  # the odd keys are far below the even ones
        return score - 1e30 * (1 + kv_idx % 2)

    return {
        "every third row ordinary": (every_third_row_ordinary, mods.causal, None),
        "left padding, finfo.min": (left_padding, mods.causal, None),
        "huge in early hops": (huge_in_early_hops, mods.causal, None),
        "two magnitudes": (two_magnitudes, None, None),
        "a sink as low as the keys": (huge_in_early_hops, mods.causal, torch.full((2,), -HUGE_SCORE)),
    }


def _inputs(seq_len, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 2, seq_len, 8, generator=g).to(dtype) for _ in range(4))
    return q, k, v, dout, torch.randn(2, 2, seq_len, generator=g)


def _error(got, want) -> float:
    """Largest error relative to the largest value (at least 1); LSEs of about -1e30 relative
    to themselves."""
    got, want = got.detach().double(), want.detach().double()
    scale = want.abs().clamp_min(1.0) if want.abs().max() > 1e20 else want.abs().max().clamp_min(1.0)
    return ((got - want).abs() / scale).max().item()


def _oracle(q, k, v, dout, dlse, score_mod, mask_mod, sinks):
    """The float64 truth: output, LSE and the gradients of out . dout + lse . dlse."""
    full = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact_sinks = None if sinks is None else sinks.detach().double().requires_grad_()
    out, lse = attention(*full, score_mod, mask_mod, return_lse=True, sinks=exact_sinks)
    torch.autograd.backward([out, lse], [dout.double(), dlse.double()])
    return [out, lse] + [t.grad for t in full] + ([] if sinks is None else [exact_sinks.grad])


# ----------------------------------------------------------------------------- kernels

def _emulated_cudnn(monkeypatch):
    """The cuDNN kernel on the CPU, its frontend emulated (``tests/gpu/test_cudnn_kernel.py``)."""
    return emulate(monkeypatch).CudnnKernel()


def _dense_flex(monkeypatch):
    """The flex kernel over a dense attention of flex_attention's semantics (``tests/test_flex.py``)."""
    from ringflex.kernels.flex import FlexKernel
    from test_flex import TILE, dense_flex_attention
    return FlexKernel(attend=dense_flex_attention, tile=TILE)


KERNELS = {"reference": lambda monkeypatch: ReferenceKernel(), "cudnn": _emulated_cudnn, "flex": _dense_flex}
SEQ = 24
HOP_PROBLEMS = sorted(name for name, (_, _, sinks) in problems(SEQ).items() if sinks is None)  # sinks are the ring's


def kernel_errors(kernel, name, dtype, device="cpu"):
    """A hop of rows 5 to 21 against every key, at global positions, on ``kernel``: errors of its
    output and, given its own output and LSE (as one hop has them), of its gradients, against
    the oracle restricted to those rows."""
    score_mod, mask_mod, _ = problems(SEQ)[name]
    q, k, v, dout, _ = _inputs(SEQ, dtype)
    rows = slice(5, 21)
    dout[:, :, :rows.start], dout[:, :, rows.stop:] = 0, 0  # the loss reads the hop's rows alone
    want_out, _, want_dq, want_dk, want_dv = _oracle(q, k, v, dout, torch.zeros(dout.shape[:3]), score_mod, mask_mod,
                                                     None)
    q, k, v, dout = (t.to(device) for t in (q, k, v, dout))
    q_seg, kv_seg, m = Segment(rows.start, 1, rows.stop - rows.start), Segment(0, 1, SEQ), Mods(score_mod, mask_mod)
    out, lse, res = kernel.forward(q[:, :, rows], k, v, q_seg, kv_seg, m, 8 ** -0.5, True)
    grads = kernel.backward(q[:, :, rows], k, v, out, lse, dout[:, :, rows], q_seg, kv_seg, m, 8 ** -0.5, True, res=res)
    wanted = (want_out[:, :, rows], want_dq[:, :, rows], want_dk, want_dv)
    return {what: _error(got.cpu(), want) for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), wanted)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", HOP_PROBLEMS)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_each_kernel_gives_softmaxs_answer(kernel, name, dtype, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cuDNN and flex kernels say once that such rows run on the reference
        errors = kernel_errors(KERNELS[kernel](monkeypatch), name, dtype)
    assert max(errors.values()) < TOLERANCE[dtype], errors


def test_the_reference_kernel_keeps_what_the_lse_rounds_away():
    """Every row of the hop sees only keys at -1e30 (causal: row i sees i + 1 of them): the LSE
    is that number, and its res the log of the count, which the fp32 sum cannot hold."""
    q, k, v, *_ = _inputs(8, torch.float32)
    m = Mods(lambda s, b, h, q_idx, kv_idx: s - 1e30, mods.causal)
    out, lse, res = ReferenceKernel().forward(q, k, v, Segment(0, 1, 8), Segment(0, 1, 8), m, 0.25, True)
    counts = torch.arange(1, 9, dtype=torch.float32)
    assert torch.equal(lse, torch.full_like(lse, -1e30))
    torch.testing.assert_close(res, counts.log().expand_as(res))
    torch.testing.assert_close(out, v.cumsum(2) / counts.view(-1, 1))


def test_the_fast_kernels_say_once_why_such_rows_run_on_the_reference_kernel(monkeypatch):
    monkeypatch.setattr(config, "_WARNED", set())
    for name in ("cudnn", "flex"):
        with pytest.warns(UserWarning, match=f"computed by the reference kernel, not {name}, as one fp32 LSE cannot"):
            kernel_errors(KERNELS[name](monkeypatch), "every third row ordinary", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_errors(KERNELS["cudnn"](monkeypatch), "left padding, finfo.min", torch.float32)


def test_which_mods_may_add_huge_terms():
    """Only these are checked for such rows (reading the LSE on the host)."""
    table = torch.zeros(8)
    padded = table.clone()
    padded[:3] = torch.finfo(torch.float32).min
    may = {name: score_mod for name, (score_mod, _, _) in problems(8).items()}
    may["a table of finfo.min"] = lambda s, b, h, q_idx, kv_idx: s + padded[kv_idx]
    may["a large integer"] = lambda s, b, h, q_idx, kv_idx: s - 10 ** 9
    may["one ringflex cannot trace (to tell)"] = lambda s, b, h, q_idx, kv_idx: s + torch.sin(s)
    may_not = {"softcap": mods.softcap(30.0), "alibi": mods.alibi(mods.alibi_slopes(4)),
               "a table": lambda s, b, h, q_idx, kv_idx: s + table[kv_idx],
               "-inf": lambda s, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, s, -math.inf),
               "positions": lambda s, b, h, q_idx, kv_idx: s - (q_idx // 100000) * 0.5}
    assert [name for name, f in may.items() if not huge_terms(f, "cpu")] == []
    assert [name for name, f in may_not.items() if huge_terms(f, "cpu")] == []


# ----------------------------------------------------------------------------- rings

LOCAL = 6  # tokens per rank: zigzag chunks of 3


def _ring_errors(rank, world_size, layout, kernel):
    """Per (problem, dtype): the worst errors of out, LSE, dq, dk, dv (and the sinks' gradient,
    summed over the ranks) of the ring against the oracle, on this rank; every rank lends
    rows wherever that evens the work."""
    from ringflex.plan import lending
    from test_ring import _with_kernel
    lending.QUANTUM = 1
    if kernel != "reference":
        _with_kernel(KERNELS[kernel](pytest.MonkeyPatch()))  # this process's alone
    dtypes = [torch.float32, torch.bfloat16] + [torch.float64] * (kernel != "cudnn")
    seq_len, errors = LOCAL * world_size, {}
    warnings.simplefilter("ignore")  # the fast kernels say once that such rows run on the reference kernel
    for name, (score_mod, mask_mod, sinks) in problems(seq_len).items():
        for dtype in dtypes:
            q, k, v, dout, dlse = _inputs(seq_len, dtype)
            want = _oracle(q, k, v, dout, dlse, score_mod, mask_mod, sinks)
            local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
            ring_sinks = None if sinks is None else sinks.to(dtype, copy=True).requires_grad_()
            out, lse = ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod, layout=layout,
                                                    backend="reference", return_lse=True, sinks=ring_sinks)
            torch.autograd.backward([out, lse], [ringflex.shard(t, 2, layout=layout) for t in (dout, dlse)])
            got = [out, lse] + [t.grad for t in local]
            if sinks is not None:
                dist.all_reduce(ring_sinks.grad)
                got.append(ring_sinks.grad)
            want[:5] = [ringflex.shard(w, 2, layout=layout) for w in want[:5]]  # the sinks' gradient is whole
            errors[name, str(dtype)] = [_error(g, w) for g, w in zip(got, want)]
    return errors


@pytest.mark.parametrize("kernel,world_size,layout", [
    ("reference", 1, "zigzag"), ("reference", 2, "zigzag"), ("reference", 2, "contiguous"),
    ("reference", 3, "contiguous"), ("reference", 4, "zigzag"),
    ("cudnn", 1, "zigzag"), ("cudnn", 2, "contiguous"), ("cudnn", 3, "zigzag"),
    ("flex", 2, "zigzag"), ("flex", 3, "contiguous"),
])
def test_rings_give_softmaxs_answer(kernel, world_size, layout):
    failures = [f"rank {rank} {name} {dtype}: out/lse/dq/dk/dv(/dsinks) errors {errs}"
                for rank, errors in enumerate(run_world(world_size, _ring_errors, layout, kernel))
                for (name, dtype), errs in errors.items() if max(errs) > TOLERANCE[getattr(torch, dtype[6:])]]
    assert not failures, "\n".join(failures)
