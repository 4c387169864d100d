"""Which (Q segment, KV segment) blocks need work, decided from the mask alone.

Pure functions, no communication. A block is EMPTY (no query sees any key: skip the
compute, never the transfer), FULL (every query sees every key: run without a mask) or
PARTIAL (run masked; kernels may split it further with ``block_kinds``).
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

# Mask evaluations per chunk: bounds the planner's memory whatever the segment lengths.
_CHUNK_ELEMENTS = 1 << 24


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


class BlockKind(enum.IntEnum):
    EMPTY = 0
    PARTIAL = 1
    FULL = 2


def index_grid(batch: int, heads: int, q_pos: Tensor, kv_pos: Tensor):
    """(b, h, q_idx, kv_idx) as broadcastable int32 tensors, the way flex_attention passes them."""
    device = q_pos.device
    b = torch.arange(batch, device=device, dtype=torch.int32).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device, dtype=torch.int32).view(1, -1, 1, 1)
    return b, h, q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1)


def evaluate_mask(mask_mod: Callable, batch: int, heads: int, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
    """The boolean mask, broadcastable to [batch, heads, len(q_pos), len(kv_pos)].

    Dimensions the mask does not depend on stay of size 1, which keeps planning cheap.
    """
    b, h, qi, ki = index_grid(batch, heads, q_pos, kv_pos)
    allowed = torch.as_tensor(mask_mod(b, h, qi, ki), device=q_pos.device)
    if allowed.dtype != torch.bool:
        allowed = allowed != 0
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    return allowed.expand(-1, -1, len(q_pos), len(kv_pos)) if allowed.shape[-2:] != (len(q_pos), len(kv_pos)) else allowed


def block_kinds(
    mask_mod: Optional[Callable], batch: int, heads: int, q_seg: Segment, kv_seg: Segment,
    block_q: int, block_kv: int, device=None,
) -> Tensor:
    """BlockKind of every (block_q x block_kv) tile of the (q_seg, kv_seg) block, as int8
    [ceil(Lq / block_q), ceil(Lk / block_kv)], over all batches and heads."""
    nq = -(-q_seg.length // block_q)
    nk = -(-kv_seg.length // block_kv)
    if mask_mod is None:
        return torch.full((nq, nk), int(BlockKind.FULL), dtype=torch.int8, device=device)
    kv_pos = kv_seg.positions(device)
    rows = max(1, _CHUNK_ELEMENTS // max(1, kv_seg.length * batch * heads))
    pad_k = nk * block_kv - kv_seg.length
    row_any, row_all = [], []  # per query row and KV tile, over all batches and heads
    for begin in range(0, q_seg.length, rows):
        sub = q_seg.slice(begin, min(q_seg.length, begin + rows))
        m = evaluate_mask(mask_mod, batch, heads, sub.positions(device), kv_pos).flatten(0, 1)
        # Padding takes the value that changes neither "any" nor "all" of a tile.
        row_any.append(torch.nn.functional.pad(m, (0, pad_k), value=False).view(m.shape[0], sub.length, nk, block_kv).any(3).any(0))
        row_all.append(torch.nn.functional.pad(m, (0, pad_k), value=True).view(m.shape[0], sub.length, nk, block_kv).all(3).all(0))
    pad_q = nq * block_q - q_seg.length
    any_ = torch.nn.functional.pad(torch.cat(row_any), (0, 0, 0, pad_q), value=False).view(nq, block_q, nk).any(1)
    all_ = torch.nn.functional.pad(torch.cat(row_all), (0, 0, 0, pad_q), value=True).view(nq, block_q, nk).all(1)
    kinds = torch.full_like(any_, int(BlockKind.PARTIAL), dtype=torch.int8)
    kinds[~any_] = int(BlockKind.EMPTY)
    kinds[all_] = int(BlockKind.FULL)
    return kinds


def classify(mask_mod: Optional[Callable], batch: int, heads: int, q_seg: Segment, kv_seg: Segment, device=None) -> Tensor:
    """BlockKind of the whole block, as a 0-dim int8 tensor (on ``device``; read it once per ring)."""
    if q_seg.length == 0 or kv_seg.length == 0:
        return torch.tensor(int(BlockKind.EMPTY), dtype=torch.int8, device=device)
    return block_kinds(mask_mod, batch, heads, q_seg, kv_seg, q_seg.length, kv_seg.length, device)[0, 0]


@dataclass(frozen=True)
class Hop:
    """One kernel call of a ring step: local Q rows ``q_rows`` against local KV rows ``kv_rows``.

    A segment is None where positions do not matter (a FULL block without score_mod), which
    lets neighbouring FULL blocks run as one larger call.
    """

    q_rows: tuple
    kv_rows: tuple
    q_seg: Optional[Segment]
    kv_seg: Optional[Segment]
    kind: BlockKind


def _local_ranges(segs):
    begin = 0
    for seg in segs:
        yield begin, begin + seg.length
        begin += seg.length


def _merge_full(hops):
    """Joins FULL hops that share one side and touch on the other into a single call."""
    hops = list(hops)
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(hops):
            for j, b in enumerate(hops):
                if i == j or a.kind != BlockKind.FULL or b.kind != BlockKind.FULL:
                    continue
                if a.q_rows == b.q_rows and a.kv_rows[1] == b.kv_rows[0]:
                    joined = Hop(a.q_rows, (a.kv_rows[0], b.kv_rows[1]), None, None, BlockKind.FULL)
                elif a.kv_rows == b.kv_rows and a.q_rows[1] == b.q_rows[0]:
                    joined = Hop((a.q_rows[0], b.q_rows[1]), a.kv_rows, None, None, BlockKind.FULL)
                else:
                    continue
                hops = [h for k, h in enumerate(hops) if k not in (i, j)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(hops, key=lambda h: (h.q_rows, h.kv_rows))


def plan_hops(mask_mod, has_score_mod: bool, batch: int, heads: int, q_segs, kv_segs_per_step, device=None):
    """The hops of every ring step: the non-EMPTY (Q segment, KV segment) pairs.

    ``kv_segs_per_step[i]`` are the segments of the KV block held at step i. All blocks are
    classified on ``device`` and read back to the host at once (one synchronisation).
    """
    pairs = [(step, qr, q, kr, kv)
             for step, kv_segs in enumerate(kv_segs_per_step)
             for qr, q in zip(_local_ranges(q_segs), q_segs)
             for kr, kv in zip(_local_ranges(kv_segs), kv_segs)]
    kinds = torch.stack([classify(mask_mod, batch, heads, q, kv, device) for _, _, q, _, kv in pairs]).tolist()
    steps = [[] for _ in kv_segs_per_step]
    for (step, qr, q, kr, kv), kind in zip(pairs, kinds):
        if kind != BlockKind.EMPTY:
            steps[step].append(Hop(qr, kr, q, kv, BlockKind(kind)))
    return [hops if has_score_mod else _merge_full(hops) for hops in steps]


def _captured_tensors(fn, depth=0):
    """Tensors a mod reads from its closure (and from the closures of mods it calls)."""
    if depth > 8:
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, torch.Tensor):
            yield value
        elif callable(value):
            yield from _captured_tensors(value, depth + 1)
        elif isinstance(value, (tuple, list)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
                elif callable(item):
                    yield from _captured_tensors(item, depth + 1)


class PlanCache:
    """Plans by mask and segments, so a training loop classifies its blocks once.

    An entry is only reused while the mod object and every tensor it captured are the very
    same objects, unmodified (same version counter), so new document ids always replan.
    """

    def __init__(self, size: int = 64):
        from .validate import fingerprint  # content hash of code and captured values
        self._fingerprint = fingerprint
        self.size = size
        self.entries = {}

    def get(self, mask_mod, has_score_mod, batch, heads, q_segs, kv_segs_per_step, device=None):
        tensors = list(_captured_tensors(mask_mod)) if mask_mod is not None else []
        try:
            ref = weakref.ref(mask_mod) if mask_mod is not None else (lambda: None)
        except TypeError:  # cannot tell whether the object lives on: do not cache
            return plan_hops(mask_mod, has_score_mod, batch, heads, q_segs, kv_segs_per_step, device)
        key = (id(mask_mod), self._fingerprint(mask_mod), tuple((id(t), t._version) for t in tensors), has_score_mod, batch, heads,
               tuple(q_segs), tuple(map(tuple, kv_segs_per_step)), str(device))
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is mask_mod and all(r() is t for r, t in zip(entry[1], tensors)):
            return entry[2]
        plan = plan_hops(mask_mod, has_score_mod, batch, heads, q_segs, kv_segs_per_step, device)
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = (ref, [weakref.ref(t) for t in tensors], plan)
        return plan
