"""Planning a block: the cuDNN calls (``batches.Run``) that compute one hop's query rows against its
keys. Native band masks where the mask is a band of ``q_idx - kv_idx``, the exact mask's
row groups where it is the same for every batch and head (packed documents), else row
chunks that skip empty key tiles (``split_runs``)."""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...cache import ByObjects, remember
from ...mod.band import diagonal_band
from ...mod.graph import ModGraph
from ...plan.blocks import BlockKind, block_kinds
from ...plan.extents import mask_key, row_extents
from ...plan.layout import Segment
from ..base import Mods
from .batches import Group, Run, batched
from .frontend import CUDNN_TILE, MAX_PLANS
from .lowering import Program

_PLANS = ByObjects(MAX_PLANS)  # a block's runs, by its mask's traced values and segments


def plan(program: Program, mods: Mods, q: Tensor, k: Tensor, q_seg: Optional[Segment], kv_seg: Optional[Segment],
         split_depth: int) -> Sequence[Run]:
    """The calls that compute a block of ``q``'s rows against ``k``'s keys: one without mask;
    native bands for a band mask; the exact plan for other masks; with a score_mod, the
    exact plan's or ``split_runs``'s, whichever computes less (docs/cudnn.md)."""
    full = Run((0, q.shape[2]), (0, k.shape[2]))
    if program.mask is None:
        return [full]
    if q_seg is None or kv_seg is None:
        raise ValueError("a masked block needs its q_seg and kv_seg")
    band = native_band(program.mask)
    if band is not None and program.score is None:
        runs = band_runs(band, q_seg, kv_seg)
        if runs is not None:
            return runs
    exact = exact_runs(mods, program.mask, q_seg, kv_seg, q.device)
    if exact is not None and program.score is None:  # unmasked and native-band calls: no per-element mask
        return exact
    split = [Run(full.rows, full.cols, masked=True)]
    if split_depth > 0:
        split = split_runs(mods, program.mask, q.shape[0], q.shape[1], q_seg, kv_seg, split_depth, q.device)
    if exact is not None and area(exact) < area(split):
        # With a score_mod every call pays per element alike, and cuDNN takes no native
        # mask beside a score_mod: the plan that computes less wins, its bands as selects.
        return [Run(r.rows, r.cols, masked=r.masked or r.band is not None) for r in exact]
    return split


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_MIN_FULL = 4 * CUDNN_TILE  # narrowest column range worth its own call


@functools.lru_cache(maxsize=MAX_PLANS)  # a pure function of its arguments, asked at every call of a band's hop
def band_runs(band: Tuple[Optional[int], Optional[int]], q_seg: Segment, kv_seg: Segment) -> Optional[Tuple[Run, ...]]:
    """The block as calls with cuDNN's native band mask (at most two), or None where it cannot be.

    The mask keeps ``lo <= q_pos - kv_pos <= hi`` with ``pos = start + stride * i``, that is
    local columns ``j`` in ``[i + a, i + b]``. cuDNN's band must contain the diagonal
    (``a <= 0 <= b``), so rows before the band starts or columns after it ends, which see
    nothing, are cut off first.
    """
    if q_seg.stride != kv_seg.stride:
        return None
    lo, hi = band
    t, d = q_seg.stride, q_seg.start - kv_seg.start
    a = None if hi is None else -((hi - d) // t)  # i - j <= floor((hi - d) / t)
    b = None if lo is None else -_ceil_div(lo - d, t)  # i - j >= ceil((lo - d) / t)
    n_q, n_k = q_seg.length, kv_seg.length
    if a is not None and b is not None and a > b:
        return ()
    r0 = max(0, -b) if b is not None else 0
    c0 = max(0, a) if a is not None else 0
    r1 = min(n_q, n_k - a) if a is not None else n_q
    c1 = min(n_k, n_q + b) if b is not None else n_k
    if r0 >= r1 or c0 >= c1:
        return ()
    a = None if a is None or a + r0 - c0 <= -(r1 - r0 - 1) else a + r0 - c0
    b = None if b is None or b + r0 - c0 >= c1 - c0 - 1 else b + r0 - c0
    if a is None and b is None:
        return (Run((r0, r1), (c0, c1)),)
    if a is not None and r1 - r0 > c1 - c0:  # cuDNN's sliding window needs s_q <= s_kv
        return None
    if b is not None and _MIN_FULL <= b + 1 < c1 - c0:
        # A right bound off the diagonal (a window's queries against their own and the
        # previous block of keys; a document that began in an earlier block): cuDNN's
        # backward is slower per pair with a right bound off the diagonal than on it, where
        # its tiles align with the diagonal. Keys up to c0 + b meet only the left bound, if
        # any; on the rest the right bound is the diagonal.
        split = c0 + b + 1
        left = band_runs(band, q_seg, kv_seg.slice(0, split))
        right = band_runs(band, q_seg, kv_seg.slice(split, n_k))
        if left is not None and right is not None:
            return left + tuple(Run(r.rows, (split + r.cols[0], split + r.cols[1]), band=r.band) for r in right)
    return (Run((r0, r1), (c0, c1), band=(None if a is None else 1 - a, b)),)


def split_runs(mods: Mods, mask: ModGraph, batch: int, heads: int, q_seg: Segment, kv_seg: Segment,
               depth: int, device) -> List[Run]:
    """The block cut into 2**depth row chunks, each one call over the key tiles (of the same
    size) from its first to its last non-empty one: empty tiles around it are skipped, and
    no partial results need merging. Masked unless every tile in the span is full."""
    n = 1 << depth
    block_q = CUDNN_TILE * _ceil_div(_ceil_div(q_seg.length, n), CUDNN_TILE)
    block_kv = CUDNN_TILE * _ceil_div(_ceil_div(kv_seg.length, n), CUDNN_TILE)
    batch, heads = (batch if "b" in mask.deps else 1), (heads if "h" in mask.deps else 1)
    key = mask_key(mask, "split", batch, heads, q_seg, kv_seg, block_q, block_kv, str(device))

    def runs():
        found = []
        for i, row in enumerate(block_kinds(mods.mask_mod, batch, heads, q_seg, kv_seg, block_q, block_kv,
                                            device).tolist()):
            tiles = [j for j, kind in enumerate(row) if kind != BlockKind.EMPTY]
            if tiles:
                span = row[tiles[0]:tiles[-1] + 1]
                found.append(Run((i * block_q, min(q_seg.length, (i + 1) * block_q)),
                                 (tiles[0] * block_kv, min(kv_seg.length, (tiles[-1] + 1) * block_kv)),
                                 masked=any(kind != BlockKind.FULL for kind in span)))
        return found

    return _PLANS.get(key, mask.tensors(), runs)


# Row groups and calls of an exact plan. Groups whose runs join one ragged batch (packed
# documents) cost planning time alone, and too few groups leave a block of many documents to
# quadrants, which compute their empty parts; calls that stay single (a fragmented mask) cost
# host time at every call.
_MAX_GROUPS = 64
_MAX_SINGLE_CALLS = 16


def exact_runs(mods: Mods, mask: ModGraph, q_seg: Segment, kv_seg: Segment, device) -> Optional[List[Run]]:
    """The block from its exact mask, for masks that are the same for every batch and head:
    query rows grouped by their first visible key (a packed document, say); in each group the
    keys every row sees run unmasked, and the rest with cuDNN's native band mask where the mask
    is a band there (causal inside a document), else masked. None where that is too fragmented
    (or too large to evaluate: ``extents.row_extents``)."""
    def runs():
        extents = row_extents(mods.mask_mod, mask, q_seg, kv_seg, device)
        return None if extents is None else _grouped_runs(extents)

    return _PLANS.get(mask_key(mask, "exact", q_seg, kv_seg, str(device)), mask.tensors(), runs)


def _grouped_runs(extents: Tensor) -> Optional[List[Run]]:
    """The runs of a block from its ``extents.row_extents``: one group of rows per first
    visible key; None beyond ``_MAX_GROUPS`` of them, or ``_MAX_SINGLE_CALLS`` calls outside a
    ragged batch (``batches.batched``)."""
    first = extents[0]
    starts = torch.nonzero(torch.diff(first, prepend=first.new_full((1,), -2))).flatten().tolist()
    if len(starts) > 2 * _MAX_GROUPS:
        return None
    groups = [(r0, r1) for r0, r1 in zip(starts, starts[1:] + [len(first)]) if first[r0] >= 0]
    if len(groups) > _MAX_GROUPS:
        return None
    runs = [run for r0, r1 in groups for run in _group_runs(extents[:, r0:r1], r0)]
    singles = sum(not isinstance(call, Group) for call in batched(tuple(runs), True))
    return runs if singles <= _MAX_SINGLE_CALLS else None


def _group_runs(extents: Tensor, r0: int) -> List[Run]:
    """Runs for the rows from r0 on that ``extents`` (``extents.row_extents``) describe, which all
    see their first key at the same c0: native band calls where the rows' keys form a band (a
    document that began in an earlier block: every key from c0 to the diagonal, see
    ``band_runs``), else the leading keys all of them see unmasked, then the rest as a native
    band where it is one, else masked."""
    first, last, run_end, count = extents
    c0, c1, r1 = int(first[0]), int(last.max()) + 1, r0 + extents.shape[1]
    ends = last - c0  # the last key each row sees, from c0; it sees all before it if contiguous
    contiguous = bool((count == last - first + 1).all())
    whole = _band_of(ends, c1 - c0) if contiguous else None
    if whole is not None:
        return [shifted(r, r0, c0) for r in whole]
    full = min(int(run_end.min()), c1) - c0  # the keys every row sees
    if full < max(_MIN_FULL, (c1 - c0) // 8):  # a narrow call and a merge cost more than they save
        full = 0
    runs = [Run((r0, r1), (c0, c0 + full))] if full else []
    if full == c1 - c0:
        return runs
    band = _band_of(ends - full, c1 - c0 - full) if contiguous else None
    if band is None:
        return runs + [Run((r0, r1), (c0 + full, c1), masked=True)]
    return runs + [shifted(r, r0, c0 + full) for r in band]


def _band_of(ends: Tensor, cols: int) -> Optional[List[Run]]:
    """Rows that each see keys 0 to ``ends[i]`` of ``cols`` (none where it is negative) as
    native band calls, or None where they form no band."""
    n = len(ends)
    i = torch.arange(n)
    seen = ends >= 0
    # The band that keeps keys [i + a, i + b] of row i, from the rows that see keys: each of
    # them then starts at key 0 and sees some, so the band is theirs where each row's last key
    # is i + b (or the last column) and the rows that see none are outside it.
    a, b = -int(torch.where(seen, i, -1).max()), int(torch.where(seen, ends - i, -n - cols).max())
    hi = (i + b).clamp(max=cols - 1)
    if not torch.equal(torch.where((i + a).clamp(min=0) <= hi, hi, -1), torch.where(seen, ends, -1)):
        return None
    return band_runs((-b, -a), Segment(0, 1, n), Segment(0, 1, cols))


def shifted(run: Run, r0: int, c0: int) -> Run:
    """``run`` moved ``r0`` rows and ``c0`` keys on."""
    return Run((r0 + run.rows[0], r0 + run.rows[1]), (c0 + run.cols[0], c0 + run.cols[1]), run.masked, run.band)


def area(runs: List[Run]) -> int:
    return sum((r.rows[1] - r.rows[0]) * (r.cols[1] - r.cols[0]) for r in runs)


_BANDS: "OrderedDict[int, tuple]" = OrderedDict()


def native_band(mask: ModGraph):
    """``trace.diagonal_band`` of ``mask``, found once per traced mask."""
    cached = _BANDS.get(id(mask))
    if cached is None or cached[0] is not mask:
        cached = remember(_BANDS, id(mask), (mask, diagonal_band(mask)), MAX_PLANS)
    return cached[1]
