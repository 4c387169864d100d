"""Per query row of a block, which keys its mask shows it: what the cuDNN kernel's exact plan
(``kernels.cudnn.blocks.exact_runs``) is made from.

Evaluating a mask on every pair of a block takes a pass over rows x keys per op, at every
call whose documents are new. Most of a block lies in spans of keys that the mask's formula
settles from ranges (``mod.ranges.tile_ranges``): every key visible to a row, or none. Only
the spans it leaves open (a diagonal, a document's edge) are evaluated pair by pair.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..cache import ByObjects, tensor_versions
from ..mod.graph import ModGraph
from ..mod.ranges import tile_ranges
from .blocks import evaluate_mask
from .layout import Segment

SPAN = 128  # keys ranged at once: the mask's formula settles a row's span, or leaves it open
_OPEN_SHARE = 4  # beyond 1 / this of the spans left open, one dense pass over the block costs less
# Blocks of up to this many pairs are evaluated whole: one pass over a small block costs less
# than the small kernels of ranging and of each open span, which only a large block amortises.
_DENSE_AREA = 1 << 26
_MAX_DENSE = 1 << 28  # pairs evaluated at once: whole blocks, or open tiles
_MAX_TILES = 1 << 24  # (query, tile) pairs ranged at once (64k x 32k keys: 2**24)


def mask_key(mask: ModGraph, *rest) -> tuple:
    """A key for what is computed from a traced mask's values: its captured tensors count by
    identity and version (kept in a ``cache.ByObjects`` with ``mask.tensors()``, so new
    document ids are a new key even where they take the old ones' freed id)."""
    return (mask.fingerprint, tensor_versions(mask.tensors())) + rest


_EXTENTS = ByObjects(16)  # the blocks of a ring call or two: the cuDNN kernel's exact plans and lending read them


def row_extents(mask_mod: Callable, mask: ModGraph, q_seg: Segment, kv_seg: Segment, device) -> Optional[Tensor]:
    """Per query row, on the host: its first and last visible key (-1 where it sees none), the
    end of the run of keys it sees from its first one, and how many keys it sees ([4, rows],
    local key indices), or None for a block too large to evaluate whole whose tiles the mask's
    formula does not settle, or for a mask that depends on the batch or head (it has no one
    set of keys per row). Planning a new mask waits for the GPU, up to three times; a block
    planned again is looked up."""
    if mask.deps & {"b", "h"}:
        return None
    return _EXTENTS.get(mask_key(mask, q_seg, kv_seg, str(device)), mask.tensors(),
                        lambda: _row_extents(mask_mod, mask, q_seg, kv_seg, device))


def _row_extents(mask_mod: Callable, mask: ModGraph, q_seg: Segment, kv_seg: Segment, device) -> Optional[Tensor]:
    q, area = q_seg.positions(device), q_seg.length * kv_seg.length
    tiled = _tiled(mask_mod, mask, q, kv_seg) if area > _DENSE_AREA else None
    if tiled is not None or area > _MAX_DENSE:
        return tiled
    return dense_row_extents(evaluate_mask(mask_mod, 1, 1, q, kv_seg.positions(device))[0, 0])


def _tiled(mask_mod: Callable, mask: ModGraph, q: Tensor, kv_seg: Segment) -> Optional[Tensor]:
    """``row_extents`` from tiles of keys, None where too few of them are settled (or too many
    to range at once)."""
    cols = kv_seg.length
    if len(q) * -(-cols // SPAN) > _MAX_TILES:
        return None
    starts = torch.arange(0, cols, SPAN, device=q.device)
    ends = (starts + SPAN).clamp(max=cols)
    settled = tile_ranges(mask, q, _positions(kv_seg, starts), _positions(kv_seg, ends - 1))
    if settled is None:
        return None
    full, some = settled
    rows, tiles = (some & ~full).nonzero(as_tuple=True)
    if len(rows) * _OPEN_SHARE > full.numel() or len(rows) * SPAN > _MAX_DENSE:
        return None
    # the open tiles, pair by pair: key columns past the block's end are neither seen nor hidden
    open_cols = starts[tiles].view(-1, 1) + torch.arange(SPAN, device=q.device)
    inside = open_cols < cols
    seen = _pairs(mask_mod, q[rows].view(-1, 1), _positions(kv_seg, open_cols.clamp(max=cols - 1))) & inside

    def per_row(settled_tiles: Tensor, open_tiles: Tensor, reduce: str) -> Tensor:
        """Per row, ``settled_tiles`` (one value per row) reduced with ``open_tiles`` (one per open tile)."""
        return settled_tiles.scatter_reduce(0, rows, open_tiles, reduce)

    any_seen, tile_start = seen.any(1), open_cols[:, 0]
    count = per_row(torch.where(full, ends - starts, 0).sum(1), seen.sum(1), "sum")
    first = per_row(torch.where(full, starts, cols).amin(1), torch.where(any_seen, tile_start + _first(seen), cols), "amin")
    first = torch.where(count > 0, first, -1)
    last = per_row(torch.where(full, ends - 1, -1).amax(1),
                   torch.where(any_seen, tile_start + SPAN - 1 - _first(seen.flip(1)), -1), "amax")
    # the first key from ``first`` on that the row does not see: in a tile it sees none of, or an open one
    hidden = ~seen & inside & (open_cols >= first[rows].view(-1, 1))
    run_end = per_row(torch.where(~some & (starts >= first.view(-1, 1)), starts, cols).amin(1),
                      torch.where(hidden.any(1), tile_start + _first(hidden), cols), "amin")
    return torch.stack([first, last, run_end, count]).cpu()


def dense_row_extents(allowed: Tensor) -> Tensor:
    """``row_extents`` from a block's whole [rows, keys] mask. A row whose keys are one run
    (causal, windows, documents: its count spans first to last) ends it after its last key;
    only the other rows are searched for the first key after their first that they do not see."""
    allowed, cols = allowed.contiguous(), allowed.shape[1]
    count = allowed.sum(1)
    visible = count > 0
    first = torch.where(visible, _first(allowed), -1)
    last = torch.where(visible, cols - 1 - _first(allowed.flip(1)), -1)
    extents = torch.stack([first, last, torch.where(visible, last + 1, 0), count]).cpu()
    broken = ((extents[3] > 0) & (extents[3] < extents[1] - extents[0] + 1)).nonzero().squeeze(1)
    if len(broken):  # each has a key it does not see between its first and last
        rows = broken.to(allowed.device)
        hidden = ~allowed[rows] & (torch.arange(cols, device=allowed.device) >= first[rows].unsqueeze(1))
        extents[2, broken] = _first(hidden).cpu()
    return extents


def _positions(seg: Segment, local: Tensor) -> Tensor:
    return (seg.start + seg.stride * local).int()


def _first(bits: Tensor) -> Tensor:
    """Index of the first True in each row of contiguous ``bits`` (0 where none); argmax takes
    no bools, so it reads their bytes (a view, not a copy)."""
    return bits.view(torch.uint8).argmax(1)


def _pairs(mask_mod: Callable, q: Tensor, kv: Tensor) -> Tensor:
    """The mask at the pairs of broadcastable ``q`` and ``kv`` positions (batch and head 0)."""
    zero = torch.zeros((), dtype=torch.int32, device=q.device)
    allowed = torch.as_tensor(mask_mod(zero, zero, q, kv), device=q.device)
    return (allowed if allowed.dtype == torch.bool else allowed != 0).expand(torch.broadcast_shapes(q.shape, kv.shape))
