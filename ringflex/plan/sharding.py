"""Which global positions each rank holds, as a value, and choosing it from the mask.

A ``Sharding`` is, for each rank of a ring, a tuple of ``Segment`` s (runs of global positions
``start + stride * i``, in local order) over a sequence of ``seq_len`` positions: the three
fixed layouts (``Sharding.of_layout``: contiguous, zigzag, striped) are Shardings, and so is
what ``shard_by_mask`` finds. It is frozen, hashable and printable; ``digest`` is a stable
integer the ranks can compare.

``estimate`` prices a Sharding under a mask with the ring's cost model (pairs of the mask each
rank computes at each ring step, how many steps the ring needs, the rows that travel, the
kernel calls); ``shard_by_mask`` picks the cheapest of the fixed layouts, assignments of
equal chunks of the sequence to ranks found by a local search on the same model, and, given
document ids, a per-document head-tail sharding and whole documents packed by their work.
See docs/sharding.md.

Imports no torch.distributed: it is pure planning, the same on every rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..mod.band import diagonal_band
from ..mod.graph import UnsupportedModError
from ..mod.fingerprint import fingerprint
from ..mod.trace import trace_mask_mod
from .blocks import widened
from .layout import LAYOUTS, Sharding, divisor
from .runs import BandRuns, band_runs
from .workload import Workload, workload

# The cost model's weights, in (query, key) pairs of one head's attention (fwd + bwd), at
# B=1, H=32, D=128 (0.109 ms per million pairs on an H100 or H200, cuDNN):
# - a kernel call costs the GPU about as long as 1.3 million pairs beyond its own
#   (kernels/cudnn/kernel.py); it scales as 1 / (batch * heads * head_dim).
# - a row of K and V that travels one ring step (and its dK, dV share back) costs about as
#   long as 3000 pairs: compute and transfer both grow with heads * head_dim, so this holds
#   at any size of heads, and is a property of the GPU and its links (4x H100, copy engines).
# - the host issues each ring step in about 1.5-2.2 ms (fwd + bwd: transfers, merges, the
#   steps' bookkeeping) and each kernel call in about 0.75-0.85 ms (cuDNN's execute, the
#   merge or sum of its rows): 16 and 7 million pairs' worth. Host and GPU work overlap, so
#   a rank takes the longer of the two; at 8k tokens a GPU, windows and packed documents
#   are bound by the host (fitted to 2x H200 and 4x H100 at 8k tokens a GPU:
#   docs/sharding.md).
# - a pair whose query or key segment is strided (``striped``) costs about 10% more: cuDNN
#   runs the narrower bands of a strided block at that much lower a rate per pair.
# - a row that re-sharding moves (``resharding``) costs about 5000: it carries q, k and v
#   there and the output back (dO there and dq, dk, dv back in backward), twice the tensors
#   of a row that travels a step, and the call waits for each move: nothing overlaps it
#   (fitted at 8k tokens a GPU: docs/sharding.md).
CALL_PAIRS = 1_300_000
TOKEN_PAIRS = 3_000
HOST_STEP_PAIRS = 16_000_000
HOST_CALL_PAIRS = 7_000_000
STRIDED_EXTRA = 0.10
MOVE_PAIRS = 5_000


@dataclass(frozen=True)
class Weights:
    """What the cost model prices beyond the pairs themselves, in pairs (the constants above):
    a kernel call on the GPU, a row that travels a step, a ring step and a kernel call on the
    host, and the extra share of a strided pair. ``NO_WEIGHTS``: none, the cost is then the
    busiest rank's pairs."""

    call: float = CALL_PAIRS
    token: float = TOKEN_PAIRS
    host_step: float = HOST_STEP_PAIRS
    host_call: float = HOST_CALL_PAIRS
    strided: float = STRIDED_EXTRA


NO_WEIGHTS = Weights(0, 0, 0, 0, 0)


# ---------------------------------------------------------------------- the cost model

def mask_work(mask_mod: Optional[Callable], seq_len: int, *, batch: int = 1, heads: int = 1,
              device=None) -> Union[BandRuns, Workload]:
    """What ``estimate`` counts the mask's pairs from: the closed form where the mask is a
    band of runs (documents, causal, windows: ``runs.band_runs``), which a new packed batch
    costs next to nothing to price, else the tiled count (``workload``)."""
    return band_runs(mask_mod, seq_len, device) or workload(mask_mod, seq_len, batch=batch, heads=heads, device=device)


def estimate(sharding: Sharding, mask_mod: Optional[Callable], *, batch: int = 1, heads: int = 1, device=None,
             weights: Weights = Weights(), work: Union[BandRuns, Workload, None] = None,
             order_only: Optional[bool] = None) -> Dict[str, object]:
    """The ring's cost under ``mask_mod`` (None: no mask) over ``sharding``, in pairs per head.

    - ``pairs[d][r]``: the (query, key) pairs rank r computes against the keys of rank
      (r - d) mod W, the block the ring's step of distance d brings.
    - ``steps``: the ring's steps: the own block and each distance at which some rank sees
      keys (the ring skips the others, as ``plan.distances_needed``).
    - ``critical_pairs``: the busiest rank's pairs over the ring's steps: no step waits for
      the other ranks (each block comes straight from its owner), so the busiest rank sets
      the pace. ``total_pairs`` / W over it is ``balance`` (1: even).
    - ``hops``: the non-empty (rank, step) pairs. ``calls``: kernel calls, one per PARTIAL
      (query segment, key segment) pair and one for all FULL ones of a (rank, step), which
      the planner joins.
    - ``travel_rows``: the most rows that one transfer carries (to a rank at a step after the
      first: one range around the rows of the block it holds then that its queries see,
      widened to a power of two, as the ring sends them).
    - ``cost``: the slowest rank's time, the longer of its GPU work and its host work (which
      run side by side). GPU: its own block, then per step the longer of its hop and the
      transfer of the rows it reads of the step's block (which the ring overlaps with the step before), a hop
      being its pairs (strided ones ``weights.strided`` dearer) plus ``weights.call`` per
      call, a transfer ``weights.token`` per row. Host: ``weights.host_step`` per step and
      ``weights.host_call`` per call.
    - ``gpu_cost``: the busiest rank's GPU work alone: of two shardings the host prices alike,
      the one with less is never slower (and a call replayed from a CUDA graph has no host
      work), so ``cheapest`` compares it second.
    - ``exact``: False where the mask's pairs were sampled (``workload``).

    ``work``, ``order_only``: the mask's count over this length (``mask_work``) and whether it
    only compares q_idx with kv_idx (``_compares_order_only``), where the caller has them.
    """
    world = sharding.world_size
    if work is None:
        work = mask_work(mask_mod, sharding.seq_len, batch=batch, heads=heads, device=device)
    segs = _segments(sharding)
    seg_pairs, travelling = _usage(sharding, segs, work, lambda: workload(mask_mod, sharding.seq_len, batch=batch,
                                                                          heads=heads, device=device))
    seg_len = segs[2].astype(np.float64)
    member = np.eye(world)[segs[3]]  # [segments, ranks]
    by_rank = member.T @ seg_pairs @ member
    strided = (segs[1] > 1) & (segs[2] > 1)
    weighed = by_rank + weights.strided * (member.T @ (seg_pairs * (strided[:, None] | strided[None, :])) @ member)
    full = seg_pairs >= np.outer(seg_len, seg_len) * (1 - 1e-9)
    partial = member.T @ ((seg_pairs > 0) & ~full).astype(np.float64) @ member
    any_full = (member.T @ full.astype(np.float64) @ member) > 0
    calls = partial + any_full
    held = _held_at(world)
    pairs, calls, weighed = by_rank.ravel()[held], calls.ravel()[held], weighed.ravel()[held]  # [step, rank]
    if order_only is None:
        order_only = _compares_order_only(mask_mod, device)
    if order_only:  # the planner runs such a rank's own block as one call
        ordered = np.array([_in_order(segs) for segs in sharding.ranks])
        calls[0] = np.where(ordered & (pairs[0] > 0), 1, calls[0])
    needed = np.union1d(0, np.flatnonzero(pairs.max(1) > 0))  # the ring's steps (``plan.distances_needed``)
    steps = len(needed)
    travel = travelling() if steps > 1 else np.zeros((world, world))
    hop = (weighed + weights.call * calls)[needed]
    gpu = np.maximum(hop, weights.token * travel[needed]).sum(0)
    host = weights.host_step * steps + weights.host_call * calls[needed].sum(0)
    critical = float(pairs[needed].sum(0).max())
    total = float(pairs.sum())
    return {
        "sharding": sharding.name, "world_size": world, "seq_len": sharding.seq_len,
        "pairs": [[_number(x) for x in row] for row in pairs.tolist()],
        "critical_pairs": _number(critical), "total_pairs": _number(total),
        "balance": total / world / critical if critical else 1.0,
        "steps": steps, "hops": int((pairs > 0).sum()), "calls": int(calls[needed].sum()),
        "travel_rows": int(travel.max()), "cost": float(np.maximum(gpu, host).max()), "gpu_cost": float(gpu.max()),
        "exact": work.exact,
    }


# Masks that only compare q_idx with kv_idx: causal, and its strict and reversed forms (``plan``).
_ORDER_BANDS = {(0, None), (1, None), (None, 0), (None, -1)}


@functools.lru_cache(maxsize=64)
def _held_at(world: int) -> np.ndarray:
    """[step, rank] (read-only): where rank r's pairs at step s lie in a flat [W * W] matrix of
    (queries' rank, keys' rank), against the block of rank (r - s) mod W, which it holds then."""
    ranks = np.arange(world)
    held = ranks[None, :] * world + (ranks[None, :] - ranks[:, None]) % world
    held.flags.writeable = False
    return held


def _compares_order_only(mask_mod, device) -> bool:
    """Whether ``mask_mod`` only compares q_idx with kv_idx (``plan._local_order_hop``)."""
    if mask_mod is None:
        return False
    try:
        return diagonal_band(trace_mask_mod(mask_mod, device)) in _ORDER_BANDS
    except UnsupportedModError:
        return False


def _in_order(segs) -> bool:
    """Whether positions increase along a rank's local rows."""
    return all(s.stride > 0 for s in segs) and all(
        a.start + a.stride * (a.length - 1) < b.start for a, b in zip(segs, segs[1:]))


def _number(x: float):
    """``x`` (a Python float: numpy's scalars round slowly) as an int where it is one."""
    return int(round(x)) if abs(x - round(x)) < 1e-6 else float(x)


def _segments(sharding: Sharding) -> np.ndarray:
    """[5, segments] int64: each segment's start, stride, length, rank and first local row."""
    rows = []
    for rank, segs in enumerate(sharding.ranks):
        at = 0
        for s in segs:
            rows.append((s.start, s.stride, s.length, rank, at))
            at += s.length
    return np.array(rows, dtype=np.int64).reshape(-1, 5).T


def _on_tiles(sharding: Sharding, segs: np.ndarray, tile: int) -> Optional[np.ndarray]:
    """Where every segment (``segs``: ``_segments``) is a run of whole tiles (stride 1, its ends
    on tile edges or the sequence's end): the segment of each tile ([T] int64); else None."""
    seg_of_tile = np.full(-(-sharding.seq_len // tile), -1, dtype=np.int64)
    for g, (start, stride, length) in enumerate(segs[:3].T.tolist()):
        end = start + length
        if (stride != 1 and length > 1) or start % tile or (end % tile and end != sharding.seq_len):
            return None
        seg_of_tile[start // tile:-(-end // tile)] = g
    return seg_of_tile


def _usage(sharding: Sharding, segs: np.ndarray, work, tiled_count: Callable[[], Workload]):
    """(pairs [S, S] of the sharding's segments (``segs``: ``_segments``), queries against
    keys; a function that gives ``estimate``'s travelling rows, ``_travel``) from ``work`` (``mask_work``);
    where a ``BandRuns`` cannot count these segments, from the tiled count ``tiled_count()``."""
    seg_rank = segs[3]
    if isinstance(work, BandRuns):
        found = work.usage(*segs)
        if found is not None:
            return found[0], lambda: _travel(sharding, _spans(sharding.world_size, *found[1]))
        work = tiled_count()
    seg_of_tile = _on_tiles(sharding, segs, work.tile)
    if seg_of_tile is not None:
        member = np.eye(len(seg_rank))[seg_of_tile]  # [tiles, segments]
        return (member.T @ work.tile_pairs[0] @ member,
                lambda: _travel(sharding, _read_spans_tiled(sharding, segs, work, seg_of_tile)))
    labels, _ = sharding._segment_labels()
    seg_pairs, read = work.usage(labels, len(seg_rank), owner_of=torch.from_numpy(seg_rank))
    return seg_pairs.numpy(), lambda: _travel(sharding, _read_spans(sharding, read))


def _read_spans_tiled(sharding: Sharding, segs: np.ndarray, work: Workload, seg_of_tile: np.ndarray) -> np.ndarray:
    """``_read_spans`` from the tile pairs' first and end keys (a sharding on whole tiles)."""
    pairs, first, last = work.tile_pairs
    seg_begin, seg_rank, local_start = segs[0], segs[3], segs[4]
    owner = seg_rank[seg_of_tile]
    to_local = local_start[seg_of_tile] - seg_begin[seg_of_tile]  # a key tile's positions as local rows
    records = []
    for reader in range(sharding.world_size):  # the key tiles of other ranks its query tiles see
        mine = owner == reader
        sees = pairs[mine] > 0
        tiles = np.flatnonzero(sees.any(0) & ~mine)
        lo = np.where(sees, first[mine], sharding.seq_len).min(0)[tiles]
        hi = np.where(sees, last[mine], 0).max(0)[tiles] - 1
        records.append((np.full(len(tiles), reader), owner[tiles], to_local[tiles] + lo, to_local[tiles] + hi))
    return _spans(sharding.world_size, *(np.concatenate(r) for r in zip(*records)))


def _read_spans(sharding: Sharding, read: Tensor) -> np.ndarray:
    """``_spans`` of ``read`` ([world, seq_len]: the keys of other ranks that each rank's queries see)."""
    read, spans = read.numpy(), _no_spans(sharding.world_size)
    for owner in range(sharding.world_size):
        seen = read[:, sharding.positions(owner).numpy()]  # [reader, the owner's local rows]
        some = seen.any(1)
        spans[some, owner] = np.stack([seen.argmax(1), seen.shape[1] - 1 - seen[:, ::-1].argmax(1)], 1)[some]
    return spans


def _spans(world: int, reader: np.ndarray, owner: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """[world, world, 2]: per reading rank and holding rank, the least ``first`` and greatest
    ``last`` local row of the holder's keys that the reader's queries see, over reads by
    ``reader`` of ``owner``'s keys; first > last where it sees none."""
    spans = _no_spans(world)
    np.minimum.at(spans[..., 0], (reader, owner), first)
    np.maximum.at(spans[..., 1], (reader, owner), last)
    return spans


def _no_spans(world: int) -> np.ndarray:
    """``_spans`` where no rank sees another's keys."""
    spans = np.empty((world, world, 2), dtype=np.int64)
    spans[..., 0], spans[..., 1] = np.iinfo(np.int64).max, -1
    return spans


def _travel(sharding: Sharding, spans: np.ndarray) -> np.ndarray:
    """[step, rank]: the rows that travel to each rank at each ring step, as the ring sends
    them (``RingCall.rows_sent``): one range (in local order) around the keys of the block it
    holds then, the rank ``step`` back's, that its queries see (``spans``), widened to a power
    of two (``plan.blocks.widened``); none at step 0, the own block."""
    world = sharding.world_size
    travel = np.zeros((world, world))
    for step in range(1, world):
        for rank in range(world):
            owner = (rank - step) % world
            first, last = spans[rank, owner].tolist()
            if first <= last:
                lo, hi = widened((first, last + 1), sharding.local_len(owner))
                travel[step, rank] = hi - lo
    return travel


def describe(est: Dict[str, object]) -> str:
    """One line of an ``estimate``: what a benchmark or a test prints."""
    return (f"{est['sharding']:>22}: critical {est['critical_pairs'] / 1e6:8.2f}M pairs "
            f"(balance {est['balance']:.2f}), {est['steps']} steps, {est['hops']:3d} hops, {est['calls']:4d} calls, "
            f"travel {est['travel_rows']:6d} rows, cost {est['cost'] / 1e6:8.2f}M")


# ---------------------------------------------------------------------- choosing a sharding

def shard_by_mask(mask_mod: Optional[Callable], seq_len: int, world_size: int, *, document_ids: Optional[Tensor] = None,
                  batch: int = 1, heads: int = 1, chunks: Optional[int] = None, device=None,
                  weights: Weights = Weights()) -> Sharding:
    """The Sharding of ``seq_len`` positions over ``world_size`` ranks (equal sizes) that the
    cost model (``estimate``) prices cheapest for ``mask_mod``: never dearer than the best
    fixed layout; on a tie, the one with less GPU work (``cheapest``). ``document_ids``
    ([seq_len], as ``mods.document`` takes them) adds candidates that cut by document; ``chunks`` (a
    multiple of ``world_size`` dividing ``seq_len``) sets the pieces the search moves (default
    4 per rank, each a multiple of the workload's tile where the length allows); ``weights``
    what the model prices beyond pairs (``Weights``: kernel calls and travelling rows on the
    GPU, steps and calls on the host, strided pairs; fitted at B=1, H=32, D=128).
    Deterministic: every rank computes the same Sharding from the same arguments."""
    found = compare(mask_mod, seq_len, world_size, document_ids=document_ids, batch=batch, heads=heads,
                    chunks=chunks, device=device, weights=weights)
    return cheapest(found)[0]


def cheapest(found: List[Tuple[Sharding, Dict[str, object]]]) -> Tuple[Sharding, Dict[str, object]]:
    """The (sharding, estimate) of ``found`` (``compare``'s) that costs least, less GPU work
    deciding a tie (``estimate``'s ``gpu_cost``), the first of those on a tie again."""
    return min(found, key=lambda c: (c[1]["cost"], c[1]["gpu_cost"]))


@dataclass(frozen=True)
class Resharding:
    """How a call left in the default layout runs where the cost model prices that layout more
    than 10% dearer than the mask's cheapest sharding: its tokens move from ``source`` (the
    caller's shards) to ``target`` and its output back, or, where the move would save less than
    a tenth of the call, they stay (``target`` None) and the call runs slower than it could;
    ``message`` says which, to be said once."""

    source: Sharding
    target: Optional[Sharding]
    message: str


_RESHARDINGS: Dict[tuple, Optional[Resharding]] = {}


def resharding(mask_mod: Optional[Callable], seq_len: int, world_size: int, layout: str, *, batch: int = 1,
               heads: int = 1, device=None, price: bool = True) -> Optional[Resharding]:
    """How a call that runs ``mask_mod`` in the fixed ``layout`` it did not choose runs, where
    the cost model prices the best sharding of ``compare`` more than 10% cheaper than
    ``layout``: there, where it stays more than 10% cheaper with the move of its tokens there
    and back, else in place (None where ``layout`` is within 10% of the best, or where the mask
    cannot be priced). Decided once per mask structure and size (packed batches' masks, new
    every step, share one), the same on every rank; ``price=False`` gives only a decision made
    before (a CUDA-graph capture cannot price on its device)."""
    key = (fingerprint(mask_mod), seq_len, world_size, layout, batch, heads)
    if key in _RESHARDINGS or not price:
        return _RESHARDINGS.get(key)
    _RESHARDINGS[key] = None
    if mask_mod is None or world_size < 2:
        return None
    try:
        found = compare(mask_mod, seq_len, world_size, batch=batch, heads=heads, device=device)
    except Exception:  # noqa: BLE001 (the call itself checks the mask, in its plan)
        return None
    given = next((e["cost"] for s, e in found if s.name == layout), None)
    best, chosen = cheapest(found)
    cost = chosen["cost"]
    if given is None or best.name == layout or cost >= 0.9 * given:
        return None
    source = Sharding.of_layout(layout, seq_len, world_size)
    rows = _most_rows_sent(source, best)
    moved = cost + MOVE_PAIRS * rows
    slower = (f"ringflex: this mask runs an estimated {given / cost:.1f}x slower in the default layout {layout!r} "
              f"than in the sharding {best.name!r} that ringflex.shard_by_mask chooses for it")
    advice = ("shard with layout=ringflex.shard_by_mask(mask_mod, seq_len, world_size) and pass the same layout "
              f"to ring_flex_attention and unshard; or pass layout={layout!r} to keep the tokens where they are")
    if moved < 0.9 * given:
        _RESHARDINGS[key] = Resharding(source, best, (
            f"{slower}, so each call re-shards: q, k and v move there and the output back (up to "
            f"{rows} of a rank's {seq_len // world_size} tokens; with the move the call is estimated "
            f"{given / moved:.1f}x faster than in place, the move about {1 - cost / moved:.0%} of "
            f"its time). To avoid the move, {advice}"))
    else:
        _RESHARDINGS[key] = Resharding(source, None, (
            f"{slower}. Moving its tokens there at each call (up to {rows} of a rank's {seq_len // world_size}) "
            f"would save less than a tenth of the call, so calls run in place, slower than they could. To run in "
            f"that sharding, {advice}"))
    return _RESHARDINGS[key]


def _most_rows_sent(source: Sharding, target: Sharding) -> int:
    """The most rows one rank sends to other ranks when a sequence moves from ``source`` to ``target``."""
    owners = source.owners()
    leaving = owners[owners != target.owners()]
    return int(torch.bincount(leaving, minlength=source.world_size).max())


def compare(mask_mod: Optional[Callable], seq_len: int, world_size: int, *, document_ids: Optional[Tensor] = None,
            batch: int = 1, heads: int = 1, chunks: Optional[int] = None, device=None,
            weights: Weights = Weights()) -> List[Tuple[Sharding, Dict[str, object]]]:
    """Every candidate ``shard_by_mask`` weighs, with its ``estimate``, in the order they are
    preferred on equal cost: the fixed layouts first."""
    if world_size < 1 or seq_len < world_size or seq_len % world_size:
        raise ValueError(f"seq_len ({seq_len}) must be a positive multiple of world_size ({world_size}): "
                         "a ring's shards have equal sizes")
    if document_ids is not None and tuple(document_ids.shape) != (seq_len,):
        raise ValueError(f"document_ids must have shape [{seq_len}], got {tuple(document_ids.shape)}")
    device = device if device is not None else (document_ids.device if document_ids is not None else None)
    fixed = [Sharding.of_layout(name, seq_len, world_size) for name in LAYOUTS
             if seq_len % divisor(name, world_size) == 0]
    work = mask_work(mask_mod, seq_len, batch=batch, heads=heads, device=device)
    price = dict(work=work, order_only=_compares_order_only(mask_mod, device), weights=weights, device=device)
    if world_size == 1 or mask_mod is None:  # every sharding does the same work; one segment a rank calls least
        return [(fixed[0], estimate(fixed[0], mask_mod, **price))]
    extra = _searched(work, world_size, chunks, weights)
    if document_ids is not None:
        docs = _documents(document_ids)
        extra += [_per_document(docs, world_size), _packed_documents(docs, world_size, work.row_pairs())]
    found, seen = [], set()
    for s in fixed + extra:
        if s is not None and s not in seen:
            seen.add(s)
            found.append((s, estimate(s, mask_mod, **price)))
    return found


def per_document(document_ids: Tensor, world_size: int) -> Optional[Sharding]:
    """Each document cut in 2 * world_size pieces, rank r holding pieces r and 2W-1-r (the
    head-tail balance of TransformerEngine and torch for packed sequences), the pieces' odd
    tokens spread so every rank holds as many; None where they cannot be."""
    return _per_document(_documents(document_ids), world_size)


def _per_document(docs: List[Tuple[int, int]], world_size: int) -> Optional[Sharding]:
    """``per_document`` of the documents ``docs`` (``_documents``, which ``compare`` finds once)."""
    seq_len, pieces = docs[-1][1], 2 * world_size
    extra = [0] * world_size
    runs: List[List[Tuple[int, int]]] = [[] for _ in range(world_size)]
    for begin, end in docs:
        base, rem = divmod(end - begin, pieces)
        sizes = [base] * pieces
        order = sorted(range(world_size), key=lambda r: (extra[r], r))
        for j in range(rem):  # a rank's two pieces take at most one odd token each
            rank = order[j % world_size]
            sizes[rank if j < world_size else pieces - 1 - rank] += 1
            extra[rank] += 1
        at = begin
        for piece, size in enumerate(sizes):
            if size:
                _append_run(runs[piece if piece < world_size else pieces - 1 - piece], at, at + size)
            at += size
    if len(set(extra)) != 1:
        return None
    return Sharding.from_ranges(seq_len, runs, "per-document")


def packed_documents(document_ids: Tensor, world_size: int, row_pairs: Tensor) -> Sharding:
    """Whole documents packed onto the ranks by their work (``row_pairs``: the keys each
    query row sees), heaviest first, each rank filled to its share of the tokens by a
    document cut in two, whose first part stays on this rank and whose rest begins the next:
    the cut document's rows see its first part one ring step later, so a causal document
    mask keeps the ring at two steps while the ranks' work evens out."""
    return _packed_documents(_documents(document_ids), world_size, row_pairs)


def _packed_documents(docs: List[Tuple[int, int]], world_size: int, row_pairs: Tensor) -> Sharding:
    """``packed_documents`` of the documents ``docs`` (``_documents``, which ``compare`` finds once)."""
    seq_len = docs[-1][1]
    local = seq_len // world_size
    work = np.concatenate([[0.0], row_pairs.double().cumsum(0).numpy()])
    docs = sorted(docs, key=lambda d: (-(work[d[1]] - work[d[0]]), d[0]))
    target = work[-1] / world_size
    runs: List[List[Tuple[int, int]]] = [[] for _ in range(world_size)]
    carry: Optional[Tuple[int, int]] = None  # the rest of a document cut at the previous rank
    for rank in range(world_size):
        room, load = local, 0.0
        if carry is not None:
            take = min(room, carry[1] - carry[0])
            runs[rank].append((carry[0], carry[0] + take))
            room, load = room - take, work[carry[0] + take] - work[carry[0]]
            carry = (carry[0] + take, carry[1]) if take < carry[1] - carry[0] else None
        for fits_load in (True, False):  # whole documents within the share of work, then any that fit
            for d in list(docs):
                weight = work[d[1]] - work[d[0]]
                if d[1] - d[0] <= room and (not fits_load or load + weight <= target):
                    runs[rank].append(d)
                    docs.remove(d)
                    room, load = room - (d[1] - d[0]), load + weight
        if room and docs:  # cut the lightest document that does not fit
            d = docs.pop()
            runs[rank].append((d[0], d[0] + room))
            carry = (d[0] + room, d[1])
    for rank in range(world_size):
        merged: List[Tuple[int, int]] = []
        for begin, end in sorted(runs[rank]):
            _append_run(merged, begin, end)
        runs[rank] = merged
    return Sharding.from_ranges(seq_len, runs, "packed documents")


def _documents(document_ids: Tensor) -> List[Tuple[int, int]]:
    """The (begin, end) of every run of equal document ids."""
    ids = document_ids.detach().cpu()
    bounds = [0] + (np.flatnonzero((ids[1:] != ids[:-1]).numpy()) + 1).tolist() + [len(ids)]
    return list(zip(bounds, bounds[1:]))


def _append_run(runs: List[Tuple[int, int]], begin: int, end: int) -> None:
    if runs and runs[-1][1] == begin:
        runs[-1] = (runs[-1][0], end)
    else:
        runs.append((begin, end))


def _chunk_count(seq_len: int, world_size: int, chunks: Optional[int], tile: int) -> int:
    if chunks is not None:
        if chunks % world_size or seq_len % chunks:
            raise ValueError(f"chunks ({chunks}) must be a multiple of world_size ({world_size}) that divides "
                             f"seq_len ({seq_len})")
        return chunks
    # 4 a rank: at 8k tokens a rank, 8 found no cheaper sharding for causal, window, document,
    # prefix-LM, block, dilated or global-token masks on 2 or 4 ranks, at twice the search time
    for per_rank in (4, 2):
        if seq_len % (per_rank * world_size * tile) == 0:  # chunks of whole tiles, where the length allows
            return per_rank * world_size
    for per_rank in (4, 2):
        if seq_len % (per_rank * world_size) == 0:
            return per_rank * world_size
    return world_size


def _chunk_pairs(work: Union[BandRuns, Workload], count: int) -> np.ndarray:
    """[count, count]: the pairs of equal chunk i's queries against chunk j's keys."""
    size = work.seq_len // count
    if isinstance(work, BandRuns):
        return work.usage(np.arange(count) * size, np.ones(count, dtype=np.int64), np.full(count, size))[0]
    if size % work.tile:
        return work.pairs(torch.arange(work.seq_len) // size, count).numpy()
    tiles = size // work.tile
    tile_pairs = work.tile_pairs[0]
    n = len(tile_pairs)
    return np.pad(tile_pairs, ((0, count * tiles - n), (0, count * tiles - n))).reshape(count, tiles, count, tiles).sum((1, 3))


def _searched(work: Union[BandRuns, Workload], world_size: int, chunks: Optional[int],
              weights: Weights) -> List[Sharding]:
    """Assignments of equal chunks to ranks, each found by swapping two chunks of two ranks
    while that lowers the cost (``_Search``), from several starts: contiguous and zigzag
    chunks, and the heaviest chunks first to the least loaded rank."""
    count = _chunk_count(work.seq_len, world_size, chunks, work.tile)
    if count == world_size:
        return []
    chunk_pairs = _chunk_pairs(work, count)
    search = _Search(chunk_pairs, world_size, work.seq_len // world_size, weights)
    per_rank = count // world_size
    starts = {"contiguous": np.arange(count) // per_rank, "greedy": search.greedy()}
    if per_rank % 2 == 0:  # zigzag's chunks
        zig = np.arange(count) // (per_rank // 2)
        starts["zigzag"] = np.where(zig < world_size, zig, 2 * world_size - 1 - zig)
    owners = search.descend(np.stack(list(starts.values())))
    found = {}
    for name, owner, cost in zip(starts, owners, search.cost(*search.state(owners)).tolist()):
        found.setdefault(tuple(owner), (cost, name))
    size, shardings = work.seq_len // count, []
    for owner, (_, name) in sorted(found.items(), key=lambda kv: kv[1][0])[:2]:  # the two cheapest go on
        runs: List[List[Tuple[int, int]]] = [[] for _ in range(world_size)]
        for c in range(count):
            _append_run(runs[owner[c]], c * size, (c + 1) * size)
        shardings.append(Sharding.from_ranges(work.seq_len, runs, f"{count} chunks from {name}"))
    return shardings


@functools.lru_cache(maxsize=16)
def _swaps(count: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, u = e_i - e_j [swaps, C]), read-only, for every swap of two of ``count`` chunks
    i < j, after swap 0, chunk 0 with itself: no swap."""
    i, j = np.triu_indices(count, 1)
    i, j = np.append(0, i), np.append(0, j)
    u = np.eye(count)[i] - np.eye(count)[j]
    for a in (i, j, u):
        a.flags.writeable = False
    return i, j, u


class _Search:
    """The cost model on chunks (``pairs[i, j]``: chunk i's queries against chunk j's keys),
    every swap of two chunks between ranks priced at once. Its cost is ``estimate``'s with as
    many calls per non-empty (rank, step) as the rank has runs of chunks, and the whole block
    travelling at each needed step."""

    def __init__(self, pairs: np.ndarray, world: int, local_len: int, weights: Weights):
        self.pairs, self.world, self.count = pairs, world, len(pairs)
        self.steps = np.arange(world)
        self.transfer = np.where(self.steps > 0, weights.token * local_len, 0.0)  # step 0 waits for no block
        self.weights = weights
        self.held_at = _held_at(world)
        self.tiny = 1e-9 * max(1.0, float(pairs.sum()))
        self.eye = np.eye(world)
        self.i, self.j, self.u = _swaps(self.count)
        diag = np.diag(pairs)
        self.z = (diag[:, None] + diag[None, :] - pairs - pairs.T)[self.i, self.j]  # u^T P u for each swap's u
        self.neighbours = np.eye(self.count, k=1) + np.eye(self.count, k=-1)  # chunks next to each other
        self.beside = self.neighbours[self.i, self.j]

    def state(self, owner: np.ndarray):
        """(rank-pair matrices [W, W, n], runs of chunks per rank [W, n]) of assignments ``owner``
        [n, C]: a rank's runs are its chunks less half its chunks' neighbours on the rank."""
        member = self.eye[owner]
        by_rank = member.transpose(0, 2, 1) @ self.pairs @ member
        return by_rank.transpose(1, 2, 0), (member * (1 - (self.neighbours @ member) / 2)).sum(1).T

    def cost(self, by_rank: np.ndarray, runs: np.ndarray) -> np.ndarray:
        """Cost of rank-pair matrices ``by_rank`` [W, W, ...] whose ranks hold ``runs`` [W, ...]
        runs (the ranks lead: numpy reduces over a leading axis fastest)."""
        w = self.weights
        pairs = by_rank.reshape(self.world ** 2, -1)[self.held_at]  # [step, rank, n]
        active = pairs > self.tiny
        calls = active * runs.reshape(self.world, -1)  # [step, rank, n]
        needed = active.any(1) | (self.steps == 0)[:, None]  # [step, n]: the distances some rank reads, and its own block
        gpu = np.maximum(pairs + w.call * calls, self.transfer[:, None, None]) * needed[:, None]
        host = w.host_step * needed.sum(0) + w.host_call * calls.sum(0)  # [rank, n]: calls only where needed
        # summed along a contiguous last axis, in the order the search always summed its costs in:
        # numpy adds across rows in another order, and non-integer costs could then tie otherwise
        gpu = np.ascontiguousarray(gpu.transpose(1, 2, 0)).sum(-1)  # [rank, n]
        return np.maximum(gpu, host).max(0).reshape(runs.shape[1:])

    def greedy(self) -> np.ndarray:
        """Heaviest chunks first, each to the least loaded rank with room (by the pairs its rows see)."""
        weight = self.pairs.sum(1)
        load, room = [0.0] * self.world, [self.count // self.world] * self.world
        owner = np.zeros(self.count, dtype=np.int64)
        for c in np.argsort(-weight, kind="stable").tolist():
            rank = min((r for r in range(self.world) if room[r]), key=load.__getitem__)
            owner[c] = rank
            load[rank] += weight[c]
            room[rank] -= 1
        return owner

    def descend(self, starts: np.ndarray, max_swaps: int = 32) -> np.ndarray:
        """From each assignment of ``starts`` [n, C], swaps the best pair of chunks of two
        ranks while that lowers the cost; all of them at once, each on its own path (the
        array operations, not the swaps, are what a step costs)."""
        owner = starts.copy()
        moving = np.arange(len(owner))
        for _ in range(max_swaps):
            o = owner[moving]  # [m, C]
            costs = self.swapped(o)
            now = costs[:, 0].copy()  # no swap
            costs[o[:, self.i] == o[:, self.j]] = np.inf  # i and j on one rank, or no swap
            best = np.argmin(costs, 1)
            better = costs[np.arange(len(o)), best] < now - self.tiny
            moving, best = moving[better], best[better]
            if not len(moving):
                break
            i, j = self.i[best], self.j[best]
            owner[moving, i], owner[moving, j] = owner[moving, j], owner[moving, i]
        return owner

    def swapped(self, owner: np.ndarray) -> np.ndarray:
        """[m, swaps]: the cost of each assignment of ``owner`` [m, C] after each swap (``_swaps``),
        from the assignment's own matrices."""
        member = self.eye[owner]  # [m, C, W]
        x = self.pairs @ member  # chunk i's queries against rank r's keys
        y = self.pairs.T @ member  # chunk j's keys against rank r's queries
        by_rank, runs = self.state(owner)
        # swapping i (rank a) and j (rank b): member += u d^T with d = e_b - e_a, so
        # by_rank += y_u d^T + d x_u^T + z d d^T, x_u = x[i] - x[j], y_u = y[i] - y[j], z = u^T P u;
        # and alike a rank's runs, its chunks less (M^T N M)[r, r] / 2 for N the neighbour matrix,
        # change by -d n_u + d^2 beside, n_u = (N member)[i] - (N member)[j], beside = N[i, j]
        moved = self.u @ np.concatenate([x, y, -member, self.neighbours @ member], -1)  # [m, swaps, 4W]
        # [W, m, swaps] each, copied whole: numpy's loops over strided arrays are several times slower
        xu, yu, d, nu = moved.transpose(2, 0, 1).copy().reshape(4, self.world, *moved.shape[:2])
        new = by_rank[..., None] + yu[:, None] * d + d[:, None] * xu + self.z * d[:, None] * d  # [W, W, m, swaps]
        return self.cost(new, runs[..., None] - d * nu + d * d * self.beside)
