"""Which (Q segment, KV segment) blocks need work, decided from the mask alone.

Pure functions, no communication. A block is EMPTY (no query sees any key: skip the
compute, never the transfer), FULL (every query sees every key: run without a mask) or
PARTIAL (run masked; kernels may split it further with ``block_kinds``).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ..cache import ByObjects, tensor_versions
from ..mod import captured
from ..mod.band import diagonal_band
from ..mod.fingerprint import fingerprint
from ..mod.graph import UnsupportedModError
from ..mod.lookups import lookup_error, subscripts_read_tensors
from ..mod.ranges import block_decider, ranged_lookup_error
from ..mod.trace import result_shape_error, trace_mask_mod, trace_score_mod
from .layout import Segment

# Mask evaluations per chunk: bounds the planner's memory whatever the segment lengths.
_CHUNK_ELEMENTS = 1 << 24


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


def _sample_is_mixed(mask_mod, batch, heads, q_seg: Segment, kv_seg: Segment, device, points: int = 64) -> bool:
    """True if a coarse grid of the block (corners included) already shows both a visible
    and a hidden pair: then the block is PARTIAL, and a large one needs no dense pass."""
    if q_seg.length * kv_seg.length <= points * points:
        return False
    pick = lambda seg: seg.positions(device)[torch.linspace(0, seg.length - 1, min(points, seg.length), device=device).long()]
    m = evaluate_mask(mask_mod, batch, heads, pick(q_seg), pick(kv_seg))
    some, every = torch.stack([m.any(), m.all()]).tolist()
    return some and not every


def classify(mask_mod: Optional[Callable], batch: int, heads: int, q_seg: Segment, kv_seg: Segment, device=None,
             decide: Optional[Callable] = None):
    """BlockKind of the whole block: a BlockKind where it is known on the host, else a 0-dim
    int8 tensor on ``device`` (``_read_kinds`` reads many at once).

    ``decide`` (from ``bounds.block_decider``) settles most blocks from the mask's formula;
    the rest are evaluated densely.
    """
    known = None if decide is None else decide(q_seg, kv_seg)
    if q_seg.length == 0 or kv_seg.length == 0 or known is False:
        return BlockKind.EMPTY
    if known is True:
        return BlockKind.FULL
    if mask_mod is not None and _sample_is_mixed(mask_mod, batch, heads, q_seg, kv_seg, device):
        return BlockKind.PARTIAL
    return block_kinds(mask_mod, batch, heads, q_seg, kv_seg, q_seg.length, kv_seg.length, device)[0, 0]


def _read_kinds(kinds) -> List[BlockKind]:
    """``classify`` results as BlockKinds, the device ones read in one synchronisation."""
    dense = [k for k in kinds if isinstance(k, Tensor)]
    values = iter(torch.stack(dense).tolist() if dense else [])
    return [BlockKind(next(values)) if isinstance(k, Tensor) else k for k in kinds]


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


def _joined(a: Optional[Segment], b: Optional[Segment]) -> Optional[Segment]:
    """The one segment that ``a`` followed by ``b`` form, or None if they do not form one."""
    if a is None or b is None or a.stride != b.stride or a.start + a.stride * a.length != b.start:
        return None
    return Segment(a.start, a.stride, a.length + b.length)


def _merge(hops, positions_matter: bool, planned_part=None):
    """Joins hops of one kind that touch into single calls, first along the keys of each
    query range, then along the queries of each key range. Where positions cannot matter
    (FULL, no score_mod) any neighbours join; otherwise only runs that stay affine, and
    never two blocks the kernel plans within into one it cannot (too large to plan)."""
    def join(hops, side):
        other = "kv" if side == "q" else "q"
        out = []
        for hop in sorted(hops, key=lambda h: (getattr(h, f"{other}_rows"), getattr(h, f"{side}_rows"))):
            prev = out[-1] if out else None
            if (prev is None or prev.kind != hop.kind or getattr(prev, f"{other}_rows") != getattr(hop, f"{other}_rows")
                    or getattr(prev, f"{side}_rows")[1] != getattr(hop, f"{side}_rows")[0]):
                out.append(hop)
                continue
            free = hop.kind == BlockKind.FULL and not positions_matter
            seg = None if free else _joined(getattr(prev, f"{side}_seg"), getattr(hop, f"{side}_seg"))
            if seg is None and not free:
                out.append(hop)
                continue
            rows = (getattr(prev, f"{side}_rows")[0], getattr(hop, f"{side}_rows")[1])
            fields = {f"{side}_rows": rows, f"{side}_seg": seg, f"{other}_rows": getattr(hop, f"{other}_rows"),
                      f"{other}_seg": None if free else getattr(hop, f"{other}_seg"), "kind": hop.kind}
            joined = Hop(**fields)
            if (hop.kind == BlockKind.PARTIAL and planned_part is not None and planned_part(prev.q_seg, prev.kv_seg)
                    and planned_part(hop.q_seg, hop.kv_seg) and planned_part(joined.q_seg, joined.kv_seg) is None):
                out.append(hop)
                continue
            out[-1] = joined
        return out
    return sorted(join(join(hops, "kv"), "q"), key=lambda h: (h.q_rows, h.kv_rows))


def _split(hop: Hop, kind_of, min_tile: int, planned_part):
    """Splits a PARTIAL hop into quadrants, recursively, where that sheds EMPTY parts:
    sparse blocks (windows, documents) lose their empty tiles, while a block shaped like a
    causal diagonal (one EMPTY and one FULL quadrant), which kernels run well whole, stays
    whole. A block the kernel computes exactly by itself (``planned_part`` gives the part its
    calls reach) becomes one hop over that part."""
    if hop.kind != BlockKind.PARTIAL:
        return [hop]
    extent = planned_part(hop.q_seg, hop.kv_seg) if planned_part is not None else None
    if extent is not None:
        return [within(hop, extent)]
    (q0, q1), (k0, k1) = hop.q_rows, hop.kv_rows
    if q1 - q0 < 2 * min_tile or k1 - k0 < 2 * min_tile:
        return [hop]
    qm, km = (q0 + q1) // 2, (k0 + k1) // 2
    quads = []
    for qa, qb in ((q0, qm), (qm, q1)):
        for ka, kb in ((k0, km), (km, k1)):
            q_seg, kv_seg = hop.q_seg.slice(qa - q0, qb - q0), hop.kv_seg.slice(ka - k0, kb - k0)
            quads.append(Hop((qa, qb), (ka, kb), q_seg, kv_seg, kind_of(q_seg, kv_seg)))
    empty = sum(h.kind == BlockKind.EMPTY for h in quads)
    full = sum(h.kind == BlockKind.FULL for h in quads)
    if empty == 0 or (empty == 1 and full > 0):  # dense, or shaped like a causal diagonal
        return [hop]
    return [piece for h in quads if h.kind != BlockKind.EMPTY for piece in _split(h, kind_of, min_tile, planned_part)]


def within(hop: Hop, extent) -> Hop:
    """The part ``extent`` (local rows and keys) of a hop: the ring then merges and sums only
    the rows and keys the kernel's calls reach (a window's queries at the start of a block
    against the keys at the end of the previous one: one corner of the block)."""
    (r0, r1), (c0, c1) = extent
    (q0, _), (k0, _) = hop.q_rows, hop.kv_rows
    return Hop((q0 + r0, q0 + r1), (k0 + c0, k0 + c1), hop.q_seg.slice(r0, r1), hop.kv_seg.slice(c0, c1), hop.kind)


# Masks that only compare q_idx with kv_idx: causal, and its strict and reversed forms.
_ORDER_BANDS = {(0, None), (1, None), (None, 0), (None, -1)}


def _in_order(segs) -> bool:
    """Whether positions increase along the local rows (true of every layout)."""
    return all(seg.stride > 0 for seg in segs) and all(
        a.start + a.stride * (a.length - 1) < b.start for a, b in zip(segs, segs[1:]))


def _local_order_hop(mask_mod, has_score_mod: bool, q_segs, kv_segs, device) -> Optional[Hop]:
    """The whole block as one hop over LOCAL positions, where that gives the same mask.

    A mask that only compares q_idx with kv_idx (causal) keeps its answer when positions
    are replaced by any increasing relabelling applied to both sides. So where a rank holds
    its own K/V (the same positions as its queries, in increasing order), the block is
    causal on local row indices: one call with the kernel's native causal mask, instead of
    one per pair of segments (three on the zigzag diagonal) and the merges between them.
    """
    if mask_mod is None or has_score_mod or len(q_segs) < 2 or list(q_segs) != list(kv_segs) or not _in_order(q_segs):
        return None
    try:
        band = diagonal_band(trace_mask_mod(mask_mod, device))
    except UnsupportedModError:
        return None
    if band not in _ORDER_BANDS:
        return None
    length = sum(seg.length for seg in q_segs)
    local = Segment(0, 1, length)
    return Hop((0, length), (0, length), local, local, BlockKind.PARTIAL)


_CHECKED = ByObjects(64)  # mods and segments whose lookups stay in bounds


def check_lookups(mod, kind: str, batch: int, heads: int, q_segs, kv_segs_per_step, device) -> None:
    """Raises where ``mod`` (a ``kind``, "score_mod" or "mask_mod") reads a captured tensor out
    of bounds at this rank's queries, any key, batch or head (``trace.lookup_error``; subscripts
    of several inputs, ``bounds.ranged_lookup_error``), before anything evaluates it on the
    device. Remembered by what the mod computes with tensors of which shapes (and, where a
    subscript reads a tensor, which tensors) and by the segments: a mod of the same code used
    every call is checked once, whatever tensors it captures. A mod that cannot be traced is
    tried on a sample of the call instead (``_try_untraced``)."""
    kv_segs = [seg for segs in kv_segs_per_step for seg in segs]
    try:
        graph = (trace_score_mod if kind == "score_mod" else trace_mask_mod)(mod, device)
    except UnsupportedModError:
        _try_untraced(mod, kind, batch, heads, q_segs, kv_segs, device)
        return
    tables = graph.tensors() if subscripts_read_tensors(graph) else []
    key = (graph.structure, tensor_versions(tables), batch, heads, tuple(q_segs),
           tuple(map(tuple, kv_segs_per_step)), str(device))

    def check():
        values = {"b": torch.arange(batch, device=device), "h": torch.arange(heads, device=device),
                  "q_idx": torch.cat([seg.positions(device) for seg in q_segs]),
                  "kv_idx": torch.cat([seg.positions(device) for seg in kv_segs])}
        error = lookup_error(graph, values) or ranged_lookup_error(graph, batch, heads, q_segs, kv_segs, device)
        if error:
            raise ValueError(error)

    _CHECKED.get(key, tables, check)


def _try_untraced(mod, kind: str, batch: int, heads: int, q_segs, kv_segs, device) -> None:
    """Evaluates a mod that cannot be traced, which the kernels evaluate as written, at every
    batch element and head and at the first and last position of every segment: what it raises
    there (a name it lacks, a tensor it reads past its end) or a result that is not one value
    per score element then fails the call's check on every rank, not a rank's ring."""
    def ends(segs):
        positions = {p for seg in segs if seg.length for p in (seg.start, seg.start + seg.stride * (seg.length - 1))}
        return torch.tensor(sorted(positions), dtype=torch.int32, device=device)

    b, h, q_idx, kv_idx = index_grid(batch, heads, ends(q_segs), ends(kv_segs))
    grid = (batch, heads, q_idx.shape[2], kv_idx.shape[3])
    scores = (torch.zeros(grid, device=device),) if kind == "score_mod" else ()
    error = result_shape_error(kind, torch.as_tensor(mod(*scores, b, h, q_idx, kv_idx)).shape, grid)
    if error:
        raise ValueError(error)


def plan_hops(mask_mod, has_score_mod: bool, batch: int, heads: int, q_segs, kv_segs_per_step, device=None,
              min_tile: int = 1024, kernel=None):
    """The hops of every ring step: the non-EMPTY (Q segment, KV segment) pairs, sparse
    PARTIAL blocks split down to ``min_tile`` tokens unless ``kernel`` computes them exactly
    by itself (``HopKernel.plans_within``): then splitting only adds calls and merges, and
    the hop covers only the rows and keys the kernel's calls reach.

    ``kv_segs_per_step[i]`` are the segments of the KV block held at step i. Blocks the
    mask's formula decides are classified on the host; the rest on ``device``, read back to
    the host at once (one synchronisation); only splitting a sparse block reads more.
    """
    if mask_mod is not None:
        check_lookups(mask_mod, "mask_mod", batch, heads, q_segs, kv_segs_per_step, device)
    pairs = [(step, qr, q, kr, kv)
             for step, kv_segs in enumerate(kv_segs_per_step)
             for qr, q in zip(_local_ranges(q_segs), q_segs)
             for kr, kv in zip(_local_ranges(kv_segs), kv_segs)]
    decide = block_decider(mask_mod, batch, heads, device) if mask_mod is not None else None
    kinds = _read_kinds([classify(mask_mod, batch, heads, q, kv, device, decide) for _, _, q, _, kv in pairs])

    def kind_of(q_seg, kv_seg):
        return _read_kinds([classify(mask_mod, batch, heads, q_seg, kv_seg, device, decide)])[0]

    planned_part = part_planner(kernel, mask_mod, has_score_mod, device)

    steps = [[] for _ in kv_segs_per_step]
    for (step, qr, q, kr, kv), kind in zip(pairs, kinds):
        if kind != BlockKind.EMPTY:
            steps[step] += _split(Hop(qr, kr, q, kv, kind), kind_of, min_tile, planned_part)
    plan = [_merge(hops, has_score_mod, planned_part) for hops in steps]
    for step, kv_segs in enumerate(kv_segs_per_step):
        local = _local_order_hop(mask_mod, has_score_mod, q_segs, kv_segs, device)
        if local is not None and len(plan[step]) > 1:
            plan[step] = [local]
    return plan


def part_planner(kernel, mask_mod, has_score_mod: bool, device) -> Optional[Callable]:
    """``kernel.plans_within`` bound to a call's mods: (q_seg, kv_seg) -> the part of a PARTIAL
    block the kernel's calls reach, or None; None without a kernel. The planner trims hops with
    it, and lending the parts of hops it cuts."""
    return None if kernel is None else functools.partial(kernel.plans_within, mask_mod, has_score_mod, device=device)


def around(spans) -> Tuple[int, int]:
    """One range around the non-empty row ranges ``spans``; (0, 0) if there are none."""
    spans = [(lo, hi) for lo, hi in spans if hi > lo]
    return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else (0, 0)


def keys_read(schedule, world_size: int) -> List[Tuple[int, int]]:
    """Per ring step (``world_size`` of them), the rows of the K/V block held then that the
    step's hops read, as one range around all of them; (0, 0) where they read none."""
    return [around(hop.kv_rows for hop in (schedule[step] if step < len(schedule) else []))
            for step in range(world_size)]


def distances_needed(keys_read_by_rank) -> List[int]:
    """The distances (in ranks back) of the blocks the ring brings: 0, the own block, then every
    distance at which some rank reads keys (a step each, or the far ones in one:
    ``RingCall.agree``). Blocks go straight from their owner, so a distance no rank reads is
    skipped: a sliding window or documents over zigzag read the ranks on either side (distances
    1 and W - 1) and the ring brings those two blocks alone; over contiguous they read distance
    1 alone, and no other block travels."""
    return [0] + [d for d in range(1, len(keys_read_by_rank[0]))
                  if any(spans[d][1] > spans[d][0] for spans in keys_read_by_rank)]


def widened(r: Tuple[int, int], length: int) -> Tuple[int, int]:
    """Rows ``r`` of a block of ``length`` rows widened inside it to a power of two (or to the
    whole block). A received block holds these rows, so its row count, and with it the strides
    a kernel sees, takes one of a few values whatever the mask: the cuDNN kernel builds a
    graph for each (a slow build), and packed documents would otherwise ask for a new one
    whenever a document straddling the ranks changes length. Costs at most twice the rows."""
    lo, hi = r
    if hi <= lo:
        return r
    n = min(length, 1 << (hi - lo - 1).bit_length())
    hi = min(length, lo + n)
    return hi - n, hi


class MaskCache:
    """Values computed from a mask_mod (plans, a kernel's block masks), kept so a training
    loop computes them once. An entry is only reused while the mod object and every tensor
    it captured are the very same objects, unmodified (same version counter), so new
    document ids always recompute."""

    def __init__(self, size: int = 64):
        self.cache = ByObjects(size)

    def lookup(self, mask_mod, key: tuple, compute: Optional[Callable]):
        """The value of ``compute()`` for ``mask_mod`` and the hashable rest of its inputs ``key``;
        with ``compute`` None only a value computed before, else ``LookupError``."""
        parts = captured.parts(mask_mod)
        tensors = [p for p in parts if isinstance(p, Tensor)]
        key = (id(mask_mod), fingerprint(mask_mod, parts=parts), tensor_versions(tensors)) + key
        return self.cache.get(key, ([mask_mod] if mask_mod is not None else []) + tensors, compute)


class PlanCache(MaskCache):
    """Plans by mask and segments, so a training loop classifies its blocks once."""

    def get(self, mask_mod, has_score_mod, batch, heads, q_segs, kv_segs_per_step, device=None, min_tile=1024,
            kernel=None, planned_only: bool = False):
        """The plan (``plan_hops``) of these arguments; with ``planned_only`` only one made
        before, else ``LookupError``."""
        key = (min_tile, has_score_mod, batch, heads, tuple(q_segs), tuple(map(tuple, kv_segs_per_step)), str(device),
               kernel and kernel.name)
        return self.lookup(mask_mod, key, None if planned_only else lambda: plan_hops(
            mask_mod, has_score_mod, batch, heads, q_segs, kv_segs_per_step, device, min_tile, kernel))
