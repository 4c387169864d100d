"""The pairs of a band of runs, counted in closed form: masks that are exactly

    ids[q_idx] == ids[kv_idx]  and  lo <= q_idx - kv_idx <= hi

for captured id tensors whose every value fills one run of positions (packed documents,
causal or not within them, with or without a window; causal and sliding windows are the
case of one run). Each query row then sees one interval of keys, so the pairs between two
segments of positions of one stride, and the keys of one segment that another's rows see,
follow from a few integer formulas per pair of pieces (a segment's positions within one
run), in time about the number of such pieces squared, nothing evaluated and nothing tiled.
That is what prices a new packed batch in well under the time of its attention step.

``band_runs`` recognises such a mask from its trace; it answers None for any other mask, and
``usage`` None for segments of unequal strides within a run, where the tiled count
(``workload``) takes over: both are exact, so they give every sharding the same pairs.

Imports no torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..mod.band import band_and_rest
from ..mod.graph import Node, UnsupportedModError
from ..mod.trace import trace_mask_mod
from .workload import tile_size


@dataclass(frozen=True, eq=False)
class BandRuns:
    """The mask ``same run and lo <= q_idx - kv_idx <= hi`` over ``seq_len`` positions:
    ``bounds`` [runs + 1] int64, the runs' first positions and ``seq_len``. ``tile`` is the
    tiled count's (``workload.tile_size``): the chunk search cuts chunks on it either way."""

    seq_len: int
    bounds: np.ndarray
    lo: int
    hi: int

    exact = True

    @property
    def tile(self) -> int:
        return tile_size(self.seq_len)

    def row_pairs(self) -> Tensor:
        """[seq_len] float64: the keys each query row sees."""
        q, size = np.arange(self.seq_len), np.diff(self.bounds)
        first = np.maximum(np.repeat(self.bounds[:-1], size), q - self.hi)
        end = np.minimum(np.repeat(self.bounds[1:], size), q - (self.lo - 1))  # one past the last key
        return torch.from_numpy(np.maximum(end - first, 0, dtype=np.float64))

    def usage(self, start: np.ndarray, stride: np.ndarray, length: np.ndarray, owner: Optional[np.ndarray] = None,
              local: Optional[np.ndarray] = None):
        """For segments ``start + stride * i`` (i < ``length``), each held by rank ``owner`` from
        its local row ``local`` on: (pairs [S, S] float64 of segment i's queries against
        segment j's keys; with ``owner``, the keys that another rank's queries see, as the
        rank reading them, the rank holding them and the first and last local row of each
        run of them); None where two segments of unequal strides meet in a run."""
        piece = self._pieces(start, stride, length)
        q, k = _same_run_pairs(piece["run"])
        n, m = piece["count"][q], piece["count"][k]
        if ((n > 1) & (m > 1) & (piece["stride"][q] != piece["stride"][k])).any():
            return None
        s = np.where(n > 1, piece["stride"][q], piece["stride"][k])  # a lone position takes either stride
        delta = piece["first"][q] - piece["first"][k]
        t_lo, t_hi = -((delta - self.lo) // s), (self.hi - delta) // s  # the band on i - j, their indices
        # pairs with i - j >= t_lo less those with i - j > t_hi, each the sum over i of clamp(i - t + 1,
        # 0, m), ramp(n - t) - ramp(-t): the four ramps in one call (numpy's calls, not sizes, cost here)
        ramp = _ramp(np.array([n - t_lo, -t_lo, n - t_hi - 1, -t_hi - 1]), m)
        count = np.maximum(ramp[0] - ramp[1] - ramp[2] + ramp[3], 0)
        segments = len(start)
        seg_q, seg_k = piece["segment"][q], piece["segment"][k]
        pairs = np.bincount(seg_q * segments + seg_k, weights=count.astype(np.float64),
                            minlength=segments * segments).reshape(segments, segments)
        if owner is None:
            return pairs, None
        read = (count > 0) & (owner[seg_q] != owner[seg_k])  # keys j with some i: t_lo <= i - j <= t_hi
        row = local[seg_k] + piece["offset"][k]
        first, last = row + np.maximum(0, -t_hi), row + np.minimum(m - 1, n - 1 - t_lo)
        return pairs, (owner[seg_q][read], owner[seg_k][read], first[read], last[read])

    def _pieces(self, start: np.ndarray, stride: np.ndarray, length: np.ndarray):
        """Each segment's positions within each run it meets: its segment, run, first position,
        count, stride and first index in the segment."""
        last = start + stride * (length - 1)
        r0 = np.searchsorted(self.bounds, start, "right") - 1
        r1 = np.searchsorted(self.bounds, last, "right") - 1
        runs = r1 - r0 + 1
        segment = np.repeat(np.arange(len(start)), runs)
        run = r0[segment] + np.arange(len(segment)) - np.repeat(np.cumsum(runs) - runs, runs)
        a, s = start[segment], stride[segment]
        i0 = np.maximum(0, -((a - self.bounds[run]) // s))  # the first index at or past the run's start
        i1 = np.minimum(length[segment], -((a - self.bounds[run + 1]) // s))
        keep = i1 > i0
        return {"segment": segment[keep], "run": run[keep], "first": (a + s * i0)[keep], "count": (i1 - i0)[keep],
                "stride": s[keep], "offset": i0[keep]}


def _same_run_pairs(run: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Every (query piece, key piece) of one run: the only pairs a run mask shows."""
    order = np.argsort(run, kind="stable")
    ordered = run[order]
    begin = np.searchsorted(ordered, ordered, "left")  # where each one's run begins, in run order
    size = np.searchsorted(ordered, ordered, "right") - begin
    within = np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
    return order[np.repeat(np.arange(len(order)), size)], order[np.repeat(begin, size) + within]


def _ramp(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The sum of min(u, m) over u = 1 .. x (0 where x <= 0)."""
    x = np.maximum(x, 0)
    y = np.minimum(x, m)
    return y * (y + 1) // 2 + (x - y) * m


# ---------------------------------------------------------------------- recognising the mask

def band_runs(mask_mod: Optional[Callable], seq_len: int, device=None) -> Optional[BandRuns]:
    """The ``BandRuns`` that ``mask_mod`` is over ``seq_len`` positions, or None where it is
    none (another mask, ids whose values come back after another, no mask at all)."""
    if mask_mod is None:
        return None
    try:
        split = band_and_rest(trace_mask_mod(mask_mod, device))
    except UnsupportedModError:
        return None
    if split is None:
        return None
    lo, hi, rest = split
    tables = [_id_table(n) for n in rest]
    if any(t is None or len(t) < seq_len for t in tables):
        return None
    bounds = _run_bounds([t[:seq_len].detach().cpu().numpy() for t in tables], seq_len)
    if bounds is None:
        return None
    return BandRuns(seq_len, bounds, -seq_len if lo is None else lo, seq_len if hi is None else hi)


def _id_table(n: Node) -> Optional[Tensor]:
    """The id tensor of a conjunct ``ids[q_idx] == ids[kv_idx]`` (integer ids, one tensor
    read at both positions), else None."""
    if n.op != "eq" or len(n.args) != 2:
        return None
    sides = [_lookup_at(a) for a in n.args]
    if None in sides or {pos for _, pos in sides} != {"q_idx", "kv_idx"}:
        return None
    (a, _), (b, _) = sides
    if a.dim() != 1 or a.dtype.is_floating_point or a.dtype.is_complex:
        return None
    return a if a is b or (a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))) else None


def _lookup_at(n: Node):
    """(tensor, position name) of ``tensor[q_idx]`` or ``tensor[kv_idx]`` (positions cast
    between integer types allowed), else None."""
    if n.op != "index" or len(n.args) != 2 or n.args[0].op != "tensor":
        return None
    pos = n.args[1]
    while pos.op == "cast" and pos.dtype in (torch.int32, torch.int64):
        pos = pos.args[0]
    return (n.args[0].value, pos.op) if pos.op in ("q_idx", "kv_idx") else None


def _run_bounds(tables: List[np.ndarray], seq_len: int) -> Optional[np.ndarray]:
    """The first position of every run of positions equal in all ``tables``, and ``seq_len``;
    None where a table's value comes back after another (equal ids would then join
    positions of two runs)."""
    bounds = np.zeros(1, dtype=np.int64)
    for t in tables:
        mine = np.append(0, np.flatnonzero(t[1:] != t[:-1]) + 1)  # where each run of t begins
        if len(np.unique(t[mine])) != len(mine):
            return None
        bounds = np.union1d(bounds, mine)
    return np.append(bounds, seq_len)
