"""The shardings ``shard_by_mask`` weighs beside the fixed layouts: assignments of equal chunks
of the sequence to ranks, found by a local search on the cost model (``searched``); and, given
document ids, each document cut head-tail over the ranks (``per_document``) and whole documents
packed by their work (``packed_documents``).

Imports no torch.distributed: it is pure planning, the same on every rank.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .cost import Weights, blocks_moved, held_at
from .layout import Sharding
from .runs import BandRuns
from .workload import Workload

Document = Tuple[int, int]  # a document's (begin, end)


def per_document(docs: Sequence[Document], world_size: int) -> Optional[Sharding]:
    """Each document (``docs``: ``document_bounds``) cut in 2 * world_size pieces, rank r
    holding pieces r and 2W-1-r (the head-tail balance of TransformerEngine and torch for
    packed sequences), the pieces' odd tokens spread so every rank holds as many; None where
    they cannot be."""
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
                append_run(runs[piece if piece < world_size else pieces - 1 - piece], at, at + size)
            at += size
    if len(set(extra)) != 1:
        return None
    return Sharding.from_ranges(seq_len, runs, "per-document")


def packed_documents(docs: Sequence[Document], world_size: int, row_pairs: Tensor) -> Sharding:
    """Whole documents (``docs``: ``document_bounds``) packed onto the ranks by their work
    (``row_pairs``: the keys each query row sees), heaviest first, each rank filled to its
    share of the tokens by a document cut in two, whose first part stays on this rank and
    whose rest begins the next: the cut document's rows see its first part one ring step
    later, so a causal document mask keeps the ring at two steps while the ranks' work evens out."""
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
            append_run(merged, begin, end)
        runs[rank] = merged
    return Sharding.from_ranges(seq_len, runs, "packed documents")


def document_bounds(document_ids: Tensor) -> List[Document]:
    """The (begin, end) of every run of equal document ids: what the candidates that cut by
    document read, found once for both."""
    ids = document_ids.detach().cpu()
    bounds = [0] + (np.flatnonzero((ids[1:] != ids[:-1]).numpy()) + 1).tolist() + [len(ids)]
    return list(zip(bounds, bounds[1:]))


def append_run(runs: List[Tuple[int, int]], begin: int, end: int) -> None:
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


def searched(work: Union[BandRuns, Workload], world_size: int, chunks: Optional[int],
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
            append_run(runs[owner[c]], c * size, (c + 1) * size)
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
    many calls per non-empty (rank, step) as the rank has runs of chunks, the whole block
    travelling at each needed step, and a step per distance (no step joins several)."""

    def __init__(self, pairs: np.ndarray, world: int, local_len: int, weights: Weights):
        self.pairs, self.world, self.count = pairs, world, len(pairs)
        self.steps = np.arange(world)
        self.transfer = np.where(self.steps > 0, weights.token * local_len, 0.0)  # step 0 waits for no block
        self.weights = weights
        self.held_at = held_at(world)
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
        received, sent = blocks_moved(active)  # [rank, n]
        host = (w.host_step * needed.sum(0) + w.host_receive * received + w.host_send * sent
                + w.host_call * calls.sum(0))  # [rank, n]: calls only where needed
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
