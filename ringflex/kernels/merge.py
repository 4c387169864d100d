"""Accumulating hop results: the log-sum-exp merge of outputs (``RowMerge``) and sums of
gradients (``RowSum``), for the ring's hops and for the calls a kernel splits a hop into.

The row ranges of every part are known in advance, so each row is combined in fp32 and
rounded once, by the operation that adds its last part; a row with one part is never copied
through fp32, and a part that a kernel writes straight into the result (``destination``) is
not copied at all. On a GPU each saved pass over a buffer is time spent outside the
attention kernels; for the same reason rows of a block that the process group's P2P sends
(which the copy engines read in place) are made contiguous by ``contiguous_rows``.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..config import warn_once as _warn_once
from .base import split_lse
from . import fused_merge

Rows = Tuple[int, int]


def rows(x: Tensor, r: Rows) -> Tensor:
    """The rows ``r`` of a [B, H, L, ...] tensor (a view; ``x`` itself for all of them)."""
    if r[0] == 0 and r[1] == x.shape[2]:
        return x
    return x.narrow(2, r[0], r[1] - r[0])


def optional_rows(t: Optional[Tensor], r: Rows) -> Optional[Tensor]:
    """``rows`` of ``t``, or None where ``t`` is (a res that no part had)."""
    return None if t is None else rows(t, r)


def contiguous_rows(t: Tensor) -> Tensor:
    """``t`` where it is contiguous, else a contiguous copy of it (rows of a block, to send):
    on a GPU by the fused kernel, as torch's copy of such views takes twice as long."""
    if t.is_contiguous():
        return t
    if fused_merge.sum_applies(t, [t]) and fused_merge.available():
        copy = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        fused_merge.add(copy, [t])
        return copy
    return t.contiguous()


class _Span:
    """Rows ``begin:end`` of a result: how many announced parts are still to come, and where
    their value is so far: nowhere (None), ``_ACC`` (the accumulator), ``_DONE`` (the result,
    complete), ``_IN_PLACE`` (the result, a single part written there through ``destination``),
    ``(part, row0)``: rows of a part kept as it came, whose first row is ``row0``, or
    ``_Kept``: several of these."""

    __slots__ = ("begin", "end", "remaining", "state")

    def __init__(self, begin: int, end: int, remaining: int):
        self.begin, self.end, self.remaining, self.state = begin, end, remaining, None


_ACC, _DONE, _IN_PLACE = "acc", "done", "in place"


class _Kept:
    """Parts kept as they came (two or more; the accumulator or the result may be one): the
    part that completes the rows, or the one that fills a pass's inputs, combines them all in
    one pass."""

    __slots__ = ("sources",)

    def __init__(self, sources):
        self.sources = tuple(sources)

    def __eq__(self, other) -> bool:
        return (isinstance(other, _Kept) and len(self.sources) == len(other.sources)
                and all(_same_source(a, b) for a, b in zip(self.sources, other.sources)))


def _sources(state) -> tuple:
    """The parts a span keeps as they came, as a tuple of sources."""
    return state.sources if isinstance(state, _Kept) else (state,)


class _Reused(tuple):
    """A part's tensors in memory that a later call fills again (a receive buffer)."""


class _RowParts:
    """Parts of a result over row ranges announced in advance, each added once, in any order.

    A part is kept as it came until more reach its rows: up to ``PASS_INPUTS - 1`` parts are
    kept (the accumulator counting as one), and the part that completes the rows, or fills a
    pass's inputs, combines them all in one pass, in ``acc_dtype``. So a row with one part
    costs a copy at most (none if one part is the whole result), a row with up to four parts
    one pass (a ring's output or dq over four ranks: one pass, not three through an fp32
    buffer), a row with more a pass per three more, and no row is rounded before its last part.
    """

    PASS_INPUTS = fused_merge.MAX_PARTS  # the most parts one pass combines

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, acc_dtype: torch.dtype, device,
                 expected: Sequence[Rows], empty=torch.empty):
        self.shapes, self.dtype, self.acc_dtype, self.device = list(shapes), dtype, acc_dtype, device
        self.empty = empty  # allocates the buffers: ``empty(shape, dtype=, device=)``
        length = self.shapes[0][2]
        cuts = sorted({0, length, *(b for r in expected for b in r)})
        self.starts = {b: i for i, b in enumerate(cuts)}  # span index by first row
        counts = [0] * len(cuts)  # parts per span, from the changes at range ends
        for b, e in expected:
            counts[self.starts[b]] += 1
            counts[self.starts[e]] -= 1
        self.spans, running = [], 0
        for b, e, change in zip(cuts, cuts[1:], counts):
            running += change
            self.spans.append(_Span(b, e, running))
        self.out: Optional[List[Tensor]] = None
        self.acc: Optional[List[Tensor]] = None
        self.handed_out = {}  # rows -> the views ``destination`` returned for them
        self.pending: List[tuple] = []  # the passes of the parts being added: (dest, held parts, new part, rows)

    def add_each(self, parts: Iterable[tuple]) -> None:
        """``add`` of each of ``parts`` (``add``'s arguments), their passes made together: where
        two of them are over two row ranges of the same tensors (a joined call's results), one
        launch makes both."""
        for args in parts:
            self._add_one(*args)
        if self.pending:
            self._combined()

    def _combined(self) -> None:
        """Makes the passes of the parts just added (``pending``), in order (``_combine``): the
        parts of one ``add_each`` over two row ranges of the same tensors (a joined call's)
        take one launch."""
        pending, self.pending = self.pending, []
        self._combine(pending)

    def destination(self, r: Rows) -> Optional[List[Tensor]]:
        """Views of the result's rows ``r`` for a kernel to write its part into, where no part
        reached them yet (then adding that part copies nothing); else None."""
        spans = self._spans(r)
        if not spans or any(s.state is not None for s in spans):
            return None
        views = [rows(t, r) for t in self._buffers(True)]
        self.handed_out[r] = views
        return views

    def targets(self, spans: Sequence[Rows]) -> Tuple[List[Tensor], List[List[Tensor]]]:
        """Where ONE kernel call writes all of ``spans``: the result's own tensors where no part
        reached any of their rows yet, else new ones like them (``_fresh``); and each span's
        views of them, to ``add``."""
        parts = [self.destination(r) for r in spans]
        if all(parts):
            return self._whole(), parts
        whole = self._fresh()
        return whole, [[rows(t, r) for t in whole] for r in spans]

    def _whole(self) -> List[Tensor]:
        return self.out

    def _fresh(self) -> List[Tensor]:
        """New tensors of the result's shapes and dtype, allocated as its own are."""
        return self._allocated(self.dtype)

    def _allocated(self, dtype: torch.dtype) -> List[Tensor]:
        return [self.empty(s, dtype=dtype, device=self.device) for s in self.shapes]

    def _spans(self, r: Rows) -> List[_Span]:
        """The spans that make up rows ``r`` (none if ``r`` was not announced)."""
        first, last = self.starts.get(r[0]), self.starts.get(r[1])
        return self.spans[first:last] if first is not None and last is not None else []

    def _buffers(self, final: bool) -> List[Tensor]:
        if self.out is None and (final or self.acc_dtype == self.dtype):
            self.out = self._allocated(self.dtype)
            if self.acc_dtype == self.dtype:
                self.acc = self.out
        if final:
            return self.out
        if self.acc is None:
            self.acc = self._allocated(self.acc_dtype)
        return self.acc

    def _groups(self, r: Rows):
        """The spans of ``r`` as runs of neighbours in the same state and stage (``_stage``)."""
        spans = self._spans(r)
        if not spans or any(s.remaining == 0 for s in spans):
            raise ValueError(f"rows {r} were not announced (or already complete)")
        for s in spans:
            s.remaining -= 1
        group = []
        for s in spans:
            if group and not (_same_source(group[-1].state, s.state) and self._stage(group[-1]) == self._stage(s)):
                yield group
                group = []
            group.append(s)
        if group:
            yield group

    @staticmethod
    def _stage(s: _Span) -> int:
        """Spans in the same state combine alike if the part that reached them is their last
        for both or neither."""
        return min(s.remaining, 1)

    def _add(self, r: Rows, parts: Sequence[Tensor]) -> None:
        handed = self.handed_out.pop(r, None)
        arrived = _IN_PLACE if handed is not None and all(p is t for p, t in zip(parts, handed)) else (parts, r[0])
        for group in self._groups(r):
            b, e, state, final = group[0].begin, group[-1].end, group[0].state, group[0].remaining == 0
            if state is None:
                self._first((b, e), (b - r[0], e - r[0]), parts)
                new_state = arrived
            elif group[0].remaining and len(_sources(state)) + 1 < self.PASS_INPUTS:
                new_state = _Kept(_sources(state) + (arrived,))
            else:
                new = [optional_rows(p, (b - r[0], e - r[0])) for p in parts]
                dest = [rows(t, (b, e)) for t in self._buffers(final)]
                self.pending.append((dest, self._kept(state, b, e), new, (b, e)))
                new_state = _DONE if final else _ACC
            for s in group:
                s.state = new_state

    def _can_be_result(self, parts: Sequence[Tensor]) -> bool:
        """Whether ``parts`` can be the result as they are: its dtype and shapes, contiguous, in
        memory of their own (not ``_Reused``)."""
        return not isinstance(parts, _Reused) and all(
            p.dtype == self.dtype and p.shape == s and p.is_contiguous() for p, s in zip(parts, self.shapes))

    def _kept(self, state, b: int, e: int) -> List[List[Tensor]]:
        """The parts held for result rows ``b:e`` in ``state`` (one, or several ``_Kept``),
        each as views of its tensors over those rows."""
        if isinstance(state, _Kept):
            return [part for source in state.sources for part in self._kept(source, b, e)]
        if state in (_ACC, _IN_PLACE):
            return [self._held_rows(self.acc if state == _ACC else self.out, (b, e))]
        held, row0 = state
        return [[optional_rows(p, (b - row0, e - row0)) for p in held]]

    def _held_rows(self, tensors: List[Tensor], r: Rows) -> List[Tensor]:
        """Rows ``r`` of the accumulator or the result, as a part of them."""
        return [rows(t, r) for t in tensors]

    def _first(self, rows_: Rows, part_rows: Rows, parts: Sequence[Optional[Tensor]]) -> None:
        """The first part of result rows ``rows_`` arrived (kept as it is); ``part_rows``: the
        same rows within the part."""

    def _fill_empty(self, out: List[Tensor], r: Rows) -> None:
        for t in out:
            rows(t, r).zero_()

    def result(self) -> List[Tensor]:
        """The complete result, in the result dtype."""
        if any(s.remaining for s in self.spans):
            raise RuntimeError("a result was read before all its announced parts were added")
        whole = self.spans[0].state if len(self.spans) == 1 else None
        if (self.out is None and isinstance(whole, tuple) and whole[1] == 0
                and self._can_be_result(whole[0])):
            return list(whole[0])  # one part is the whole result, as it came
        out = self._buffers(True)
        for s in self.spans:
            if s.state is None:
                self._fill_empty(out, (s.begin, s.end))
            elif s.state not in (_DONE, _IN_PLACE):
                parts, row0 = s.state
                for t, p in zip(out, parts):
                    rows(t, (s.begin, s.end)).copy_(rows(p, (s.begin - row0, s.end - row0)))
        return out


def merge_parts(d: Tensor, parts: Sequence[Tuple[Tensor, Tensor, Optional[Tensor]]], lse: Tensor,
                res: Optional[Tensor] = None) -> None:
    """``d`` = the log-sum-exp merge of two to four ``parts``, each (output, lse, res or None)
    over the same rows (``d`` may be one of their outputs), with weights in fp32, rounded once
    into ``d``; ``lse`` (which may be a part's) becomes the merged lse and ``res`` (where
    given) its res (``kernels.base``: what the lse cannot hold; None: 0). One fused pass on a
    CUDA GPU, torch passes elsewhere."""
    if fused_merge.applies(d, parts, lse, res):
        if fused_merge.available():
            fused_merge.merge(d, parts, lse, res)
            return
        _warn_no_triton()
    merge_in_torch(d, parts, lse, res)


def merge_each(jobs: Sequence[tuple]) -> None:
    """``merge_parts`` of each (d, parts, lse, res) of ``jobs``, in order; on a CUDA GPU two
    after each other over two row ranges of the same tensors in one launch."""
    if len(jobs) == 1:
        merge_parts(*jobs[0])
        return
    for job, then in _together(jobs, fused_merge.merge_rows_apart):
        if then is None:
            merge_parts(*job)
        else:
            fused_merge.merge(*job, then=then)


def _warn_no_triton() -> None:
    _warn_once("ringflex: triton is not installed, so hop results merge and gradient parts sum in torch passes "
               "instead of one fused kernel each (slower); torch's CUDA builds ship it: pip install triton")


def lse_weights(parts: Sequence[Tuple[Tensor, Optional[Tensor]]]):
    """(the weight of each part, merged lse, merged res) of log-sum-exps given as (lse, res).
    The weights are taken relative to the largest lse, res added after that difference
    (exact where all are huge), and normalised by their sum: so they sum to 1 where the lse
    alone lost log(l). Rows where every lse is -inf get weights 0, lse -inf and res 0."""
    top = functools.reduce(torch.maximum, [lse for lse, _ in parts])
    top = torch.where(top.isneginf(), 0.0, top)
    weights = [torch.exp(lse - top + (0.0 if res is None else res)) for lse, res in parts]
    total = functools.reduce(torch.add, weights)
    inv = torch.where(total > 0, 1 / total, 0.0)
    return [w * inv for w in weights], *split_lse(top, torch.log(total))


def merge_in_torch(d: Tensor, parts: Sequence[Tuple[Tensor, Tensor, Optional[Tensor]]], lse: Tensor,
                   res: Optional[Tensor] = None) -> None:
    """``merge_parts`` in torch operations, in fp32 (or the parts' wider dtype), rounded once into d."""
    weights, merged, merged_res = lse_weights([(part_lse, part_res) for _, part_lse, part_res in parts])
    (first, *middle, last), weights = [x for x, _, _ in parts], [w.unsqueeze(-1) for w in weights]
    total = first * weights[0]
    for x, w in zip(middle, weights[1:-1]):
        total = torch.addcmul(total, x, w)
    torch.addcmul(total, last, weights[-1], out=d)
    lse.copy_(merged)
    if res is not None:
        res.copy_(merged_res)


def _same_source(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return a[0] is b[0] and a[1] == b[1]
    return a == b


class RowSum(_RowParts):
    """Sums of tensors (dq; or dk and dv) over row ranges, rounded once (see ``_RowParts``).

    Parts are handed over: the last part, where it covers every row and has the result's
    dtype and layout (a kernel's fresh gradients), becomes the result, and the parts before
    it are added into it in place, so rows it alone covers are not copied (``_adopt``).
    A part in memory that a later call fills again (``reused``: a receive buffer) is read
    before the result is, never handed out as it."""

    def add(self, r: Rows, *parts: Tensor, reused: bool = False) -> None:
        self._add_one(r, *parts, reused=reused)
        if self.pending:
            self._combined()

    def _add_one(self, r: Rows, *parts: Tensor, reused: bool = False) -> None:
        if reused:
            parts = _Reused(parts)
        if not self._adopt(r, parts):
            self._add(r, parts)

    def _adopt(self, r: Rows, parts: Sequence[Tensor]) -> bool:
        whole = (0, self.shapes[0][2])
        if (self.handed_out or r != whole or any(s.remaining != 1 or s.state == _IN_PLACE for s in self.spans)
                or not self._can_be_result(parts)):
            return False
        held = [(s, self._kept(s.state, s.begin, s.end)) for s in self.spans if s.state is not None]
        self.out = list(parts)
        for s, parts_before in held:  # parts kept as they came, or the fp32 sum of several
            dest = [rows(t, (s.begin, s.end)) for t in self.out]
            self.pending.append((dest, parts_before, dest, (s.begin, s.end)))
        for s in self.spans:
            s.remaining, s.state = 0, _DONE
        return True

    def _combine(self, pending: List[tuple]) -> None:
        sum_ranges([[(d, [part[i] for part in held] + [new[i]]) for i, d in enumerate(dest)]
                    for dest, held, new, _ in pending], self.acc_dtype)


def _together(jobs: Sequence, rows_apart: Callable) -> Iterator[tuple]:
    """Each of ``jobs`` in order, with ``(rows apart, the next job)`` where one launch of the
    fused kernels takes both (``rows_apart`` gives that number, or None), else with None."""
    i = 0
    while i < len(jobs):
        apart = rows_apart(jobs[i], jobs[i + 1]) if i + 1 < len(jobs) and fused_merge.available() else None
        yield jobs[i], None if apart is None else (apart, jobs[i + 1])
        i += 1 if apart is None else 2


def sum_ranges(ranges: Sequence[Sequence[Tuple[Tensor, Sequence[Tensor]]]], acc_dtype: torch.dtype) -> None:
    """``sum_each`` of each range's jobs (their (d, parts) over the same rows), in order; on a
    CUDA GPU two ranges after each other over rows of the same tensors in one launch."""
    if len(ranges) == 1:
        sum_each(ranges[0], acc_dtype)
        return
    for jobs, then in _together(ranges, _sums_rows_apart):
        if then is None:
            sum_each(jobs, acc_dtype)
        else:
            fused_merge.add(*jobs[0], beside=jobs[1] if len(jobs) == 2 else None, then=then)


def _sums_rows_apart(first, second) -> Optional[int]:
    """``fused_merge.sum_rows_apart``, where ``sum_each`` would take the fused kernel for each."""
    if any(_one_add(d, parts) for d, parts in (*first, *second)):
        return None
    return fused_merge.sum_rows_apart(first, second)


def sum_each(jobs: Sequence[Tuple[Tensor, Sequence[Tensor]]], acc_dtype: torch.dtype) -> None:
    """``sum_parts`` of each ``(d, parts)`` of ``jobs``. On a CUDA GPU two that the fused kernel
    takes (a block's dK and dV over the same rows) share one launch: the host's time per launch,
    not the GPU's, bounds short calls."""
    if (len(jobs) == 2 and not any(_one_add(d, parts) for d, parts in jobs) and fused_merge.pair_applies(*jobs)
            and fused_merge.available()):
        fused_merge.add(*jobs[0], beside=jobs[1])
        return
    for d, parts in jobs:
        sum_parts(d, parts, acc_dtype)


def _one_add(d: Tensor, parts: Sequence[Tensor]) -> bool:
    """Whether ``sum_parts`` adds ``parts`` by one torch add: two contiguous tensors that hold
    their sum's dtype into a contiguous ``d`` (as fast as the fused kernel, and fewer host us)."""
    return _adds_in(d, parts) and all(t.is_contiguous() for t in (d, *parts))


def _adds_in(d: Tensor, parts: Sequence[Tensor]) -> bool:
    """Whether two ``parts`` add in a dtype no narrower than ``d``'s (torch's add, rounded once)."""
    common = functools.reduce(torch.promote_types, [p.dtype for p in parts])
    return len(parts) == 2 and torch.promote_types(common, d.dtype) == common


def sum_parts(d: Tensor, parts: Sequence[Tensor], acc_dtype: torch.dtype) -> None:
    """``d`` = the sum of two to four ``parts``, computed in ``acc_dtype`` (or wider) and
    rounded once into ``d``, which may be one of them. One fused pass on a CUDA GPU; torch's
    add where two whole tensors meet, which is as fast (over row views it takes twice as long)."""
    if _one_add(d, parts):
        torch.add(*parts, out=d)
        return
    if fused_merge.sum_applies(d, parts):
        if fused_merge.available():
            fused_merge.add(d, parts)
            return
        _warn_no_triton()
    if _adds_in(d, parts):
        torch.add(*parts, out=d)  # fp32 for fp16/bf16 inputs, rounded once into d
        return
    common = functools.reduce(torch.promote_types, [p.dtype for p in parts])
    *first, last = parts  # widened first, or the sum is rounded to the parts' dtype
    total = first[0].to(torch.promote_types(torch.promote_types(common, d.dtype), acc_dtype))
    for part in first[1:]:
        total = total + part
    torch.add(total, last, out=d)


class RowMerge(_RowParts):
    """The running output of a ring call and its log-sum-exp: hop results over row ranges,
    merged by LSE with weights in fp32 and rounded once into the output dtype (see ``_RowParts``).
    Rows that see no key have output 0 and lse -inf, never NaN. Parts are handed over: a first
    part over every row becomes the result (``_adopt_first``). The LSE's res (``kernels.base``)
    is kept once a part brings one (``self.res``; None before: 0)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, acc_dtype: torch.dtype, device, expected: Sequence[Rows],
                 empty=torch.empty):
        super().__init__([shape], dtype, acc_dtype, device, expected, empty)
        self.lse = empty(shape[:3], dtype=acc_dtype, device=device)
        self.res: Optional[Tensor] = None

    def destination(self, r: Rows) -> Optional[Tuple[Tensor, Tensor]]:
        """(output rows, lse rows) of the result for a kernel to write into (see ``_RowParts``)."""
        views = super().destination(r)
        return None if views is None else (views[0], rows(self.lse, r))

    def _whole(self) -> List[Tensor]:
        return [self.out[0], self.lse]

    def _fresh(self) -> List[Tensor]:
        return super()._fresh() + [self.empty(self.lse.shape, dtype=self.lse.dtype, device=self.device)]

    def add(self, r: Rows, part_out: Tensor, part_lse: Tensor, part_res: Optional[Tensor] = None) -> None:
        self._add_one(r, part_out, part_lse, part_res)
        if self.pending:
            self._combined()

    def _add_one(self, r: Rows, part_out: Tensor, part_lse: Tensor, part_res: Optional[Tensor] = None) -> None:
        if self._adopt_first(r, part_out, part_lse, part_res):
            return
        if part_res is not None and self.res is None:
            self.res = self.empty(self.lse.shape, dtype=self.lse.dtype, device=self.device).zero_()
        self._add(r, (part_out, part_lse, part_res))

    def _adopt_first(self, r: Rows, out: Tensor, lse: Tensor, res: Optional[Tensor]) -> bool:
        """A first part over every row, in the result's dtype and layout (the own block's hop as
        the kernel returned it), becomes the result: the rows only it covers are not copied,
        and later parts merge into it in place."""
        if (self.out is not None or self.handed_out or r != (0, self.shapes[0][2])
                or any(s.state is not None or s.remaining == 0 for s in self.spans)
                or not self._can_be_result([out])
                or any(t is not None and (t.dtype != self.lse.dtype or t.shape != self.lse.shape
                                          or not t.is_contiguous()) for t in (lse, res))):
            return False
        self.out, self.lse, self.res = [out], lse, res
        if self.acc_dtype == self.dtype:
            self.acc = self.out
        for s in self.spans:
            s.remaining -= 1
            s.state = _IN_PLACE if s.remaining else _DONE
        return True

    def _first(self, rows_: Rows, part_rows: Rows, parts: Sequence[Optional[Tensor]]) -> None:
        for mine, part in ((self.lse, parts[1]), (self.res, parts[2])):
            if mine is not None and part is not None:
                target, source = rows(mine, rows_), rows(part, part_rows)
                if source.data_ptr() != target.data_ptr():  # not written in place
                    target.copy_(source)

    def _held_rows(self, tensors: List[Tensor], r: Rows) -> List[Optional[Tensor]]:
        return [rows(tensors[0], r), rows(self.lse, r), optional_rows(self.res, r)]

    def _combine(self, pending: List[tuple]) -> None:
        merge_each([(dest[0], [tuple(part) for part in kept + [new]], rows(self.lse, r), optional_rows(self.res, r))
                    for dest, kept, new, r in pending])

    def _fill_empty(self, out: List[Tensor], r: Rows) -> None:
        super()._fill_empty(out, r)
        rows(self.lse, r).fill_(-math.inf)

    def result(self) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(out, lse, res): res None where no part had one."""
        return super().result()[0], self.lse, self.res
