"""The log-sum-exp merge of two partial attention results in one pass on a CUDA GPU (Triton).

In torch the merge takes two passes over the rows (one part scaled into an fp32 temporary,
then the other added into the result); on the ring's critical path every pass is time the
attention kernels wait for. Here each part is read once and the result written once, with
weights in fp32, rounded once into the result's dtype. Triton ships with torch's CUDA builds
and is imported on first use.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_ROWS = 32
_MAX_ROWS = 65535 * _BLOCK_ROWS


def applies(d: Tensor, a: Tensor, b: Tensor, lse_a: Tensor, lse_b: Tensor) -> bool:
    """Whether the fused merge can take these tensors: on one CUDA device, rows of
    contiguous elements whose batches and heads are whole rows apart, no float64 (its
    weights are fp32)."""
    return (d.is_cuda and all(t.device == d.device for t in (a, b, lse_a, lse_b))
            and all(t.dtype in _DTYPES and t.stride(-1) == 1 and t.stride(0) % t.stride(2) == 0
                    and t.stride(1) % t.stride(2) == 0 for t in (d, a, b))
            and lse_a.dtype == lse_b.dtype == torch.float32)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        _kernel()
    except ImportError:
        return False
    return True


def merge(d: Tensor, a: Tensor, lse_a: Tensor, b: Tensor, lse_b: Tensor) -> None:
    """d = exp(lse_a - m) * a + exp(lse_b - m) * b, and lse_a = m = logaddexp(lse_a, lse_b),
    for [B, H, L, D] rows ``a``, ``b``, ``d`` and [B, H, L] lse (``d`` may be ``a``). Rows
    where both lse are -inf get 0 and keep -inf."""
    _, heads, length, dim = d.shape
    if d.numel() == 0:
        return
    for start in range(0, length, _MAX_ROWS):  # a grid's second axis takes at most 65535 programs
        n = min(_MAX_ROWS, length - start)
        rows = [t.narrow(2, start, n) for t in (a, b, d, lse_a, lse_b)]
        _launch(*rows, heads, n, dim)


def _launch(a: Tensor, b: Tensor, d: Tensor, lse_a: Tensor, lse_b: Tensor, heads: int, length: int, dim: int):
    grid = (a.shape[0] * heads, -(-length // _BLOCK_ROWS))
    _kernel()[grid](
        a, b, d, lse_a, lse_b, heads, length, dim,
        *_in_rows(a), *_in_rows(b), *_in_rows(d), *lse_a.stride(), *lse_b.stride(),
        BLOCK_ROWS=_BLOCK_ROWS, BLOCK_DIM=max(16, 1 << (dim - 1).bit_length()), num_warps=4)


def _in_rows(t: Tensor):
    """Batch and head strides in rows, and the row stride (in elements)."""
    row = t.stride(2)
    return t.stride(0) // row, t.stride(1) // row, row


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # Lengths and the strides of batches and heads change with every packed batch's document
    # boundaries; specialised on them, Triton would compile a kernel for each new pattern (tens
    # of ms). Batch and head strides count rows, so addresses stay aligned to a row's stride.
    @triton.jit(do_not_specialize=["heads", "length", "a_rb", "a_rh", "b_rb", "b_rh", "d_rb", "d_rh",
                                   "la_sb", "la_sh", "lb_sb", "lb_sh"])
    def lse_merge(a, b, d, lse_a, lse_b, heads, length, dim,
                  a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, d_rb, d_rh, d_sl,
                  la_sb, la_sh, la_sl, lb_sb, lb_sh, lb_sl,
                  BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        bh = tl.program_id(0)
        batch, head = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
        row = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.arange(0, BLOCK_DIM)
        in_rows, in_cols = row < length, col < dim
        row64 = row.to(tl.int64)
        x_a = tl.load(lse_a + batch * la_sb + head * la_sh + row64 * la_sl, mask=in_rows, other=float("-inf"))
        x_b = tl.load(lse_b + batch * lb_sb + head * lb_sh + row64 * lb_sl, mask=in_rows, other=float("-inf"))
        top = tl.maximum(x_a, x_b)
        top = tl.where(top == float("-inf"), 0.0, top)  # rows that see no key: weights 0, lse -inf
        w_a, w_b = tl.exp(x_a - top), tl.exp(x_b - top)
        total = w_a + w_b
        seen = total > 0
        inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
        merged = tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        keep, add = (w_a * inv)[:, None], (w_b * inv)[:, None]
        both = in_rows[:, None] & in_cols[None, :]
        cols = col[None, :]
        part_a = tl.load(a + (batch * a_rb + head * a_rh + row64[:, None]) * a_sl + cols, mask=both, other=0.0)
        part_b = tl.load(b + (batch * b_rb + head * b_rh + row64[:, None]) * b_sl + cols, mask=both, other=0.0)
        result = part_a.to(tl.float32) * keep + part_b.to(tl.float32) * add
        tl.store(d + (batch * d_rb + head * d_rh + row64[:, None]) * d_sl + cols, result.to(d.dtype.element_ty),
                 mask=both)
        tl.store(lse_a + batch * la_sb + head * la_sh + row64 * la_sl, merged, mask=in_rows)

    return lse_merge
