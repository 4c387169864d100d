"""How a global sequence is split over the ranks of a ring.

Every layout is a list of ``Segment`` s per rank (affine runs of global positions), from
which its permutation, inverse and per-rank positions follow:

- contiguous: rank r holds one run ``[r*L, (r+1)*L)``.
- zigzag: the sequence is cut in 2*W chunks; rank r holds chunk r and chunk 2*W-1-r, so
  causal work is balanced across ranks. The last rank's two chunks are neighbours and one
  segment, so its own block is one hop, not three: each hop costs host time (a kernel call
  and a merge), whatever its size.
- striped: rank r holds positions r, r+W, r+2W, ... (one segment of stride W).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Segment:
    """Global positions ``start + stride * i`` for ``i < length`` of one run of local tokens."""

    start: int
    stride: int
    length: int

    def positions(self, device=None) -> Tensor:
        return self.start + self.stride * torch.arange(self.length, device=device, dtype=torch.int32)

    def slice(self, begin: int, end: int) -> "Segment":
        """The sub-segment of local tokens ``begin:end``."""
        return Segment(self.start + self.stride * begin, self.stride, end - begin)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def divisor(layout: str, world_size: int) -> int:
    """A global length must be a multiple of this for ``layout`` over ``world_size`` ranks."""
    return 2 * world_size if check_layout(layout) == "zigzag" else world_size


def segments(layout: str, seq_len: int, world_size: int, rank: int) -> List[Segment]:
    """The segments of global positions that ``rank`` holds, in local order."""
    d = divisor(layout, world_size)
    if seq_len % d:
        raise ValueError(
            f"sequence length {seq_len} does not fit layout {layout!r} on {world_size} ranks: "
            f"it must be a multiple of {d}")
    local = seq_len // world_size
    if layout == "contiguous":
        return [Segment(rank * local, 1, local)]
    if layout == "striped":
        return [Segment(rank, world_size, local)]
    chunk = local // 2
    if rank == world_size - 1:  # chunks W-1 and W
        return [Segment(rank * chunk, 1, local)]
    return [Segment(rank * chunk, 1, chunk), Segment((2 * world_size - 1 - rank) * chunk, 1, chunk)]


def positions(layout: str, seq_len: int, world_size: int, rank: int, device=None) -> Tensor:
    """Global position of every local token of ``rank`` (int64)."""
    return torch.cat([s.positions(device) for s in segments(layout, seq_len, world_size, rank)]).long()


def permutation(layout: str, seq_len: int, world_size: int, device=None) -> Tensor:
    """Global positions in rank-major local order: ``full[perm]`` is the concatenation of shards."""
    return torch.cat([positions(layout, seq_len, world_size, r, device) for r in range(world_size)])


def inverse_permutation(layout: str, seq_len: int, world_size: int, device=None) -> Tensor:
    """``gathered[inv]`` restores global order from the rank-major concatenation of shards."""
    return torch.argsort(permutation(layout, seq_len, world_size, device))
