"""Accumulating hop results: the log-sum-exp merge of outputs, and sums of gradients.

Accumulators start as ``torch.empty``: a ``Coverage`` remembers which rows were written, so
the first result for a row range is copied in (no zero-fill, no add) and only rows that no
hop wrote are filled at the end. On a GPU each saved pass over an fp32 buffer is time the
ring would otherwise spend outside its attention kernels.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

Rows = Tuple[int, int]


def rows(x: Tensor, r: Rows) -> Tensor:
    """The rows ``r`` of a [B, H, L, ...] tensor (a view)."""
    return x.narrow(2, r[0], r[1] - r[0])


class Coverage:
    """The row ranges of an accumulator written so far."""

    def __init__(self):
        self.ranges: List[Rows] = []

    def fresh(self, r: Rows) -> bool:
        """No earlier write touched any row of ``r``."""
        return not any(b < r[1] and r[0] < e for b, e in self.ranges)

    def gaps(self, r: Rows) -> List[Rows]:
        """The parts of ``r`` that no write touched."""
        gaps, pos = [], r[0]
        for begin, end in sorted(self.ranges):
            if begin > pos:
                gaps.append((pos, min(begin, r[1])))
            pos = max(pos, end)
            if pos >= r[1]:
                break
        if pos < r[1]:
            gaps.append((pos, r[1]))
        return [g for g in gaps if g[0] < g[1]]

    def add(self, r: Rows) -> None:
        self.ranges.append(r)


def add_(totals: Sequence[Tensor], written: Coverage, r: Rows, parts: Sequence[Tensor]) -> None:
    """``total[r] += part`` for each pair, where rows never written count as zero."""
    fresh = written.fresh(r)
    for total, part in zip(totals, parts):
        if fresh:
            rows(total, r).copy_(part)
        else:
            for gap in written.gaps(r):
                rows(total, gap).zero_()
            rows(total, r).add_(part)
    written.add(r)


def zero_gaps_(totals: Sequence[Tensor], written: Coverage, length: int) -> None:
    """Zeroes the rows below ``length`` that no write touched."""
    for gap in written.gaps((0, length)):
        for total in totals:
            rows(total, gap).zero_()
        written.add(gap)


def merge_(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor, first: bool = False) -> None:
    """Folds one hop's (part_out, part_lse) into the running (out, lse), in place.

    ``first``: nothing was merged into these rows yet, so this is a copy. Rows that saw no
    key so far and none in this hop keep lse -inf and out 0, never NaN.
    """
    if first:
        out.copy_(part_out)
        lse.copy_(part_lse)
        return
    new_lse = torch.logaddexp(lse, part_lse)
    finite = torch.where(new_lse.isneginf(), 0.0, new_lse)
    keep, add = torch.exp(lse - finite).unsqueeze(-1), torch.exp(part_lse - finite).unsqueeze(-1)
    if out.dtype in (torch.float32, torch.float64):
        out.mul_(keep).addcmul_(part_out, add.to(out.dtype))
    else:  # a low-precision output (a kernel's own): merge in fp32, round once
        out.copy_(out.float() * keep + part_out.float() * add)
    lse.copy_(new_lse)


def merge_rows_(out: Tensor, lse: Tensor, written: Coverage, r: Rows, part_out: Tensor, part_lse: Tensor) -> None:
    """``merge_`` of one hop's result into rows ``r`` of the running (out, lse)."""
    fresh = written.fresh(r)
    if not fresh:
        for gap in written.gaps(r):
            clear_(out, lse, written, gap)
    merge_(rows(out, r), rows(lse, r), part_out, part_lse, first=fresh)
    written.add(r)


def clear_(out: Tensor, lse: Tensor, written: Coverage, r: Rows) -> None:
    """Rows that see no key: output 0, lse -inf."""
    rows(out, r).zero_()
    rows(lse, r).fill_(-math.inf)
    written.add(r)


def finish_(out: Tensor, lse: Tensor, written: Coverage) -> None:
    """Clears the rows no hop wrote."""
    for gap in written.gaps((0, out.shape[2])):
        clear_(out, lse, written, gap)
