"""How much work a mask asks of every region of the (query, key) square, counted cheaply.

``workload(mask_mod, seq_len)`` cuts both axes of the square into tiles (128 positions a side
for long sequences). The mask's formula, evaluated on ranges over every pair of tiles at once
(``bounds``: the planner's rules), settles most tiles as FULL or EMPTY. The tiles it leaves
open (a diagonal, a document's edge, a window's edge) are cut into 4 x 4 smaller tiles and
ranged again, down to 8 x 8 tiles, and only those are evaluated pair by pair. What is
visible is then a set of rectangles of pairs: the FULL tiles, the smaller FULL tiles, and the
runs of keys each row of the last tiles sees. From them the pairs between any two sets of
positions (a rank's queries and another rank's keys, a chunk's and another chunk's) follow
exactly, in time about linear in the sequence (``Workload.pairs``), without evaluating the mask
again: one ``Workload`` prices every candidate sharding of a sequence.

Causal, window, document and prefix-LM masks over 32k positions take a few milliseconds of
host time; only the open tiles' edges (some 8 pairs a row per edge) are evaluated.

Pairs are counted per head: summed over batch elements and heads, divided by their number
(one head's count where the mask depends on neither). Where the ranges cannot follow the mask
(a mod that cannot be traced) every tile is evaluated pair by pair; where that is more than
``_MAX_OPEN`` pairs, a fixed sample of each tile's rows stands for the rest and
``Workload.exact`` is False.

Imports no torch.distributed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np
import torch
from torch import Tensor

from ..mod import captured
from ..mod.band import diagonal_band
from ..mod.graph import UnsupportedModError
from ..mod.ranges import Range, mask_bounds
from ..mod.trace import trace_mask_mod
from .blocks import MaskCache

_MAX_OPEN = 1 << 25  # pairs evaluated one by one, at most; beyond, rows are sampled
_EVAL_CHUNK = 1 << 22  # pairs evaluated at once
_MAX_TILES = 2048  # tiles a side: the range grid stays within 4M tile pairs
_LEAF = 8  # open tiles are cut down to this many positions a side, then evaluated pair by pair
_SPLIT = 4  # an open tile is cut into _SPLIT x _SPLIT smaller ones


def tile_size(seq_len: int) -> int:
    """Positions a side of the tiles: 128, fewer for short sequences (at least 16 tiles a
    side), more for very long ones (at most ``_MAX_TILES`` a side)."""
    t = 128
    while t > 1 and seq_len < 16 * t:
        t //= 2
    while -(-seq_len // t) > _MAX_TILES:
        t *= 2
    return t


@dataclass(frozen=True, eq=False)
class Workload:
    """The visible pairs of one mask over a sequence of ``seq_len`` positions (per head).

    ``full`` [T, T]: tile pairs where every query sees every key. ``rects`` [n, 4] int64
    (first query, end query, first key, end key) with ``weights`` [n] float64: the other
    visible pairs, as disjoint rectangles (1 / (batch * heads) for each (b, h) whose mask shows
    one where the mask depends on them; more where rows are sampled)."""

    seq_len: int
    tile: int
    full: Tensor
    rects: Tensor
    weights: Tensor
    exact: bool

    def __post_init__(self):
        q0, q1, k0, k1 = (c.contiguous() for c in self.rects.unbind(1))
        object.__setattr__(self, "_columns", (q0, q1, k0, k1))
        object.__setattr__(self, "_areas", self.weights * ((q1 - q0) * (k1 - k0)).double())
        object.__setattr__(self, "_full", self.full.double())
        object.__setattr__(self, "_tile_of", torch.arange(self.seq_len) // self.tile)

    @property
    def tiles(self) -> int:
        return self.full.shape[0]

    @functools.cached_property
    def tile_pairs(self):
        """Per pair of tiles (numpy [T, T]): the visible pairs, and the first key and the end
        of the keys that any of them sees (``seq_len`` and 0 where none). Every rectangle lies
        within one pair of tiles, so a sharding whose segments begin and end on tile edges is
        priced from these alone (``cost.estimate``)."""
        t, n = self.tile, self.tiles
        begin = np.arange(n) * t
        end = np.minimum(begin + t, self.seq_len)
        full = self.full.numpy()
        pairs = np.where(full, np.outer(end - begin, end - begin), 0).astype(np.float64)
        first = np.where(full, begin[None, :], self.seq_len).astype(np.int64)
        last = np.where(full, end[None, :], 0).astype(np.int64)
        if len(self.weights):
            q0, _, k0, k1 = self._columns
            cell = (q0 // t * n + k0 // t)
            pairs.reshape(-1)[:] += torch.bincount(cell, self._areas, minlength=n * n).numpy()
            first.reshape(-1)[:] = torch.from_numpy(first.reshape(-1)).scatter_reduce(0, cell, k0, "amin").numpy()
            last.reshape(-1)[:] = torch.from_numpy(last.reshape(-1)).scatter_reduce(0, cell, k1, "amax").numpy()
        return pairs, first, last

    def row_pairs(self) -> Tensor:
        """[seq_len] float64: the keys each query row sees (per head)."""
        t = self.tile
        sizes = (torch.arange(self.tiles) * t + t).clamp(max=self.seq_len) - torch.arange(self.tiles) * t
        rows = (self._full @ sizes.double())[self._tile_of]
        if len(self.weights):
            q0, q1, k0, k1 = self._columns
            step = torch.zeros(self.seq_len + 1, dtype=torch.float64)
            width = self.weights * (k1 - k0).double()
            step.index_add_(0, q0, width)
            step.index_add_(0, q1, -width)
            rows = rows + step.cumsum(0)[:-1]
        return rows

    def total(self) -> float:
        """All visible pairs (per head)."""
        return float(self.pairs(torch.zeros(self.seq_len, dtype=torch.long), 1).sum())

    def pairs(self, labels: Tensor, groups: int) -> Tensor:
        """[groups, groups] float64: the visible pairs of queries labelled g with keys labelled
        g' (``labels``: an int64 label in [0, groups) for every position)."""
        return self.usage(labels, groups, reads=False)[0]

    def usage(self, labels: Tensor, groups: int, reads: bool = True, owner_of: Optional[Tensor] = None):
        """``pairs``, and with ``reads`` an [owners, seq_len] bool: whether a query of each owner
        sees the key at each position that another owner holds, a label's owner being
        ``owner_of[label]`` (default: the label itself). Exact but for two bounds, both wide of
        the mark: a FULL tile of keys counts as seen by every owner of queries whose tiles see
        it, and a rectangle over many runs of labels (a strided labelling) marks all of its
        keys for every owner."""
        labels = labels.to("cpu", torch.long)
        counts = torch.bincount(self._tile_of * groups + labels, minlength=self.tiles * groups).view(
            self.tiles, groups).double()
        out = counts.t() @ self._full @ counts
        seen = None
        owner_of = torch.arange(groups) if owner_of is None else torch.as_tensor(owner_of, dtype=torch.long)
        if reads:
            owners = int(owner_of.max()) + 1
            readers = torch.zeros(owners, self.tiles, dtype=torch.float64).index_add_(
                0, owner_of, counts.t() @ self._full) > 0  # [owners, T]: whose queries see a key of tile j
            others = owner_of[labels] != torch.arange(owners).unsqueeze(1)  # [owners, seq_len]: keys another holds
            seen = readers[:, self._tile_of] & others
        if not len(self.weights):
            return out, seen
        q0, q1, k0, k1 = self._columns
        change = torch.cat([torch.tensor([True]), labels[1:] != labels[:-1]])
        run_of = change.cumsum(0) - 1  # the run of equal labels each position lies in
        run_start = change.nonzero().squeeze(1)
        run_end = torch.cat([run_start[1:], torch.tensor([self.seq_len])])
        q_runs, k_runs = run_of[q1 - 1] - run_of[q0] + 1, run_of[k1 - 1] - run_of[k0] + 1
        simple = (q_runs == 1) & (k_runs == 1)  # rows of one label, keys of one label
        lq, lk = labels[q0], labels[k0]
        out.view(-1).index_add_(0, (lq * groups + lk)[simple], self._areas[simple])
        rest = (~simple).nonzero().squeeze(1)
        pieces = int((q_runs[rest] * k_runs[rest]).sum()) if len(rest) else 0
        marked = [(k0[simple], k1[simple], owner_of[lq[simple]])]  # keys, and the owner of queries that see them
        if pieces and pieces <= 4 * len(rest) * groups:  # a few runs each: cut them along the runs
            rect, q_a, q_b, _ = _cut(rest, q0, q1, q_runs, run_of, run_start, run_end, ())
            rect, k_a, k_b, (q_a, q_b) = _cut(rect, k0, k1, k_runs, run_of, run_start, run_end, (q_a, q_b))
            counts = self.weights[rect] * ((q_b - q_a) * (k_b - k_a)).double()
            lq, lk = labels[q_a], labels[k_a]
            out.view(-1).index_add_(0, lq * groups + lk, counts)
            marked.append((k_a, k_b, owner_of[lq]))
        elif pieces:  # many runs (a strided labelling): histograms of their labels
            cum = _cumulative(labels, groups)
            rows = (cum[q1[rest]] - cum[q0[rest]]).double() * self.weights[rest].unsqueeze(1)
            out += rows.t() @ (cum[k1[rest]] - cum[k0[rest]]).double()
            for reader in range(len(seen) if reads else 0):  # all of their keys, for every owner
                marked.append((k0[rest], k1[rest], torch.full((len(rest),), reader)))
        if reads:
            begin, end, reader = (torch.cat(parts) for parts in zip(*marked))
            width = self.seq_len + 1
            edges = torch.zeros(len(seen) * width, dtype=torch.long)
            edges.index_add_(0, reader * width + begin, torch.ones(1, dtype=torch.long).expand(len(begin)))
            edges.index_add_(0, reader * width + end, -torch.ones(1, dtype=torch.long).expand(len(begin)))
            seen |= (edges.view(-1, width).cumsum(1)[:, :-1] > 0) & others
        return out, seen


def _cut(rect: Tensor, lo: Tensor, hi: Tensor, runs: Tensor, run_of: Tensor, run_start: Tensor, run_end: Tensor,
         carried: tuple):
    """Rectangles ``rect`` cut where their range ``lo[rect]:hi[rect]`` crosses from one run of
    labels to the next: (the rectangle of each piece, its begin, its end, ``carried``: tensors
    of one value per rectangle, repeated for each of its pieces)."""
    n = runs[rect]
    piece_of = torch.repeat_interleave(torch.arange(len(rect)), n)
    first = torch.cumsum(n, 0) - n
    run = run_of[lo[rect]][piece_of] + torch.arange(len(piece_of)) - first[piece_of]
    begin = torch.maximum(run_start[run], lo[rect][piece_of])
    end = torch.minimum(run_end[run], hi[rect][piece_of])
    return rect[piece_of], begin, end, tuple(c[piece_of] for c in carried)


def _cumulative(labels: Tensor, groups: int) -> Tensor:
    """[n + 1, groups]: how many positions before each one carry each label."""
    return torch.nn.functional.pad(torch.nn.functional.one_hot(labels, groups).cumsum(0, dtype=torch.int32), (0, 0, 1, 0))


_WORKLOADS = MaskCache(16)


def workload(mask_mod: Optional[Callable], seq_len: int, *, batch: int = 1, heads: int = 1,
             device=None, tile: Optional[int] = None) -> Workload:
    """The ``Workload`` of ``mask_mod`` (None: every pair visible) over ``seq_len`` positions,
    evaluated on ``device`` (where the tensors it captured live); kept while the mod and
    those tensors are the very same objects, unmodified."""
    t = tile or tile_size(seq_len)
    if device is None:  # where the tensors it captured live (document ids on a GPU)
        device = captured.device_of(mask_mod)
    key = ("workload", seq_len, batch, heads, t, str(device))
    return _WORKLOADS.lookup(mask_mod, key, lambda: _workload(mask_mod, seq_len, batch, heads, device, t))


def _workload(mask_mod, seq_len: int, batch: int, heads: int, device, t: int) -> Workload:
    n_tiles = -(-seq_len // t)
    if mask_mod is None:
        return Workload(seq_len, t, torch.ones(n_tiles, n_tiles, dtype=torch.bool),
                        torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, dtype=torch.float64), True)
    try:
        graph = trace_mask_mod(mask_mod, device)
    except UnsupportedModError:
        graph = None
    band = diagonal_band(graph) if graph is not None else None
    if band is not None:
        return _band_workload(seq_len, t, *band)
    starts = torch.arange(n_tiles) * t
    kinds = None if graph is None else _kinds(graph, batch, heads, seq_len, starts.view(-1, 1), starts.view(1, -1), t)
    if kinds is None:  # the ranges cannot follow the mask: every tile pair pair by pair
        full = torch.zeros(n_tiles, n_tiles, dtype=torch.bool)
        i, j = torch.ones(n_tiles, n_tiles, dtype=torch.bool).nonzero(as_tuple=True)
        rects, weights, exact = _evaluated(mask_mod, seq_len, batch, heads, starts[i], starts[j], t, device)
        return Workload(seq_len, t, full, rects, weights, exact)
    full, open_ = kinds
    i, j = open_.nonzero(as_tuple=True)
    q_lo, k_lo, size = starts[i], starts[j], t
    per_bh = bool(graph.deps & {"b", "h"})
    found: List[Tensor] = []
    while size > _LEAF and len(q_lo):
        sub = max(_LEAF, size // _SPLIT)
        offsets = torch.arange(0, size, sub)
        q_sub = (q_lo.view(-1, 1) + offsets).view(-1, len(offsets), 1)
        k_sub = (k_lo.view(-1, 1) + offsets).view(-1, 1, len(offsets))
        kinds = _kinds(graph, batch, heads, seq_len, q_sub, k_sub, sub)
        if kinds is None:
            break
        sub_full, sub_open = kinds
        n, a, b = sub_full.nonzero(as_tuple=True)
        found.append(_rect(q_sub[n, a, 0], k_sub[n, 0, b], sub, seq_len))
        n, a, b = sub_open.nonzero(as_tuple=True)
        q_lo, k_lo, size = q_sub[n, a, 0], k_sub[n, 0, b], sub
    rects, weights, exact = _evaluated(mask_mod, seq_len, batch if per_bh else 1, heads if per_bh else 1,
                                       q_lo, k_lo, size, device)
    fine = torch.cat(found) if found else torch.zeros(0, 4, dtype=torch.long)
    weights = torch.cat([torch.ones(len(fine), dtype=torch.float64), weights])
    rects, weights = _merged(torch.cat([fine, rects]), weights, seq_len, t)
    return Workload(seq_len, t, full, rects, weights, exact)


def _band_workload(seq_len: int, t: int, lo: Optional[int], hi: Optional[int]) -> Workload:
    """The workload of a mask that is exactly ``lo <= q_idx - kv_idx <= hi`` (causal, sliding
    windows: ``trace.diagonal_band``), from its formula: no evaluation, and the same
    rectangles as evaluating it."""
    lo = -seq_len if lo is None else lo
    hi = seq_len if hi is None else hi
    n = -(-seq_len // t)
    begin = torch.arange(n) * t
    end = (begin + t).clamp(max=seq_len)
    d_min = begin.view(-1, 1) - (end - 1).view(1, -1)  # q - kv over each tile pair
    d_max = (end - 1).view(-1, 1) - begin.view(1, -1)
    full = (d_min >= lo) & (d_max <= hi)
    i, j = ((d_max >= lo) & (d_min <= hi) & ~full).nonzero(as_tuple=True)
    q = (begin[i].view(-1, 1) + torch.arange(t)).view(-1)
    k0, k1 = begin[j].repeat_interleave(t), end[j].repeat_interleave(t)
    a, b = torch.maximum(k0, q - hi), torch.minimum(k1, q - lo + 1)
    keep = (q < seq_len) & (b > a)
    rects = torch.stack([q, q + 1, a, b], 1)[keep]
    return Workload(seq_len, t, full, rects, torch.ones(len(rects), dtype=torch.float64), True)


def _merged(rects: Tensor, weights: Tensor, seq_len: int, tile: int):
    """The same pairs in fewer rectangles, none across a tile's edge: neighbours of equal
    weight that share their rows and touch along the keys become one, then those that share
    their keys and touch along the rows (a document's first keys, seen alike by its rows)."""
    for rows, cols in (((0, 1), (2, 3)), ((2, 3), (0, 1))):
        if len(rects) < 2:
            break
        r0, r1, c0 = rects[:, rows[0]], rects[:, rows[1]], rects[:, cols[0]]
        order = torch.from_numpy(np.argsort((((r0 * (tile + 1) + (r1 - r0)) * seq_len) + c0).numpy(), kind="stable"))
        r, w = rects[order], weights[order]
        joins = ((r[1:, rows[0]] == r[:-1, rows[0]]) & (r[1:, rows[1]] == r[:-1, rows[1]])
                 & (r[1:, cols[0]] == r[:-1, cols[1]]) & (w[1:] == w[:-1])
                 & (r[1:, cols[0]] // tile == r[:-1, cols[0]] // tile))
        starts = torch.cat([torch.tensor([True]), ~joins]).nonzero().squeeze(1)  # first of each joined run
        ends = torch.cat([starts[1:], torch.tensor([len(r)])]) - 1
        merged = r[starts].clone()
        merged[:, cols[1]] = r[ends, cols[1]]
        rects, weights = merged, w[starts]
    return rects, weights


def _rect(q_lo: Tensor, k_lo: Tensor, size: int, seq_len: int) -> Tensor:
    return torch.stack([q_lo, (q_lo + size).clamp(max=seq_len), k_lo, (k_lo + size).clamp(max=seq_len)], 1)


def _kinds(graph, batch: int, heads: int, seq_len: int, q_lo: Tensor, k_lo: Tensor, size: int):
    """(full, open): bools of the broadcast shape of ``q_lo`` and ``k_lo`` (first positions of
    tiles of ``size``): whether the mask holds for every pair of a tile pair (every batch
    element and head), and whether it is left open; None where the ranges cannot decide an op.
    Tiles that begin past the sequence are neither."""
    q_hi, k_hi = (q_lo + size).clamp(max=seq_len) - 1, (k_lo + size).clamp(max=seq_len) - 1
    env = {"b": Range(0, batch - 1), "h": Range(0, heads - 1), "q_idx": Range(q_lo, q_hi), "kv_idx": Range(k_lo, k_hi)}
    tables = {id(node): node.value.detach().cpu() for node in graph.nodes if node.op == "tensor"}
    bounds = mask_bounds(graph, env, tables)
    if bounds is None:
        return None
    shape = torch.broadcast_shapes(q_lo.shape, k_lo.shape)
    inside = (q_lo < seq_len) & (k_lo < seq_len)
    every, some = (torch.as_tensor(x).cpu().expand(shape) for x in bounds)
    return every & inside, some & ~every & inside


def _evaluated(mask_mod, seq_len: int, batch: int, heads: int, q_lo: Tensor, k_lo: Tensor, size: int, device):
    """The runs of keys that the rows of the tiles of ``size`` at ``q_lo``, ``k_lo`` see, as
    rectangles one row high, with their weights, and whether they are exact."""
    rows = torch.arange(size)
    exact = True
    pairs = len(q_lo) * size * size * batch * heads
    if pairs > _MAX_OPEN:  # a fixed sample of each tile's rows stands for all of them
        keep = max(1, size * _MAX_OPEN // pairs)
        rows = torch.randperm(size, generator=torch.Generator().manual_seed(0))[:keep].sort().values
        exact = False
    per_chunk = max(1, _EVAL_CHUNK // (len(rows) * size * batch * heads))
    found = []
    for begin in range(0, len(q_lo), per_chunk):
        q = (q_lo[begin:begin + per_chunk].view(-1, 1) + rows).view(-1)  # [m * rows]
        k0 = k_lo[begin:begin + per_chunk].repeat_interleave(len(rows))
        kv = k0.view(-1, 1) + torch.arange(size)  # [m * rows, size]
        inside = (q < seq_len).view(-1, 1) & (kv < seq_len)
        seen = _evaluate(mask_mod, batch, heads, q.clamp(max=seq_len - 1), kv.clamp(max=seq_len - 1), device)
        copies = seen.shape[0] * seen.shape[1]  # the (b, h) the mask depends on
        seen = (seen.cpu() & inside).reshape(-1, size)  # [(b, h, row), key]
        q_run, a, b = _runs(seen, q.repeat(copies), k0.repeat(copies))
        weight = torch.full((len(q_run),), size / len(rows) / copies, dtype=torch.float64)
        found.append((torch.stack([q_run, q_run + 1, a, b], 1), weight))
    if not found:
        return torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, dtype=torch.float64), exact
    rects, weights = (torch.cat(parts) for parts in zip(*found))
    return rects, weights, exact


def _evaluate(mask_mod, batch: int, heads: int, q: Tensor, kv: Tensor, device) -> Tensor:
    """The mask at query ``q[i]`` against keys ``kv[i, :]``: [batch', heads', rows, keys] bool
    (batch' or heads' 1 where it depends on neither)."""
    # int64, not flex_attention's int32: lookups index with int64 anyway (half the time)
    q, kv = q.to(device=device), kv.to(device=device)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    allowed = torch.as_tensor(mask_mod(b, h, q.view(1, 1, -1, 1), kv.view(1, 1, *kv.shape)), device=device)
    if allowed.dtype != torch.bool:
        allowed = allowed != 0
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    return allowed.expand(allowed.shape[0], allowed.shape[1], *kv.shape)


def _runs(seen: Tensor, q: Tensor, key0: Tensor):
    """The runs of True in each row of ``seen`` [rows, size]: (query ``q[row]``, first key,
    end key), keys counted from ``key0[row]``."""
    padded = torch.nn.functional.pad(seen.contiguous().view(torch.uint8), (1, 1)).to(torch.int8)
    step = padded[:, 1:] - padded[:, :-1]
    r0, k0 = (step == 1).nonzero(as_tuple=True)
    _, k1 = (step == -1).nonzero(as_tuple=True)  # row-major: the n-th end closes the n-th start
    return q[r0], key0[r0] + k0, key0[r0] + k1
