"""The ring's cost model: what a ``Sharding`` costs under a mask, in (query, key) pairs.

``estimate`` prices a sharding from the pairs of the mask each rank computes at each ring step,
how many steps the ring needs, the rows that travel and the kernel calls, on the GPU and on
the host; ``Weights`` are what it prices beyond the pairs, fitted to the GPUs measured (see
docs/sharding.md). ``plan.sharding`` chooses by it, ``plan.candidates`` searches on it.

Imports no torch.distributed: it is pure planning, the same on every rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from ..mod.band import diagonal_band
from ..mod.graph import UnsupportedModError
from ..mod.trace import trace_mask_mod
from .blocks import widened
from .layout import Sharding
from .runs import BandRuns, band_runs
from .workload import Workload, workload

# The cost model's weights, in (query, key) pairs of one head's attention (fwd + bwd), at
# B=1, H=32, D=128 (0.109 ms per million pairs on an H100 or H200, cuDNN):
# - a kernel call costs the GPU about as long as 1.3 million pairs beyond its own
#   (kernels/cudnn/kernel.py); it scales as 1 / (batch * heads * head_dim).
# - a row of K and V that travels one ring step (and its dK, dV share back) costs about as
#   long as 3000 pairs: compute and transfer both grow with heads * head_dim, so this holds
#   at any size of heads, and is a property of the GPU and its links (4x H100, copy engines).
# - the host's work, fwd + bwd: about 0.36 ms a ring step (its bookkeeping), 0.95 ms a block
#   of another rank that a rank reads (the transfer in, the merge of its hops' rows, its dK/dV
#   share back), 0.5 ms a rank that reads this rank's block (the transfer out, the share that
#   comes back and its sum) and 0.65 ms a kernel call (cuDNN's execute and what goes around
#   it): 3.3, 8.7, 4.6 and 6 million pairs' worth. A step that brings two ranks' rows
#   (``RingCall.keeps_received``) saves a step, not the blocks' work. Host and GPU work
#   overlap, so a rank takes the longer of the two; at 8k tokens a GPU, windows and packed
#   documents are bound by the host, or close to it (fitted to 4x H200 and 2x H200 at 8k
#   tokens a GPU: docs/sharding.md).
# - a pair whose query or key segment is strided (``striped``) costs about 10% more: cuDNN
#   runs the narrower bands of a strided block at that much lower a rate per pair.
# - a row that re-sharding moves (``resharding``) costs about 5000: it carries q, k and v
#   there and the output back (dO there and dq, dk, dv back in backward), twice the tensors
#   of a row that travels a step, and the call waits for each move: nothing overlaps it
#   (fitted at 8k tokens a GPU: docs/sharding.md). Its exchanges (one per ring distance for
#   q, k and v there, the output back, and in backward the same) cost the host some 0.4 ms a
#   distance whatever the rows: 4 million pairs' worth, within what the move measured at 8k
#   tokens a GPU over 2 ranks; a short call, which the host bounds, does not move for less.
CALL_PAIRS = 1_300_000
TOKEN_PAIRS = 3_000
HOST_STEP_PAIRS = 3_300_000
HOST_CALL_PAIRS = 6_000_000
HOST_RECEIVE_PAIRS = 8_700_000
HOST_SEND_PAIRS = 4_600_000
STRIDED_EXTRA = 0.10
MOVE_PAIRS = 5_000
MOVE_HOST_PAIRS = 4_000_000


@dataclass(frozen=True)
class Weights:
    """What the cost model prices beyond the pairs themselves, in pairs (the constants above):
    a kernel call on the GPU, a row that travels a step, a ring step and a kernel call on the
    host, the extra share of a strided pair, and on the host a block a rank receives and one
    it sends. ``NO_WEIGHTS``: none, the cost is then the busiest rank's pairs."""

    call: float = CALL_PAIRS
    token: float = TOKEN_PAIRS
    host_step: float = HOST_STEP_PAIRS
    host_call: float = HOST_CALL_PAIRS
    strided: float = STRIDED_EXTRA
    host_receive: float = HOST_RECEIVE_PAIRS
    host_send: float = HOST_SEND_PAIRS


NO_WEIGHTS = Weights(0, 0, 0, 0, 0, 0, 0)


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
      keys (the ring skips the others, as ``plan.distances_needed``), those after the own
      block as one where the rows each rank reads of them fit one block (``_joined``).
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
      call, a transfer ``weights.token`` per row. Host: ``weights.host_step`` per step,
      ``weights.host_receive`` per block of another rank read, ``weights.host_send`` per rank
      that reads the rank's block and ``weights.host_call`` per call. As the ring runs them:
      hops of one block that share no query or key segment are one call, and where the
      blocks of several other ranks fit one block they come in one step (``_joined``).
    - ``gpu_cost``: the busiest rank's GPU work alone: of two shardings the host prices alike,
      the one with less is never slower (and a call replayed from a CUDA graph has no host
      work), so ``cheapest`` compares it second.
    - ``exact``: False where the mask's pairs were sampled (``workload``).

    ``work``, ``order_only``: the mask's count over this length (``mask_work``) and whether it
    only compares q_idx with kv_idx (``compares_order_only``), where the caller has them.
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
    active = seg_pairs > 0
    partial = member.T @ (active & ~full).astype(np.float64) @ member
    any_full = (member.T @ full.astype(np.float64) @ member) > 0
    hops_of_q = active.astype(np.float64) @ member  # [segment, rank]: a query segment's hops against a rank's keys
    hops_of_k = active.T.astype(np.float64) @ member  # [segment, rank]: a key segment's hops against a rank's queries
    shared = member.T @ (hops_of_q > 1) + ((hops_of_k > 1).T @ member)  # [q rank, k rank]
    # hops that share no query segment and no key segment run as one kernel call (``compute.step_forward``)
    calls = np.where((shared == 0) & (partial + any_full > 0), 1, partial + any_full)
    held = held_at(world)
    pairs, calls, weighed = by_rank.ravel()[held], calls.ravel()[held], weighed.ravel()[held]  # [step, rank]
    if order_only is None:
        order_only = compares_order_only(mask_mod, device)
    if order_only:  # the planner runs such a rank's own block as one call
        ordered = np.array([_in_order(segs) for segs in sharding.ranks])
        calls[0] = np.where(ordered & (pairs[0] > 0), 1, calls[0])
    needed = np.union1d(0, np.flatnonzero(pairs.max(1) > 0))  # the distances some rank reads (``plan.distances_needed``)
    travel = travelling() if len(needed) > 1 else np.zeros((world, world))
    hop, rows = (weighed + weights.call * calls)[needed], travel[needed]
    calls = calls[needed]
    if _joined(sharding, needed, travel):  # the other ranks' rows in one step after the own block
        one_call = _one_call_each(hops_of_q, segs[3], needed[1:]) & (calls[1:] <= 1).all(0)
        remote = calls[1:].sum(0)
        joined_calls = np.where(one_call & (remote > 0), 1, remote)
        hop = np.stack([hop[0], hop[1:].sum(0) - weights.call * (remote - joined_calls)])
        rows, calls = np.stack([rows[0], rows[1:].sum(0)]), np.stack([calls[0], joined_calls])
    steps = len(hop)
    gpu = np.maximum(hop, weights.token * rows).sum(0)
    received, sent = blocks_moved(pairs > 0)
    host = (weights.host_step * steps + weights.host_receive * received + weights.host_send * sent
            + weights.host_call * calls.sum(0))
    critical = float(pairs[needed].sum(0).max())
    total = float(pairs.sum())
    return {
        "sharding": sharding.name, "world_size": world, "seq_len": sharding.seq_len,
        "pairs": [[_number(x) for x in row] for row in pairs.tolist()],
        "critical_pairs": _number(critical), "total_pairs": _number(total),
        "balance": total / world / critical if critical else 1.0,
        "steps": steps, "hops": int((pairs > 0).sum()), "calls": int(calls.sum()),
        "travel_rows": int(travel.max()), "cost": float(np.maximum(gpu, host).max()), "gpu_cost": float(gpu.max()),
        "exact": work.exact,
    }


# Masks that only compare q_idx with kv_idx: causal, and its strict and reversed forms (``plan``).
_ORDER_BANDS = {(0, None), (1, None), (None, 0), (None, -1)}


def _joined(sharding: Sharding, needed: np.ndarray, travel: np.ndarray) -> bool:
    """Whether the ring brings the rows of every other rank read in one step
    (``RingCall.keeps_received``): beyond one other rank, where no rank receives more rows in
    all than its own block holds (``travel``: [step, rank], as they travel)."""
    lengths = np.array([sharding.local_len(r) for r in range(sharding.world_size)])
    return len(needed) > 2 and bool((travel[needed[1:]].sum(0) <= lengths).all())


def blocks_moved(reads: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(blocks of other ranks each rank reads, ranks that read each rank's block), [rank, ...]
    each, from ``reads`` ([step, rank, ...]: whether a rank sees keys of the block of the
    rank ``step`` back)."""
    world = reads.shape[1]
    readers = (np.arange(world)[None, :] + np.arange(world)[:, None]) % world  # [step, owner]: who reads it there
    return reads[1:].sum(0), reads[np.arange(world)[:, None], readers][1:].sum(0)


def _one_call_each(hops_of_q: np.ndarray, seg_rank: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """[rank]: whether a rank's hops against the ranks ``distances`` back share no query
    segment (``hops_of_q``: [segment, rank], each segment's hops against each rank's keys):
    with each block's hops one call, the step that brings those blocks together is one call."""
    world = len(hops_of_q[0])
    remote = sum(hops_of_q[np.arange(len(seg_rank)), (seg_rank - d) % world] for d in distances.tolist())
    return np.bincount(seg_rank, weights=remote > 1, minlength=world) == 0


@functools.lru_cache(maxsize=64)
def held_at(world: int) -> np.ndarray:
    """[step, rank] (read-only): where rank r's pairs at step s lie in a flat [W * W] matrix of
    (queries' rank, keys' rank), against the block of rank (r - s) mod W, which it holds then."""
    ranks = np.arange(world)
    held = ranks[None, :] * world + (ranks[None, :] - ranks[:, None]) % world
    held.flags.writeable = False
    return held


def compares_order_only(mask_mod, device) -> bool:
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
