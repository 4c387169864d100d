"""Lending: query rows a rank hands to the previous rank, which owns the keys they read.

Every layout gives the ranks as many tokens, but a mask can give them unequal work, and the
slowest rank sets the pace. A sliding window over the contiguous layout is the plainest case:
rank r > 0 computes its own block and the corner of rank r-1's block that its first queries
see, rank 0 its own block alone (on 2 ranks at most 7/8 of the ideal speed-up); a document
that straddles two ranks does the same on a smaller scale. Keys travel the ring, so work can
move only to where keys are: a rank lends the first rows of its step-1 hops (those against
rank r-1's block) to rank r-1, which computes them against its own block and sends back
their output and LSE, merged like any hop's. Backward sends the rows' output, dO and LSE the
same way and gets their dQ back; their dK/dV stay with the owner of the keys and join its own
block's gradient.

How much: each rank counts the (query, key) pairs its plan sees (``pairs``), and each kernel
call as the pairs it takes as long as (``HopKernel.call_pairs``), and shares the total in the
argument check, so every rank derives the same loans (``amounts``): each rank lends what
evens the rank before it, no more than its step-1 work, and none lends at all unless the
busiest rank's work falls by ``MIN_GAIN``. Both ends of a loan cut the same rows (``cut``)
from the same plan of the lender's step-1 hops: each rank plans the other ranks' hops
against its own block anyway (``api``), and they share its digest to make sure.

When: lending adds host work (two transfers and a kernel call in forward and again in
backward), which kernels shorter than that work cannot hide where the host issues ring calls
back to back. So by default
(``RINGFLEX_LENDING=auto``) no rank lends unless the busiest rank's load is ``MIN_CALLS``
kernel calls' worth or more (each rank's ``min_load``; the largest holds).
``RINGFLEX_LENDING=1`` lends at any load (calls replayed from a CUDA graph have no host
work to hide), ``0`` never; ``0`` on any rank turns lending off for the call.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import config
from ..cache import remember
from ..mod.fingerprint import digest
from ..mod.graph import UnsupportedModError
from ..mod.trace import trace_mask_mod
from .blocks import BlockKind, Hop, MaskCache, around, within
from .extents import row_extents

Rows = Tuple[int, int]
QUANTUM = 64  # lent rows end on a multiple of it (or at the last row): few shapes for the kernels
MIN_GAIN = 0.03  # lending must shorten the busiest rank's work by this share, or none runs
# RINGFLEX_LENDING=auto: the busiest rank's load must be this many kernel calls' worth
# (``HopKernel.call_pairs``) for its kernels to outlast the host work lending adds; between
# the loads at which lending made a call slower and those at which it made it faster.
MIN_CALLS = 40
NO_OFFER = [-1, 0, 0, 0, 0]  # what a rank shares where lending is off: load, step-1 pairs, 2 digests, min_load


_OFFERS = MaskCache(64)


def offer(mask_mod, schedule: Sequence[Sequence[Hop]], next_hops: Sequence[Hop], kernel: str, call: int,
          device) -> Optional["Offer"]:
    """This rank's ``Offer`` for a plan (``schedule``, and ``next_hops``: the next rank's hops
    against this rank's block) made by ``kernel``, whose calls cost ``call`` pairs each beyond
    their pairs (``HopKernel.call_pairs``); made once per plan, None where lending is off."""
    chosen = config.LENDING.value()
    if chosen == "0":
        return None
    min_load = MIN_CALLS * call if chosen == "auto" else 0
    key = (tuple(map(tuple, schedule)), tuple(next_hops), kernel, call, min_load, str(device))
    return _OFFERS.lookup(mask_mod, key, lambda: Offer.of(mask_mod, schedule, next_hops, call, device, min_load))


def pairs(mask_mod, hop: Hop, device) -> Optional[Tensor]:
    """Per query row of ``hop``, how many keys it sees (int64, on the host): the row's work.
    None where the mask cannot be counted per row (it depends on the batch or head, or the
    block is too large to evaluate)."""
    if hop.kind == BlockKind.FULL:
        return torch.full((hop.q_rows[1] - hop.q_rows[0],), hop.kv_rows[1] - hop.kv_rows[0], dtype=torch.int64)
    try:
        mask = trace_mask_mod(mask_mod, device)
    except UnsupportedModError:
        return None
    extents = row_extents(mask_mod, mask, hop.q_seg, hop.kv_seg, device)
    return None if extents is None else extents[3].long()


@dataclass(frozen=True)
class StepOne:
    """One rank's hops against the previous rank's block, and each hop's pairs per row."""

    hops: Tuple[Hop, ...]
    counts: Optional[Tuple[Tensor, ...]]  # None: some hop's pairs are unknown

    @staticmethod
    def of(mask_mod, hops: Sequence[Hop], device) -> "StepOne":
        counts = [pairs(mask_mod, hop, device) for hop in hops]
        return StepOne(tuple(hops), None if any(c is None for c in counts) else tuple(counts))

    @property
    def rows(self) -> Rows:
        """The rows of the hops, as one range."""
        return around(h.q_rows for h in self.hops)

    @property
    def total(self) -> int:
        return -1 if self.counts is None else sum(int(c.sum()) for c in self.counts)

    @functools.cached_property
    def digest(self) -> int:
        """Of the hops, and whether their pairs are known: both ends of a loan must see the same."""
        return digest(repr((self.hops, self.counts is not None)).encode())

    def cut(self, amount: int) -> Rows:
        """The rows ``[a, m)`` whose hops' pairs come closest to ``amount``: ``a`` the first row
        of the hops, ``m`` a multiple of ``QUANTUM`` or their last row (``a == m``: none)."""
        a, end = self.rows
        profile = torch.zeros(end - a, dtype=torch.int64)
        for hop, count in zip(self.hops, self.counts):
            profile[hop.q_rows[0] - a:hop.q_rows[1] - a] += count
        lent = torch.cat([profile.new_zeros(1), profile.cumsum(0)])  # pairs of rows [a, a + i)
        ends = sorted({a, end, *range(-(-a // QUANTUM) * QUANTUM, end, QUANTUM)})
        m = min(ends, key=lambda e: (abs(int(lent[e - a]) - amount), e))
        return a, m

    def split(self, rows: Rows, planned_part: Optional[Callable]) -> Tuple[Tuple[Hop, ...], Tuple[Hop, ...]]:
        """(the parts of the hops in ``rows``, the parts outside), each part's keys cut to
        what the kernel reaches of it (``planned_part``, see ``plan.plan_hops``); parts that
        see no key are dropped."""
        inside, outside = [], []
        for hop, count in zip(self.hops, self.counts):
            q0, q1 = hop.q_rows
            for lo, hi, into in ((max(q0, rows[0]), min(q1, rows[1]), inside), (max(q0, rows[1]), q1, outside)):
                if hi > lo and int(count[lo - q0:hi - q0].sum()):
                    into.append(_part(hop, lo, hi, planned_part))
        return tuple(inside), tuple(outside)


def _part(hop: Hop, lo: int, hi: int, planned_part: Optional[Callable]) -> Hop:
    """Query rows ``[lo, hi)`` of ``hop``, its keys cut to what the kernel reaches of them."""
    if (lo, hi) == hop.q_rows:
        return hop
    q0 = hop.q_rows[0]
    q_seg = None if hop.q_seg is None else hop.q_seg.slice(lo - q0, hi - q0)
    part = Hop((lo, hi), hop.kv_rows, q_seg, hop.kv_seg, hop.kind)
    extent = planned_part(q_seg, hop.kv_seg) if planned_part is not None and hop.kind == BlockKind.PARTIAL else None
    return part if extent is None else within(part, extent)


@dataclass(frozen=True)
class Loan:
    """The lending of one call, as this rank takes part in it (every rank holds one where any
    rank lends, so all make the same transfers; empty rows where it neither lends nor borrows)."""

    lent: Rows  # this rank's rows computed by the previous rank
    kept: Tuple[Hop, ...]  # this rank's step-1 hops left to it
    borrowed: Rows  # the next rank's rows computed here (its local rows)
    borrowed_hops: Tuple[Hop, ...]  # their hops, against this rank's own block


@dataclass(frozen=True)
class Offer:
    """A rank's side of lending, planned before the ranks agree: its whole load, its own
    step-1 hops, and the next rank's step-1 hops (against this rank's block) as planned here."""

    load: int  # pairs over every step and ``call`` for each hop, -1: unknown
    own: StepOne
    next: StepOne
    call: int = 0  # what a kernel call costs beyond its pairs, in pairs
    min_load: int = 0  # the least busiest load at which this rank lends (``RINGFLEX_LENDING``)
    loans: OrderedDict = field(default_factory=OrderedDict, compare=False)  # made by ``agree``, by what it was given

    @staticmethod
    def of(mask_mod, schedule: Sequence[Sequence[Hop]], next_hops: Sequence[Hop], call: int, device,
           min_load: int = 0) -> "Offer":
        steps = [StepOne.of(mask_mod, hops, device) for hops in schedule]
        load = -1 if any(step.counts is None for step in steps) else sum(step.total + call * len(step.hops)
                                                                             for step in steps)
        return Offer(load, steps[1] if len(steps) > 1 else StepOne((), ()), StepOne.of(mask_mod, next_hops, device),
                     call, min_load)

    @functools.cached_property
    def shares(self) -> List[int]:
        """What every rank learns of this offer in the argument check (``NO_OFFER`` where none)."""
        return [self.load, max(self.own.total, 0), self.own.digest, self.next.digest, self.min_load]

    def agree(self, shared: Sequence[Sequence[int]], rank: int, planned_part: Optional[Callable]) -> Optional[Loan]:
        """This rank's ``Loan`` from every rank's ``shares`` (``NO_OFFER`` where lending is
        off), or None where no rank lends. ``planned_part``: the kernel's, from
        ``plan.part_planner``."""
        key = (tuple(map(tuple, shared)), rank)
        if key not in self.loans:
            remember(self.loans, key, self._loan(shared, rank, planned_part), 8)
        return self.loans[key]

    def _loan(self, shared: Sequence[Sequence[int]], rank: int, planned_part: Optional[Callable]) -> Optional[Loan]:
        world = len(shared)
        loads = [s[0] for s in shared]
        # rank r lends to r - 1 only where both planned r's step-1 hops alike
        lendable = [0] + [shared[r][1] if shared[r][2] == shared[r - 1][3] else 0 for r in range(1, world)]
        lend = amounts(loads, lendable, self.call, max(s[4] for s in shared))
        if not any(lend):
            return None
        lent, kept = (0, 0), self.own.hops
        if lend[rank]:
            lent = self.own.cut(lend[rank])
            _, kept = self.own.split(lent, planned_part)
        borrowed, borrowed_hops = (0, 0), ()
        if rank + 1 < world and lend[rank + 1]:
            borrowed = self.next.cut(lend[rank + 1])
            borrowed_hops, _ = self.next.split(borrowed, planned_part)
        return Loan(lent, kept, borrowed, borrowed_hops)


def amounts(loads: Sequence[int], lendable: Sequence[int], call: int = 0, min_load: int = 0) -> List[int]:
    """The pairs rank r lends to rank r - 1, for every r: what evens rank r - 1 with the mean
    load (given what r - 1 lent on, and the ``call`` its borrowed rows add), at most
    ``lendable[r]``; all 0 where a load is unknown, the busiest is below ``min_load``, or
    lending would not shorten the busiest rank's work by ``MIN_GAIN``."""
    world = len(loads)
    if world < 2 or min(loads) < 0 or max(loads) < min_load:
        return [0] * world
    mean = (sum(loads) + call * (world - 1)) / world  # as if every rank but the last borrowed
    lend = [0] * world
    for r in range(1, world):
        lend[r] = int(min(max(mean - loads[r - 1] + lend[r - 1] - call, 0), lendable[r]))
    after = [loads[r] - lend[r] + (lend[r + 1] + call if r + 1 < world and lend[r + 1] else 0) for r in range(world)]
    return lend if max(after) <= (1 - MIN_GAIN) * max(loads) else [0] * world
