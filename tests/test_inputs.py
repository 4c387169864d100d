"""Inputs off the happy path, on a ring of 2: NaN/Inf propagate as in the single-device kernel,
non-contiguous and expanded tensors give the contiguous results, every supported dtype works."""
import torch
import torch.nn.functional as F

import ringflex
from support.harness import run_world
from support.oracle import attention
from ringflex import mods

WORLD, S = 2, 16
LAYOUT = "contiguous"  # row i of the sequence is row i % 8 of rank i // 8


def _ring(q, k, v, mask_mod=mods.causal, dout=None):
    """Whole-sequence q, k, v -> the ring's whole output (and dq if ``dout``)."""
    local = [ringflex.shard(t, 2, layout=LAYOUT) for t in (q, k, v)]
    if dout is not None:
        local[0].requires_grad_()
    out = ringflex.ring_flex_attention(*local, mask_mod=mask_mod, layout=LAYOUT)
    if dout is None:
        return ringflex.unshard(out.detach(), 2, layout=LAYOUT), None
    out.backward(ringflex.shard(dout, 2, layout=LAYOUT))
    return ringflex.unshard(out.detach(), 2, layout=LAYOUT), ringflex.unshard(local[0].grad, 2, layout=LAYOUT)


def _bad_rows(t):
    return set(torch.nonzero(~torch.isfinite(t).all(-1).all(0).all(0)).flatten().tolist())


def _error_where_finite(a, b):
    rows = sorted(set(range(S)) - _bad_rows(a) - _bad_rows(b))
    return (a - b)[:, :, rows].abs().max().item() if rows else 0.0


def _sdpa(q, k, v, dout=None):
    """The single-device kernel: torch SDPA (math on CPU), causal, on the whole sequence."""
    q = q.clone().requires_grad_(dout is not None)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if dout is None:
        return out.detach(), None
    out.backward(dout)
    return out.detach(), q.grad


def _non_finite(rank, world_size):
    """name -> (ring's non-finite rows, SDPA's, max error on the rows both keep finite)."""
    g = torch.Generator().manual_seed(0)
    clean = [torch.randn(1, 2, S, 8, generator=g) for _ in range(4)]
    results = {}
    for name, which, row, value, grad in (("nan in q", 0, 5, float("nan"), True), ("nan in k", 1, 5, float("nan"), False),
                                          ("inf in k", 1, 5, float("inf"), False), ("nan in v", 2, 13, float("nan"), False)):
        q, k, v, dout = (t.clone() for t in clean)
        (q, k, v)[which][0, 1, row, 3] = value  # global row 5 is on rank 0, row 13 on rank 1
        got, got_dq = _ring(q, k, v, dout=dout if grad else None)
        want, want_dq = _sdpa(q, k, v, dout if grad else None)
        pairs = [(got, want)] + ([(got_dq, want_dq)] if grad else [])
        results[name] = [(_bad_rows(a), _bad_rows(b), _error_where_finite(a, b)) for a, b in pairs]
    return results


def test_nan_and_inf_propagate_like_the_single_device_kernel():
    for results in run_world(WORLD, _non_finite, timeout=120):
        attending = set(range(5, S))  # causal: the rows that see key 5
        (ring_rows, sdpa_rows, err), (ring_dq, sdpa_dq, dq_err) = results["nan in q"]
        assert ring_rows == sdpa_rows == {5} and err < 1e-5
        assert ring_dq == sdpa_dq == {5} and dq_err < 1e-5
        for name in ("nan in k", "inf in k"):
            [(ring_rows, sdpa_rows, err)] = results[name]
            assert ring_rows == sdpa_rows and ring_rows and ring_rows <= attending and err < 1e-5, name
        # 0 * NaN: SDPA's dense product spoils every row; the ring skips the block of rank 0's
        # queries and rank 1's keys, which the mask hides entirely.
        [(ring_rows, sdpa_rows, err)] = results["nan in v"]
        assert set(range(13, S)) <= ring_rows <= sdpa_rows and err < 1e-5


def _strides_and_dtypes(rank, world_size):
    g = torch.Generator().manual_seed(0)
    bshd = [torch.randn(2, S // world_size, 4, 8, generator=g) for _ in range(3)]  # [B, S_local, H, D]
    dout = torch.randn(2, 4, S // world_size, 8, generator=g)
    attn = ringflex.ring_flex_attention
    results = {}

    def run(q, k, v, leaves):
        out = attn(q, k, v, mask_mod=mods.causal, enable_gqa=True)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in bshd]
    want = run(*leaves, leaves)
    leaves = [t.clone().requires_grad_() for t in bshd]
    got = run(*(t.transpose(1, 2) for t in leaves), leaves)  # strided views, as from [B, S, H, D]
    results["transposed"] = max((a - b.transpose(1, 2) if i else a - b).abs().max().item()
                                for i, (a, b) in enumerate(zip(want, got)))

    kv_one = [t.transpose(1, 2)[:1, :1].contiguous().requires_grad_() for t in bshd[1:]]  # [1, 1, S_local, D]
    q = leaves[0].detach().transpose(1, 2).contiguous().requires_grad_()
    got = run(q, *(t.expand(2, 2, -1, -1) for t in kv_one), [q] + kv_one)  # stride-0 batch and heads
    same = [t.detach().expand(2, 2, -1, -1).contiguous().requires_grad_() for t in kv_one]
    q2 = q.detach().clone().requires_grad_()
    want = run(q2, *same, [q2] + same)
    results["expanded"] = max((got[0] - want[0]).abs().max().item(), (got[1] - want[1]).abs().max().item(),
                              *((a - b.sum((0, 1), keepdim=True)).abs().max().item() for a, b in zip(got[2:], want[2:])))

    full = [torch.randn(1, 2, S, 8, generator=g) for _ in range(3)]
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float32, 1e-5), (torch.float64, 1e-12)):
        q, k, v = (t.to(dtype) for t in full)
        out, _ = _ring(q, k, v)
        want = attention(*(t.double() for t in (q, k, v)), mask_mod=mods.causal)
        results[str(dtype)] = (out.dtype == dtype, (out.double() - want).abs().max().item() <= tol)
    return results


def test_strided_views_expanded_tensors_and_every_dtype():
    for results in run_world(WORLD, _strides_and_dtypes, timeout=120):
        assert results.pop("transposed") < 1e-6
        assert results.pop("expanded") < 1e-5
        assert all(ok == (True, True) for ok in results.values()), results
