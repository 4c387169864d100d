"""Partial results combined in one pass on a CUDA GPU (Triton): the log-sum-exp merge of two
to four attention outputs, the sum of two to four gradient parts (two such sums in one launch:
a block's dK and dV), and the copy of a block's rows; each over one range of rows or two (a
joined call's results over two row ranges: one launch, where the host's time per launch
bounds short calls).

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
from typing import List, Optional, Sequence, Tuple

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
    return d.is_cuda and all(t.device == d.device for t in others) and _in_rows_of_elements(d, *others)


def _in_rows_of_elements(*tensors: Tensor) -> bool:
    """[B, H, L, D] tensors of a dtype the kernels take, rows of contiguous elements whose
    batches and heads are whole rows apart."""
    return all(t.dim() == 4 and t.dtype in _DTYPES and t.stride(-1) == 1 and t.stride(0) % t.stride(2) == 0
               and t.stride(1) % t.stride(2) == 0 for t in tensors)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        _kernels()
    except ImportError:
        return False
    return True


def merge(d: Tensor, parts: Sequence[Tuple[Tensor, Tensor, Optional[Tensor]]], lse: Tensor,
          res: Optional[Tensor] = None, then: Optional[Tuple[int, tuple]] = None) -> None:
    """d = sum over the parts of exp(lse_i - m) * x_i, and lse = m = the log of the sum of
    exp(lse_i), for two to four parts (x_i, lse_i, res_i) of [B, H, L, D] rows and [B, H, L]
    lse (``d`` may be one of the x_i, ``lse`` one of the lse_i), each LSE given as lse + res
    (``merge.lse_weights``; res None: 0), ``res`` (where given) taking the merged one's. Rows
    where every lse is -inf get 0, lse -inf and res 0. ``then``: (rows apart, a second merge
    (d, parts, lse, res)) as ``merge_rows_apart`` found them, in the same launch."""
    count = len(parts)
    tensors = _merge_tensors(d, parts, lse, res)
    has = {f"RES{i}": i < count and parts[i][2] is not None for i in range(MAX_PARTS)}
    for rows, (jump, length2) in _ranges(tensors, then and (then[0], _merge_tensors(*then[1]))):
        xs_, lses_, ress_ = rows[:4], rows[4:8], rows[8:12]
        d_, lse_, res_ = rows[12:]
        _kernels()[0].launch(_grid(d_, length2), (
            *xs_, *lses_, *ress_, d_, lse_, res_, d.shape[1], d_.shape[2], jump, length2, d.shape[3],
            *(n for x in xs_ for n in _in_rows(x)), *(n for t in lses_ for n in t.stride()),
            *(n for t in ress_ for n in t.stride()), *_in_rows(d_), *lse_.stride(), *res_.stride()),
            dict(PARTS=count, **has, RES=res is not None, **_blocks(d)))


def merge_rows_apart(first: tuple, second: tuple) -> Optional[int]:
    """The rows apart (``rows_apart``) of two merges, each (d, parts, lse, res), that ``merge``
    takes in one launch: each as ``applies`` asks, as many parts, a res in the same places;
    None where they are not such."""
    (d, parts, lse, res), (d2, parts2, lse2, res2) = first, second
    if not (len(parts) == len(parts2) and (res is None) == (res2 is None)
            and all((a[2] is None) == (b[2] is None) for a, b in zip(parts, parts2))
            and applies(d, parts, lse, res) and applies(d2, parts2, lse2, res2)):
        return None
    return rows_apart(_read_and_written(*first), _read_and_written(*second))


def _read_and_written(d: Tensor, parts, lse: Tensor, res: Optional[Tensor]) -> List[Tensor]:
    """The tensors a merge reads and writes, each once: the result first."""
    return [d, lse, *(t for part in parts for t in part if t is not None), *([res] if res is not None else [])]


def _merge_tensors(d: Tensor, parts, lse: Tensor, res: Optional[Tensor]) -> List[Tensor]:
    """The merge kernel's tensor arguments, in order: the parts' outputs, LSEs and res (the
    missing ones filled in: unread), then the result's."""
    padded = _padded(parts)
    return ([x for x, _, _ in padded] + [part_lse for _, part_lse, _ in padded]
            + [part_lse if part_res is None else part_res for _, part_lse, part_res in padded]
            + [d, lse, lse if res is None else res])


def add(d: Tensor, parts: Sequence[Tensor], beside: Optional[Tuple[Tensor, Sequence[Tensor]]] = None,
        then: Optional[Tuple[int, Sequence[Tuple[Tensor, Sequence[Tensor]]]]] = None) -> None:
    """d = the sum of one to four [B, H, L, D] ``parts``, in fp32, rounded once into ``d``
    (which may be one of them); one part: a copy. ``beside``: another such (d, parts) that
    ``pair_applies`` to (a block's dV beside its dK), summed in the same launch. ``then``: (rows
    apart, the same sums over other rows: [(d, parts)] and the one beside) as ``sum_rows_apart``
    found them, in the same launch too."""
    jobs = [(d, parts)] + ([beside] if beside is not None else [])
    for rows, (jump, length2) in _ranges(_sum_tensors(jobs), then and (then[0], _sum_tensors(then[1]))):
        if beside is None:
            _kernels()[1].launch(*_add_arguments(rows, len(parts), jump, length2))
        else:
            _kernels()[2].launch(*_pair_arguments(rows, len(parts), jump, length2))


def pair_applies(first: Tuple[Tensor, Sequence[Tensor]], second: Tuple[Tensor, Sequence[Tensor]]) -> bool:
    """Whether ``add`` can sum ``second`` beside ``first`` in one launch: each as ``sum_applies``
    asks, as many parts, the same batch, heads and rows (the head dims may differ)."""
    (d, parts), (d2, parts2) = first, second
    return (len(parts) == len(parts2) and d.shape[:3] == d2.shape[:3] and d.device == d2.device
            and sum_applies(d, parts) and sum_applies(d2, parts2))


def sum_rows_apart(first: Sequence[Tuple[Tensor, Sequence[Tensor]]],
                   second: Sequence[Tuple[Tensor, Sequence[Tensor]]]) -> Optional[int]:
    """The rows apart (``rows_apart``) of two sums (or two pairs of sums ``pair_applies`` to), each
    a list of (d, parts), that ``add`` takes in one launch: as many parts; None where they are not such."""
    if not (len(first) == len(second) and all(len(a[1]) == len(b[1]) for a, b in zip(first, second))
            and (pair_applies(*first) if len(first) == 2 else sum_applies(*first[0]))):
        return None
    return rows_apart([t for d, parts in first for t in (d, *parts)], [t for d, parts in second for t in (d, *parts)])


def _sum_tensors(jobs: Sequence[Tuple[Tensor, Sequence[Tensor]]]) -> List[Tensor]:
    """The sum kernels' tensor arguments, in order: each sum's parts (filled in: unread), then its result."""
    return [t for job_d, job_parts in jobs for t in _padded(job_parts) + [job_d]]


def rows_apart(first: Sequence[Tensor], second: Sequence[Tensor]) -> Optional[int]:
    """The number of rows after each tensor of ``first`` ([B, H, L, ...], the first a result)
    at which its counterpart in ``second`` begins in memory, where it is one for all of them,
    their strides and dtypes are the same and no range of rows reaches into the other (a
    joined call's results over two row ranges, and what they merge into); else None. A kernel
    then reaches the second's rows from the first's addresses and strides. Checked per call
    (a few us of host time), on the tensors a kernel reads and writes, each once."""
    n, n2 = first[0].shape[2], second[0].shape[2]
    if not (n and n2) or first[0].shape[:2] != second[0].shape[:2]:
        return None
    jump = None
    for a, b in zip(first, second):
        stride = a.stride()
        if stride != b.stride() or a.dtype != b.dtype or a.shape[3:] != b.shape[3:]:
            return None
        rows, rest = divmod(b.data_ptr() - a.data_ptr(), stride[2] * a.element_size())
        if rest or rows != (rows if jump is None else jump):
            return None
        jump = rows
    blocks = -(-n // _BLOCK_ROWS) - (-n2 // _BLOCK_ROWS)
    return jump if jump >= n and blocks <= _MAX_ROWS // _BLOCK_ROWS and jump + n2 < 2 ** 31 else None


def _padded(parts: Sequence[Tensor]) -> list:
    """``parts`` filled up to ``MAX_PARTS`` with the first (unread beyond ``len(parts)``)."""
    return list(parts) + [parts[0]] * (MAX_PARTS - len(parts))


def _add_arguments(rows: Sequence[Tensor], count: int, jump: int, length2: int):
    """(grid, arguments, constants) of the sum of ``count`` parts over ``rows`` (a, b, c, e, d)
    and, where ``length2`` > 0, over rows ``jump`` on of them too."""
    a, b, c, e, d = rows
    arguments = (a, b, c, e, d, d.shape[1], d.shape[2], jump, length2, d.shape[3],
                 *_in_rows(a), *_in_rows(b), *_in_rows(c), *_in_rows(e), *_in_rows(d))
    return _grid(d, length2), arguments, dict(PARTS=count, **_blocks(d))


def _pair_arguments(rows: Sequence[Tensor], count: int, jump: int, length2: int):
    """(grid, arguments, constants) of two sums of ``count`` parts each over ``rows`` (a, b,
    c, e, d of the first, then of the second): twice the programs, the second half the second's."""
    first, second = rows[:5], rows[5:]
    d, d2 = first[-1], second[-1]
    arguments = (*first, *second, d.shape[1], d.shape[2], jump, length2, d.shape[3], d2.shape[3],
                 *(n for t in rows for n in _in_rows(t)))
    batches_heads, row_blocks = _grid(d, length2)
    wider = d if d.shape[3] >= d2.shape[3] else d2
    return (2 * batches_heads, row_blocks), arguments, dict(PARTS=count, **_blocks(wider))


def _ranges(tensors: Sequence[Tensor], then: Optional[Tuple[int, Sequence[Tensor]]] = None):
    """The tensors' rows, cut into the ranges one launch takes, each with (jump, length2): the
    second range of rows it takes too (``then``: rows apart, and its tensors), or (0, 0). A
    grid's second axis takes at most 65535 programs."""
    length = tensors[0].shape[2]
    if then is not None:
        yield tensors, (then[0], then[1][0].shape[2])
        return
    if tensors[0].numel() == 0:
        return
    if length <= _MAX_ROWS:  # one launch: no views to make (4 us of host time each)
        yield tensors, (0, 0)
        return
    for start in range(0, length, _MAX_ROWS):
        n = min(_MAX_ROWS, length - start)
        yield [t.narrow(2, start, n) for t in tensors], (0, 0)


def _grid(d: Tensor, length2: int = 0):
    return d.shape[0] * d.shape[1], -(-d.shape[2] // _BLOCK_ROWS) - (-length2 // _BLOCK_ROWS)


def _blocks(d: Tensor) -> dict:
    return dict(BLOCK_ROWS=_BLOCK_ROWS, BLOCK_DIM=max(16, 1 << (d.shape[3] - 1).bit_length()))


def _in_rows(t: Tensor):
    """Batch and head strides in rows, and the row stride (in elements)."""
    batch, head, row = t.stride()[:3]
    return batch // row, head // row, row


@functools.lru_cache(maxsize=None)
def _kernels():
    from . import fused_kernels as kernels  # imports Triton
    return (Launcher(kernels.lse_merge, kernels.MERGE_FREE, num_warps=4),
            Launcher(kernels.sum_parts, kernels.SUM_FREE, num_warps=4),
            Launcher(kernels.sum_pairs, kernels.PAIR_FREE, num_warps=4))
