"""How a global sequence is split over the ranks of a ring.

Every layout is a list of ``Segment`` s per rank (affine runs of global positions), from
which its permutation, inverse and per-rank positions follow:

- contiguous: rank r holds one run ``[r*L, (r+1)*L)``.
- zigzag: the sequence is cut in 2*W chunks; rank r holds chunk r and chunk 2*W-1-r, so
  causal work is balanced across ranks. The last rank's two chunks are neighbours and one
  segment, so its own block is one hop, not three: each hop costs host time (a kernel call
  and a merge), whatever its size.
- striped: rank r holds positions r, r+W, r+2W, ... (one segment of stride W).

A ``Sharding`` is any such split as a value: its segments per rank, printable, comparable
and reusable (``plan.sharding.shard_by_mask`` chooses one from the mask). Every function here
takes a layout's name or a Sharding.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple, Union

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag", "striped")
DEFAULT = "zigzag"  # shard's and ring_flex_attention's: balances causal work


def or_default(layout):
    """``layout``, or ``DEFAULT`` where the caller chose none (None): the layout tokens are in."""
    return DEFAULT if layout is None else layout


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


Layout = Union[str, "Sharding"]
_SHOWN_SEGMENTS = 6  # segments a rank's line of a Sharding's repr shows before "... (n more)"


def check_layout(layout: Layout) -> Layout:
    """``layout`` if the ring can run it: a name of ``LAYOUTS``, or a Sharding of equal shards
    (the ring's buffers hold one shard each)."""
    if isinstance(layout, Sharding):
        if not layout.equal_sizes:
            raise ValueError(f"layout: the ring needs shards of equal sizes, got a Sharding of sizes "
                             f"{[layout.local_len(r) for r in range(layout.world_size)]}")
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or a ringflex.Sharding, got {layout!r}")
    return layout


def divisor(layout: Layout, world_size: int) -> int:
    """A global length must be a multiple of this for ``layout`` over ``world_size`` ranks (a
    Sharding is of one length)."""
    if isinstance(check_layout(layout), Sharding):
        return layout.seq_len
    return 2 * world_size if layout == "zigzag" else world_size


def segments(layout: Layout, seq_len: int, world_size: int, rank: int) -> List[Segment]:
    """The segments of global positions that ``rank`` holds, in local order."""
    if isinstance(check_layout(layout), Sharding):
        if (seq_len, world_size) != (layout.seq_len, layout.world_size):
            raise ValueError(f"layout: a Sharding of {layout.seq_len} positions over {layout.world_size} ranks cannot "
                             f"shard {seq_len} positions over {world_size} ranks")
        return list(layout.ranks[rank])
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


def code(layout: Layout) -> int:
    """``layout`` as one integer of the record the ranks compare (``text`` reads it back)."""
    return LAYOUTS.index(layout) if isinstance(layout, str) else len(LAYOUTS) + (layout.digest() >> 8)


def layout_error(layout) -> str:
    """Why ``layout`` is no layout the ring can run ('' if it is one)."""
    try:
        check_layout(layout)
    except ValueError as e:
        return str(e)
    return ""


def text(layout_code: int) -> str:
    return repr(LAYOUTS[layout_code]) if layout_code < len(LAYOUTS) else f"a Sharding (digest {layout_code:x})"


def positions(layout: Layout, seq_len: int, world_size: int, rank: int, device=None) -> Tensor:
    """Global position of every local token of ``rank`` (int64)."""
    return torch.cat([s.positions(device) for s in segments(layout, seq_len, world_size, rank)]).long()


def permutation(layout: Layout, seq_len: int, world_size: int, device=None) -> Tensor:
    """Global positions in rank-major local order: ``full[perm]`` is the concatenation of shards."""
    return torch.cat([positions(layout, seq_len, world_size, r, device) for r in range(world_size)])


def inverse_permutation(layout: Layout, seq_len: int, world_size: int, device=None) -> Tensor:
    """``gathered[inv]`` restores global order from the rank-major concatenation of shards."""
    return torch.argsort(permutation(layout, seq_len, world_size, device))


@dataclass(frozen=True)
class Sharding:
    """For each rank, the global positions it holds: ``ranks[r]`` is a tuple of Segments in
    local order. Every position of ``[0, seq_len)`` belongs to exactly one rank. ``name`` is a
    short description; it takes no part in equality, hashing or ``digest``."""

    seq_len: int
    ranks: Tuple[Tuple[Segment, ...], ...]
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(tuple(_plain(s) for s in segs) for segs in self.ranks))
        if not self.ranks:
            raise ValueError("a Sharding needs at least one rank")
        for rank, segs in enumerate(self.ranks):
            for s in segs:
                if s.length <= 0 or s.stride <= 0 or s.start < 0 or s.start + s.stride * (s.length - 1) >= self.seq_len:
                    raise ValueError(f"rank {rank}: segment {s} is empty, decreasing or outside [0, {self.seq_len})")
        if _runs_tile(self.seq_len, self.ranks):
            return
        counts = torch.bincount(self.permutation(), minlength=self.seq_len)
        if len(counts) != self.seq_len or bool((counts != 1).any()):
            missing, twice = (counts == 0).sum().item(), (counts > 1).sum().item()
            raise ValueError(f"the ranks' segments must hold every position of [0, {self.seq_len}) exactly once: "
                             f"{missing} missing, {twice} held more than once")

    # ------------------------------------------------------------------ construction

    @classmethod
    @functools.lru_cache(maxsize=64)  # frozen, so shared: ``shard_by_mask`` weighs them at every new batch
    def of_layout(cls, layout: str, seq_len: int, world_size: int) -> "Sharding":
        """One of the fixed layouts (``LAYOUTS``), exactly as the ring shards it."""
        return cls(seq_len, tuple(tuple(segments(layout, seq_len, world_size, r)) for r in range(world_size)), layout)

    @classmethod
    def from_ranges(cls, seq_len: int, ranges: Sequence[Sequence[Tuple[int, int]]], name: str = "custom") -> "Sharding":
        """From ``ranges[r]``: the ``(begin, end)`` runs of positions rank r holds, in local order."""
        return cls(seq_len, tuple(tuple(Segment(b, 1, e - b) for b, e in runs) for runs in ranges), name)

    # ------------------------------------------------------------------ what it holds

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def local_len(self, rank: int) -> int:
        return sum(s.length for s in self.ranks[rank])

    def max_local_len(self) -> int:
        return max(self.local_len(r) for r in range(self.world_size))

    @property
    def equal_sizes(self) -> bool:
        return len({self.local_len(r) for r in range(self.world_size)}) == 1

    def positions(self, rank: int, device=None) -> Tensor:
        """Global position of every local token of ``rank`` (int64), in local order."""
        segs = self.ranks[rank]
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([s.positions(device) for s in segs]).long()

    def permutation(self, device=None) -> Tensor:
        """Global positions in rank-major local order: ``full[perm]`` is the concatenation of shards."""
        return torch.cat([self.positions(r, device) for r in range(self.world_size)])

    def inverse(self, device=None) -> Tensor:
        """``gathered[inv]`` restores global order from the rank-major concatenation of shards."""
        return torch.argsort(self.permutation(device))

    def owners(self) -> Tensor:
        """[seq_len] int64: the rank holding each global position."""
        owner = torch.empty(self.seq_len, dtype=torch.long)
        for rank in range(self.world_size):
            owner[self.positions(rank)] = rank
        return owner

    def local_index(self) -> Tensor:
        """[seq_len] int64: where each global position lies in its rank's local order."""
        local = torch.empty(self.seq_len, dtype=torch.long)
        for rank in range(self.world_size):
            local[self.positions(rank)] = torch.arange(self.local_len(rank))
        return local

    def take(self, x: Tensor, rank: int, dim: int = 0) -> Tensor:
        """``rank``'s tokens of the whole sequence ``x`` along ``dim``, in local order."""
        return x.index_select(dim, self.positions(rank, x.device))

    def restore(self, gathered: Tensor, dim: int = 0) -> Tensor:
        """The whole sequence in global order from the concatenation of every rank's shard along ``dim``."""
        return gathered.index_select(dim, self.inverse(gathered.device))

    # ------------------------------------------------------------------ comparing and printing

    def digest(self) -> int:
        """A 63-bit integer, the same in every process for the same positions per rank
        (``name`` aside): what ranks compare to check they shard alike."""
        data = repr((self.seq_len, tuple(tuple((s.start, s.stride, s.length) for s in segs) for segs in self.ranks)))
        return int.from_bytes(hashlib.sha1(data.encode()).digest()[:8], "little") >> 1

    def __repr__(self) -> str:
        sizes = sorted({self.local_len(r) for r in range(self.world_size)})
        each = f"{sizes[0]} each" if len(sizes) == 1 else "sizes " + "/".join(
            str(self.local_len(r)) for r in range(self.world_size))
        lines = [f"Sharding {self.name!r}: {self.seq_len} positions over {self.world_size} ranks ({each})"]
        for rank, segs in enumerate(self.ranks):
            shown = " ".join(_segment_text(s) for s in segs[:_SHOWN_SEGMENTS])
            more = f" ... ({len(segs) - _SHOWN_SEGMENTS} more)" if len(segs) > _SHOWN_SEGMENTS else ""
            lines.append(f"  rank {rank}: {shown}{more}")
        return "\n".join(lines)

    __str__ = __repr__

    def _segment_labels(self) -> Tuple[Tensor, List[int]]:
        """[seq_len] int64: the index of the segment (counted over all ranks) holding each
        position, and the rank of each segment."""
        labels = torch.empty(self.seq_len, dtype=torch.long)
        rank_of = []
        for rank, segs in enumerate(self.ranks):
            for s in segs:
                labels[s.start:s.start + s.stride * (s.length - 1) + 1:s.stride] = len(rank_of)
                rank_of.append(rank)
        return labels, rank_of


def _plain(s: Segment) -> Segment:
    """``s`` as a Segment of Python ints (``digest`` and the repr read them), rebuilt only where
    it is not one already: ``shard_by_mask`` builds Shardings of many segments at every batch."""
    if type(s) is Segment and type(s.start) is type(s.stride) is type(s.length) is int:
        return s
    return Segment(int(s.start), int(s.stride), int(s.length))


def _runs_tile(seq_len: int, ranks) -> bool:
    """Whether the segments are runs (stride 1, or one position) that, sorted, follow one
    another from 0 to ``seq_len``: every position held once, checked without listing them
    (the candidates ``shard_by_mask`` weighs are made of such runs)."""
    segs = sorted((s.start, s.length) for segs in ranks for s in segs if s.stride == 1 or s.length == 1)
    if len(segs) != sum(len(r) for r in ranks):
        return False
    end = 0
    for start, length in segs:
        if start != end:
            return False
        end += length
    return end == seq_len


def _segment_text(s: Segment) -> str:
    if s.stride == 1:
        return f"[{s.start}, {s.start + s.length})"
    return f"[{s.start}, {s.start + s.stride * (s.length - 1)}] step {s.stride}"
