"""The Triton kernels of ``fused_merge``, a module of their own so that it alone imports
Triton (it ships with torch's CUDA builds only) and the kernels call each other by name.

Lengths and the strides of batches and heads change with every packed batch's document
boundaries; specialised on them, Triton would compile a kernel for each new pattern (tens of
ms): they are not specialised (``*_FREE``, the names ``do_not_specialize`` takes). Batch and
head strides count rows, so addresses stay aligned to a row's stride.

Each kernel takes one or two ranges of rows: rows 0 to ``length`` of its tensors and, where
``length2`` > 0, rows ``jump`` to ``jump + length2`` of the same tensors (a joined call's
results over two row ranges, and what they merge into): one launch where there would be two."""
import triton
import triton.language as tl

_strides = [f"x{i}_r{s}" for i in range(4) for s in "bh"]  # the parts' batch and head strides, then their stats'
_strides += [f"{n}{i}_s{s}" for n in "lr" for i in range(4) for s in "bh"]

MERGE_FREE = ["heads", "length", "jump", "length2", *_strides, "d_rb", "d_rh", "lo_sb", "lo_sh", "ro_sb", "ro_sh"]


@triton.jit
def block_rows(length, jump, length2, BLOCK_ROWS: tl.constexpr):
    """This program's rows (int64) and which of them are in range: the row blocks of rows 0 to
    ``length`` come first, then those of rows ``jump`` to ``jump + length2``."""
    block = tl.program_id(1)
    first = tl.cdiv(length, BLOCK_ROWS)
    second = block >= first
    start = tl.where(second, jump + (block - first) * BLOCK_ROWS, block * BLOCK_ROWS)
    end = tl.where(second, jump + length2, length)
    row = start + tl.arange(0, BLOCK_ROWS)
    return row.to(tl.int64), row < end


@triton.jit
def weight(lse, top, r, batch, head, row64, r_sb, r_sh, r_sl, in_rows, RES: tl.constexpr):
    """A part's weight in a merge, exp(lse - top + res): its res (where ``RES``) added after the
    difference, which is exact where every lse is huge and equal (``merge.lse_weights``)."""
    w = lse - top
    if RES:
        w += tl.load(r + batch * r_sb + head * r_sh + row64 * r_sl, mask=in_rows, other=0.0)
    return tl.exp(w)


@triton.jit(do_not_specialize=MERGE_FREE)
def lse_merge(x0, x1, x2, x3, l0, l1, l2, l3, r0, r1, r2, r3, d, lo, ro, heads, length, jump, length2, dim,
              x0_rb, x0_rh, x0_sl, x1_rb, x1_rh, x1_sl, x2_rb, x2_rh, x2_sl, x3_rb, x3_rh, x3_sl,
              l0_sb, l0_sh, l0_sl, l1_sb, l1_sh, l1_sl, l2_sb, l2_sh, l2_sl, l3_sb, l3_sh, l3_sl,
              r0_sb, r0_sh, r0_sl, r1_sb, r1_sh, r1_sl, r2_sb, r2_sh, r2_sl, r3_sb, r3_sh, r3_sl,
              d_rb, d_rh, d_sl, lo_sb, lo_sh, lo_sl, ro_sb, ro_sh, ro_sl,
              PARTS: tl.constexpr, RES0: tl.constexpr, RES1: tl.constexpr, RES2: tl.constexpr,
              RES3: tl.constexpr, RES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    bh = tl.program_id(0)
    batch, head = (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)
    row64, in_rows = block_rows(length, jump, length2, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_DIM)
    in_cols = col < dim
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
    w0 = weight(s0, top, r0, batch, head, row64, r0_sb, r0_sh, r0_sl, in_rows, RES0)
    w1 = weight(s1, top, r1, batch, head, row64, r1_sb, r1_sh, r1_sl, in_rows, RES1)
    total = w0 + w1
    if PARTS > 2:
        w2 = weight(s2, top, r2, batch, head, row64, r2_sb, r2_sh, r2_sl, in_rows, RES2)
        total += w2
    if PARTS > 3:
        w3 = weight(s3, top, r3, batch, head, row64, r3_sb, r3_sh, r3_sl, in_rows, RES3)
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
def sum_rows(a, b, c, e, d, batch, head, length, jump, length2, dim, a_rb, a_rh, a_sl, b_rb, b_rh, b_sl,
             c_rb, c_rh, c_sl, e_rb, e_rh, e_sl, d_rb, d_rh, d_sl, PARTS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
             BLOCK_DIM: tl.constexpr):
    row, in_rows = block_rows(length, jump, length2, BLOCK_ROWS)
    col = tl.arange(0, BLOCK_DIM)
    both = in_rows[:, None] & (col < dim)[None, :]
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


SUM_FREE = ["heads", "length", "jump", "length2", "a_rb", "a_rh", "b_rb", "b_rh", "c_rb", "c_rh", "e_rb", "e_rh",
            "d_rb", "d_rh"]


@triton.jit(do_not_specialize=SUM_FREE)
def sum_parts(a, b, c, e, d, heads, length, jump, length2, dim, a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl,
              e_rb, e_rh, e_sl, d_rb, d_rh, d_sl, PARTS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
              BLOCK_DIM: tl.constexpr):
    bh = tl.program_id(0)
    sum_rows(a, b, c, e, d, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64), length, jump, length2, dim,
             a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl, e_rb, e_rh, e_sl, d_rb, d_rh, d_sl,
             PARTS, BLOCK_ROWS, BLOCK_DIM)


PAIR_FREE = SUM_FREE + [f"{n}2" for n in SUM_FREE[4:]]


@triton.jit(do_not_specialize=PAIR_FREE)
def sum_pairs(a, b, c, e, d, a2, b2, c2, e2, d2, heads, length, jump, length2, dim, dim2,
              a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl, e_rb, e_rh, e_sl, d_rb, d_rh, d_sl,
              a_rb2, a_rh2, a_sl2, b_rb2, b_rh2, b_sl2, c_rb2, c_rh2, c_sl2, e_rb2, e_rh2, e_sl2,
              d_rb2, d_rh2, d_sl2, PARTS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    half = tl.num_programs(0) // 2  # the first half of the programs sums the first, the rest the second
    bh = tl.program_id(0)
    if bh < half:
        sum_rows(a, b, c, e, d, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64), length, jump, length2, dim,
                 a_rb, a_rh, a_sl, b_rb, b_rh, b_sl, c_rb, c_rh, c_sl, e_rb, e_rh, e_sl, d_rb, d_rh, d_sl,
                 PARTS, BLOCK_ROWS, BLOCK_DIM)
    else:
        bh -= half
        sum_rows(a2, b2, c2, e2, d2, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64), length, jump, length2,
                 dim2, a_rb2, a_rh2, a_sl2, b_rb2, b_rh2, b_sl2, c_rb2, c_rh2, c_sl2, e_rb2, e_rh2, e_sl2,
                 d_rb2, d_rh2, d_sl2, PARTS, BLOCK_ROWS, BLOCK_DIM)
