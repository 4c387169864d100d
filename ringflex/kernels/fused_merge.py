"""Partial results combined in one pass on a CUDA GPU (Triton): the log-sum-exp merge of two
to four attention outputs, the sum of two to four gradient parts (two such sums in one launch:
a block's dK and dV), and the copy of a block's rows.

In torch the merge takes two passes over the rows (one part scaled into an fp32 temporary,
then the other added into the result), and a sum of bf16 parts that must not be rounded
before the last one takes a pass per part (the first widened into an fp32 buffer); on the
ring's critical path every pass is time the attention kernels wait for. Here each part is
read once and the result written once, computed in fp32 and rounded once into the result's
dtype. Over rows of a block (views whose heads lie whole blocks apart) these kernels also run
at full bandwidth where torch's elementwise kernels take twice as long as over as many
contiguous bytes. Triton ships with torch's CUDA builds and is imported on first use.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .launch import Launcher

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_ROWS = 32
_MAX_ROWS = 65535 * _BLOCK_ROWS
MAX_PARTS = 4  # the most parts one merge or sum takes


def applies(d: Tensor, parts: Sequence[Tuple[Tensor, Tensor, Optional[Tensor]]], lse: Tensor,
            res: Optional[Tensor] = None) -> bool:
    """Whether the fused merge can take these tensors: two to four parts on one CUDA device,
    rows of contiguous elements whose batches and heads are whole rows apart, no float64
    (its weights are fp32)."""
    stats = [t for _, part_lse, part_res in parts for t in (part_lse, part_res) if t is not None]
    stats += [t for t in (lse, res) if t is not None]
    return (2 <= len(parts) <= MAX_PARTS and _in_rows_of_one_gpu(d, *(x for x, _, _ in parts))
            and all(t.device == d.device and t.dtype == torch.float32 for t in stats))


def sum_applies(d: Tensor, parts: Sequence[Tensor]) -> bool:
    """Whether ``add`` can take these tensors (laid out as ``applies`` asks, no float64)."""
    return 1 <= len(parts) <= MAX_PARTS and _in_rows_of_one_gpu(d, *parts)


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


def merge(d: Tensor, parts: Sequence[Tuple[Tensor, Tensor, Optional[Tensor]]], lse: Tensor,
          res: Optional[Tensor] = None) -> None:
    """d = sum over the parts of exp(lse_i - m) * x_i, and lse = m = the log of the sum of
    exp(lse_i), for two to four parts (x_i, lse_i, res_i) of [B, H, L, D] rows and [B, H, L]
    lse (``d`` may be one of the x_i, ``lse`` one of the lse_i), each LSE given as lse + res
    (``merge.lse_weights``; res None: 0), ``res`` (where given) taking the merged one's. Rows
    where every lse is -inf get 0, lse -inf and res 0."""
    count = len(parts)
    padded = list(parts) + [parts[0]] * (MAX_PARTS - count)  # unread beyond ``count``
    xs = [x for x, _, _ in padded]
    lses = [part_lse for _, part_lse, _ in padded]
    ress = [part_lse if part_res is None else part_res for _, part_lse, part_res in padded]
    has = {f"RES{i}": i < count and parts[i][2] is not None for i in range(MAX_PARTS)}
    for rows in _launches(*xs, *lses, *ress, d, lse, lse if res is None else res):
        xs_, lses_, ress_ = rows[:4], rows[4:8], rows[8:12]
        d_, lse_, res_ = rows[12:]
        _kernels()[0].launch(_grid(d_), (
            *xs_, *lses_, *ress_, d_, lse_, res_, d.shape[1], d_.shape[2], d.shape[3],
            *(n for x in xs_ for n in _in_rows(x)), *(n for t in lses_ for n in t.stride()),
            *(n for t in ress_ for n in t.stride()), *_in_rows(d_), *lse_.stride(), *res_.stride()),
            dict(PARTS=count, **has, RES=res is not None, **_blocks(d)))


def add(d: Tensor, parts: Sequence[Tensor], beside: Optional[Tuple[Tensor, Sequence[Tensor]]] = None) -> None:
    """d = the sum of one to four [B, H, L, D] ``parts``, in fp32, rounded once into ``d``
    (which may be one of them); one part: a copy. ``beside``: another such (d, parts) that
    ``pair_applies`` to (a block's dV beside its dK), summed in the same launch."""
    jobs = [(d, parts)] + ([beside] if beside is not None else [])
    tensors = [t for job_d, job_parts in jobs for t in _padded(job_parts) + [job_d]]
    for rows in _launches(*tensors):
        if beside is None:
            _kernels()[1].launch(*_add_arguments(rows, len(parts)))
        else:
            _kernels()[2].launch(*_pair_arguments(rows, len(parts)))


def pair_applies(first: Tuple[Tensor, Sequence[Tensor]], second: Tuple[Tensor, Sequence[Tensor]]) -> bool:
    """Whether ``add`` can sum ``second`` beside ``first`` in one launch: each as ``sum_applies``
    asks, as many parts, the same batch, heads and rows (the head dims may differ)."""
    (d, parts), (d2, parts2) = first, second
    return (len(parts) == len(parts2) and d.shape[:3] == d2.shape[:3] and d.device == d2.device
            and sum_applies(d, parts) and sum_applies(d2, parts2))


def _padded(parts: Sequence[Tensor]) -> list:
    """``parts`` filled up to ``MAX_PARTS`` with the first (unread beyond ``len(parts)``)."""
    return list(parts) + [parts[0]] * (MAX_PARTS - len(parts))


def _add_arguments(rows: Sequence[Tensor], count: int):
    """(grid, arguments, constants) of the sum of ``count`` parts over ``rows`` (a, b, c, e, d)."""
    a, b, c, e, d = rows
    arguments = (a, b, c, e, d, d.shape[1], d.shape[2], d.shape[3],
                 *_in_rows(a), *_in_rows(b), *_in_rows(c), *_in_rows(e), *_in_rows(d))
    return _grid(d), arguments, dict(PARTS=count, **_blocks(d))


def _pair_arguments(rows: Sequence[Tensor], count: int):
    """(grid, arguments, constants) of two sums of ``count`` parts each over ``rows`` (a, b,
    c, e, d of the first, then of the second): twice the programs, the second half the second's."""
    first, second = rows[:5], rows[5:]
    d, d2 = first[-1], second[-1]
    arguments = (*first, *second, d.shape[1], d.shape[2], d.shape[3], d2.shape[3],
                 *(n for t in rows for n in _in_rows(t)))
    batches_heads, row_blocks = _grid(d)
    wider = d if d.shape[3] >= d2.shape[3] else d2
    return (2 * batches_heads, row_blocks), arguments, dict(PARTS=count, **_blocks(wider))


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
    return dict(BLOCK_ROWS=_BLOCK_ROWS, BLOCK_DIM=max(16, 1 << (d.shape[3] - 1).bit_length()))


def _in_rows(t: Tensor):
    """Batch and head strides in rows, and the row stride (in elements)."""
    batch, head, row = t.stride()[:3]
    return batch // row, head // row, row


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    # Lengths and the strides of batches and heads change with every packed batch's document
    # boundaries; specialised on them, Triton would compile a kernel for each new pattern (tens
    # of ms). Batch and head strides count rows, so addresses stay aligned to a row's stride.
    strides = [f"x{i}_r{s}" for i in range(4) for s in "bh"]  # the parts' batch and head strides, then their stats'
    strides += [f"{n}{i}_s{s}" for n in "lr" for i in range(4) for s in "bh"]

    merge_free = ["heads", "length", *strides, "d_rb", "d_rh", "lo_sb", "lo_sh", "ro_sb", "ro_sh"]

    @triton.jit(do_not_specialize=merge_free)
    def lse_merge(x0, x1, x2, x3, l0, l1, l2, l3, r0, r1, r2, r3, d, lo, ro, heads, length, dim,
                  x0_rb, x0_rh, x0_sl, x1_rb, x1_rh, x1_sl, x2_rb, x2_rh, x2_sl, x3_rb, x3_rh, x3_sl,
                  l0_sb, l0_sh, l0_sl, l1_sb, l1_sh, l1_sl, l2_sb, l2_sh, l2_sl, l3_sb, l3_sh, l3_sl,
                  r0_sb, r0_sh, r0_sl, r1_sb, r1_sh, r1_sl, r2_sb, r2_sh, r2_sl, r3_sb, r3_sh, r3_sl,
                  d_rb, d_rh, d_sl, lo_sb, lo_sh, lo_sl, ro_sb, ro_sh, ro_sl,
                  PARTS: tl.constexpr, RES0: tl.constexpr, RES1: tl.constexpr, RES2: tl.constexpr,
                  RES3: tl.constexpr, RES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        bh = tl.program_id(0)
        batch, head = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
        row = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.arange(0, BLOCK_DIM)
        in_rows, in_cols = row < length, col < dim
        row64 = row.to(tl.int64)
        ninf = float("-inf")
        s0 = tl.load(l0 + batch * l0_sb + head * l0_sh + row64 * l0_sl, mask=in_rows, other=ninf)
        s1 = tl.load(l1 + batch * l1_sb + head * l1_sh + row64 * l1_sl, mask=in_rows, other=ninf)
        top = tl.maximum(s0, s1)
        if PARTS > 2:
            s2 = tl.load(l2 + batch * l2_sb + head * l2_sh + row64 * l2_sl, mask=in_rows, other=ninf)
            top = tl.maximum(top, s2)
        if PARTS > 3:
            s3 = tl.load(l3 + batch * l3_sb + head * l3_sh + row64 * l3_sl, mask=in_rows, other=ninf)
            top = tl.maximum(top, s3)
        top = tl.where(top == ninf, 0.0, top)  # rows that see no key: weights 0, lse -inf
        # res after the difference: exact where every lse is huge and equal (merge.lse_weights)
        w0, w1 = s0 - top, s1 - top
        if RES0:
            w0 += tl.load(r0 + batch * r0_sb + head * r0_sh + row64 * r0_sl, mask=in_rows, other=0.0)
        if RES1:
            w1 += tl.load(r1 + batch * r1_sb + head * r1_sh + row64 * r1_sl, mask=in_rows, other=0.0)
        w0, w1 = tl.exp(w0), tl.exp(w1)
        total = w0 + w1
        if PARTS > 2:
            w2 = s2 - top
            if RES2:
                w2 += tl.load(r2 + batch * r2_sb + head * r2_sh + row64 * r2_sl, mask=in_rows, other=0.0)
            w2 = tl.exp(w2)
            total += w2
        if PARTS > 3:
            w3 = s3 - top
            if RES3:
                w3 += tl.load(r3 + batch * r3_sb + head * r3_sh + row64 * r3_sl, mask=in_rows, other=0.0)
            w3 = tl.exp(w3)
            total += w3
        seen = total > 0
        inv = tl.where(seen, 1.0 / tl.where(seen, total, 1.0), 0.0)
        log_sum = tl.log(tl.where(seen, total, 1.0))
        merged = tl.where(seen, top + log_sum, ninf)
        both = in_rows[:, None] & in_cols[None, :]
        cols = col[None, :]
        result = tl.load(x0 + (batch * x0_rb + head * x0_rh + row64[:, None]) * x0_sl + cols, mask=both,
                           other=0.0).to(tl.float32) * (w0 * inv)[:, None]
        result += tl.load(x1 + (batch * x1_rb + head * x1_rh + row64[:, None]) * x1_sl + cols, mask=both,
                           other=0.0).to(tl.float32) * (w1 * inv)[:, None]
        if PARTS > 2:
            result += tl.load(x2 + (batch * x2_rb + head * x2_rh + row64[:, None]) * x2_sl + cols, mask=both,
                           other=0.0).to(tl.float32) * (w2 * inv)[:, None]
        if PARTS > 3:
            result += tl.load(x3 + (batch * x3_rb + head * x3_rh + row64[:, None]) * x3_sl + cols, mask=both,
                           other=0.0).to(tl.float32) * (w3 * inv)[:, None]
        tl.store(d + (batch * d_rb + head * d_rh + row64[:, None]) * d_sl + cols, result.to(d.dtype.element_ty),
                 mask=both)
        tl.store(lo + batch * lo_sb + head * lo_sh + row64 * lo_sl, merged, mask=in_rows)
        if RES:
            tl.store(ro + batch * ro_sb + head * ro_sh + row64 * ro_sl,
                     tl.where(seen, (top - merged) + log_sum, 0.0), mask=in_rows)

    @triton.jit
    def sum_rows(a, b, c, e, d, batch, head, length, dim, a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl,
                 e_rb, e_rh, e_sl, d_rb, d_rh, d_sl, PARTS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_DIM: tl.constexpr):
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

    sum_free = ["heads", "length", "a_rb", "a_rh", "b_rb", "b_rh", "c_rb", "c_rh", "e_rb", "e_rh", "d_rb", "d_rh"]

    @triton.jit(do_not_specialize=sum_free)
    def sum_parts(a, b, c, e, d, heads, length, dim, a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl,
                  e_rb, e_rh, e_sl, d_rb, d_rh, d_sl, PARTS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCK_DIM: tl.constexpr):
        bh = tl.program_id(0)
        sum_rows(a, b, c, e, d, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64), length, dim,
                 a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl, e_rb, e_rh, e_sl, d_rb, d_rh, d_sl,
                 PARTS, BLOCK_ROWS, BLOCK_DIM)

    pair_free = sum_free + [f"{n}2" for n in sum_free[2:]]

    @triton.jit(do_not_specialize=pair_free)
    def sum_pairs(a, b, c, e, d, a2, b2, c2, e2, d2, heads, length, dim, dim2,
                  a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl, e_rb, e_rh, e_sl, d_rb, d_rh, d_sl,
                  a_rb2, a_rh2, a_sl2, b_rb2, b_rh2, b_sl2, c_rb2, c_rh2, c_sl2, e_rb2, e_rh2, e_sl2,
                  d_rb2, d_rh2, d_sl2, PARTS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
        half = tl.num_programs(0) // 2  # the first half of the programs sums the first, the rest the second
        bh = tl.program_id(0)
        if bh < half:
            sum_rows(a, b, c, e, d, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64), length, dim,
                     a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl, e_rb, e_rh, e_sl, d_rb, d_rh, d_sl,
                     PARTS, BLOCK_ROWS, BLOCK_DIM)
        else:
            bh -= half
            sum_rows(a2, b2, c2, e2, d2, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64), length, dim2,
                     a_rb2, a_rh2, a_sl2, b_rb2, b_rh2, b_sl2, c_rb2, c_rh2, c_sl2, e_rb2, e_rh2, e_sl2,
                     d_rb2, d_rh2, d_sl2, PARTS, BLOCK_ROWS, BLOCK_DIM)

    return (Launcher(lse_merge, merge_free, num_warps=4), Launcher(sum_parts, sum_free, num_warps=4),
            Launcher(sum_pairs, pair_free, num_warps=4))
