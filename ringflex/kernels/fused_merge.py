"""Partial results combined in one pass on a CUDA GPU (Triton): the log-sum-exp merge of two
attention outputs, the sum of two to four gradient parts, and the copy of a block's rows.

In torch the merge takes two passes over the rows (one part scaled into an fp32 temporary,
then the other added into the result), and a sum of bf16 parts that must not be rounded
before the last one takes a pass per part (the first widened into an fp32 buffer); on the
ring's critical path every pass is time the attention kernels wait for. Here each part is
read once and the result written once, computed in fp32 and rounded once into the result's
dtype. Over rows of a block (views whose heads lie whole blocks apart) these kernels also run
at full bandwidth where torch's elementwise kernels take twice as long (H200: a copy of
[1, 32, 4096, 128] bf16 rows 42 us against 19 us for as many contiguous bytes). Triton ships
with torch's CUDA builds and is imported on first use.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_ROWS = 32
_MAX_ROWS = 65535 * _BLOCK_ROWS


def applies(d: Tensor, a: Tensor, b: Tensor, lse_a: Tensor, lse_b: Tensor, res_a: Optional[Tensor] = None,
            res_b: Optional[Tensor] = None) -> bool:
    """Whether the fused merge can take these tensors: on one CUDA device, rows of
    contiguous elements whose batches and heads are whole rows apart, no float64 (its
    weights are fp32)."""
    stats = [t for t in (lse_a, lse_b, res_a, res_b) if t is not None]
    return _in_rows_of_one_gpu(d, a, b) and all(t.device == d.device and t.dtype == torch.float32 for t in stats)


def sum_applies(d: Tensor, parts: Sequence[Tensor]) -> bool:
    """Whether ``add`` can take these tensors (laid out as ``applies`` asks, no float64)."""
    return 1 <= len(parts) <= 4 and _in_rows_of_one_gpu(d, *parts)


def _in_rows_of_one_gpu(d: Tensor, *others: Tensor) -> bool:
    """[B, H, L, D] tensors on d's GPU, as the kernels index them."""
    return d.is_cuda and all(t.device == d.device for t in others) and all(
        t.dim() == 4 and t.dtype in _DTYPES and t.stride(-1) == 1 and t.stride(0) % t.stride(2) == 0
        and t.stride(1) % t.stride(2) == 0 for t in (d, *others))


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        _kernels()
    except ImportError:
        return False
    return True


def merge(d: Tensor, a: Tensor, lse_a: Tensor, b: Tensor, lse_b: Tensor, res_a: Optional[Tensor] = None,
          res_b: Optional[Tensor] = None) -> None:
    """d = exp(lse_a - m) * a + exp(lse_b - m) * b, and lse_a = m = logaddexp(lse_a, lse_b),
    for [B, H, L, D] rows ``a``, ``b``, ``d`` and [B, H, L] lse (``d`` may be ``a``), each LSE
    given as lse + res (``merge.lse_weights``; res None: 0), ``res_a`` (where given) taking
    the merged one's. Rows where both lse are -inf get 0, lse -inf and res 0."""
    has = dict(RES_A=res_a is not None, RES_B=res_b is not None)
    res_a, res_b = (lse if res is None else res for lse, res in ((lse_a, res_a), (lse_b, res_b)))  # unread if absent
    for rows in _launches(a, b, d, lse_a, lse_b, res_a, res_b):
        a_, b_, d_, lse_a_, lse_b_, res_a_, res_b_ = rows
        _kernels()[0][_grid(d_)](
            a_, b_, d_, lse_a_, lse_b_, res_a_, res_b_, d.shape[1], d_.shape[2], d.shape[3],
            *_in_rows(a_), *_in_rows(b_), *_in_rows(d_), *lse_a_.stride(), *lse_b_.stride(), *res_a_.stride(),
            *res_b_.stride(), **has, **_blocks(d))


def add(d: Tensor, parts: Sequence[Tensor]) -> None:
    """d = the sum of one to four [B, H, L, D] ``parts``, in fp32, rounded once into ``d``
    (which may be one of them); one part: a copy."""
    a, b, c, e = (list(parts) + [parts[0]] * 3)[:4]  # unread beyond ``len(parts)``
    for rows in _launches(a, b, c, e, d):
        a_, b_, c_, e_, d_ = rows
        _kernels()[1][_grid(d_)](
            a_, b_, c_, e_, d_, d.shape[1], d_.shape[2], d.shape[3],
            *_in_rows(a_), *_in_rows(b_), *_in_rows(c_), *_in_rows(e_), *_in_rows(d_), PARTS=len(parts),
            **_blocks(d))


def _launches(*tensors: Tensor):
    """The tensors' rows, cut into the ranges one launch takes: a grid's second axis takes at
    most 65535 programs."""
    length = tensors[0].shape[2]
    if tensors[0].numel() == 0:
        return
    if length <= _MAX_ROWS:  # one launch: no views to make (4 us of host time each)
        yield tensors
        return
    for start in range(0, length, _MAX_ROWS):
        n = min(_MAX_ROWS, length - start)
        yield [t.narrow(2, start, n) for t in tensors]


def _grid(d: Tensor):
    return d.shape[0] * d.shape[1], -(-d.shape[2] // _BLOCK_ROWS)


def _blocks(d: Tensor) -> dict:
    return dict(BLOCK_ROWS=_BLOCK_ROWS, BLOCK_DIM=max(16, 1 << (d.shape[3] - 1).bit_length()), num_warps=4)


def _in_rows(t: Tensor):
    """Batch and head strides in rows, and the row stride (in elements)."""
    row = t.stride(2)
    return t.stride(0) // row, t.stride(1) // row, row


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    # Lengths and the strides of batches and heads change with every packed batch's document
    # boundaries; specialised on them, Triton would compile a kernel for each new pattern (tens
    # of ms). Batch and head strides count rows, so addresses stay aligned to a row's stride.
    @triton.jit(do_not_specialize=["heads", "length", "a_rb", "a_rh", "b_rb", "b_rh", "d_rb", "d_rh",
                                   "la_sb", "la_sh", "lb_sb", "lb_sh", "ra_sb", "ra_sh", "rb_sb", "rb_sh"])
    def lse_merge(a, b, d, lse_a, lse_b, res_a, res_b, heads, length, dim,
                  a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, d_rb, d_rh, d_sl,
                  la_sb, la_sh, la_sl, lb_sb, lb_sh, lb_sl, ra_sb, ra_sh, ra_sl, rb_sb, rb_sh, rb_sl,
                  RES_A: tl.constexpr, RES_B: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
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
        # res after the difference: exact where both lse are huge and equal (merge.lse_weights)
        w_a, w_b = x_a - top, x_b - top
        if RES_A:
            w_a += tl.load(res_a + batch * ra_sb + head * ra_sh + row64 * ra_sl, mask=in_rows, other=0.0)
        if RES_B:
            w_b += tl.load(res_b + batch * rb_sb + head * rb_sh + row64 * rb_sl, mask=in_rows, other=0.0)
        w_a, w_b = tl.exp(w_a), tl.exp(w_b)
        total = w_a + w_b
        seen = total > 0
        inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
        log_sum = tl.log(tl.where(seen, total, 1.0))
        merged = tl.where(seen, top + log_sum, float("-inf"))
        keep, add = (w_a * inv)[:, None], (w_b * inv)[:, None]
        both = in_rows[:, None] & in_cols[None, :]
        cols = col[None, :]
        part_a = tl.load(a + (batch * a_rb + head * a_rh + row64[:, None]) * a_sl + cols, mask=both, other=0.0)
        part_b = tl.load(b + (batch * b_rb + head * b_rh + row64[:, None]) * b_sl + cols, mask=both, other=0.0)
        result = part_a.to(tl.float32) * keep + part_b.to(tl.float32) * add
        tl.store(d + (batch * d_rb + head * d_rh + row64[:, None]) * d_sl + cols, result.to(d.dtype.element_ty),
                 mask=both)
        tl.store(lse_a + batch * la_sb + head * la_sh + row64 * la_sl, merged, mask=in_rows)
        if RES_A:
            tl.store(res_a + batch * ra_sb + head * ra_sh + row64 * ra_sl,
                     tl.where(seen, (top - merged) + log_sum, 0.0), mask=in_rows)

    @triton.jit(do_not_specialize=["heads", "length", "a_rb", "a_rh", "b_rb", "b_rh", "c_rb", "c_rh", "e_rb", "e_rh",
                                   "d_rb", "d_rh"])
    def sum_parts(a, b, c, e, d, heads, length, dim, a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl,
                  e_rb, e_rh, e_sl, d_rb, d_rh, d_sl, PARTS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCK_DIM: tl.constexpr):
        bh = tl.program_id(0)
        batch, head = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
        row = (tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        col = tl.arange(0, BLOCK_DIM)
        both = (row < length)[:, None] & (col < dim)[None, :]
        cols = col[None, :]
        total = tl.load(a + (batch * a_rb + head * a_rh + row[:, None]) * a_sl + cols, mask=both).to(tl.float32)
        if PARTS > 1:
            total += tl.load(b + (batch * b_rb + head * b_rh + row[:, None]) * b_sl + cols, mask=both).to(tl.float32)
        if PARTS > 2:
            total += tl.load(c + (batch * c_rb + head * c_rh + row[:, None]) * c_sl + cols, mask=both).to(tl.float32)
        if PARTS > 3:
            total += tl.load(e + (batch * e_rb + head * e_rh + row[:, None]) * e_sl + cols, mask=both).to(tl.float32)
        tl.store(d + (batch * d_rb + head * d_rh + row[:, None]) * d_sl + cols, total.to(d.dtype.element_ty),
                 mask=both)

    return lse_merge, sum_parts
