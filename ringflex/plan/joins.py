"""Which hops of several ring steps backward runs as one kernel call.

A kernel call has passes whose cost follows its query rows, not its keys: cuDNN's backward
computes rowsum(dO * O) and converts its fp32 dQ once per call, and the ring sums one dQ part
per call. A rank whose hops at several steps take the same query rows against whole blocks
(the last rank of a causal zigzag ring: every query row against half of each earlier block)
pays them once per step. Where positions do not matter (FULL hops, no score_mod) those hops
are one attention over their keys together, so forward keeps the blocks they read (their
receive buffers are not reused) and backward gathers their keys and runs them as one call; the dK/dV of each step's keys still go to that
block's owner at its step. Backward runs the joins at the first step they reach, once the
rank's other hops are done: they must not hold up those hops, which the blocks the rank passes
on wait for. Pure functions; the ring carries them out (``parallel.ring``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from .blocks import BlockKind, Hop

Rows = Tuple[int, int]

# The gather of a join's keys costs about what the passes it saves cost where the keys are at
# most twice the query rows (K and V read and written once, against dO and O read and dQ
# converted once per step saved); past that the join does not repay its gather.
KEYS_PER_QUERY_ROW = 2
# Blocks kept from forward to backward, per call, beyond the one the ring keeps anyway: two
# K/V blocks at 8k tokens per rank (H=32, D=128, bf16). Longer blocks gain less from a join
# (the saved passes grow with the rows, the kernels with rows x keys) and keep more.
MOST_KEPT_BYTES = 256 << 20


@dataclass(frozen=True)
class Join:
    """Hops of several forward steps over query rows ``q_rows``: ``parts`` holds each one's
    (step, hop, rows in the keys kept for the join), the keys in step order."""

    q_rows: Rows
    parts: Tuple[Tuple[int, Hop, Rows], ...]

    @property
    def keys(self) -> int:
        return self.parts[-1][2][1]

    @property
    def hop(self) -> Hop:
        """The joined hop, over the kept keys: positions do not matter in it."""
        return Hop(self.q_rows, (0, self.keys), None, None, BlockKind.FULL)


def plan_joins(schedule: List[List[Hop]], has_score_mod: bool, held_rows: List[int], key_row_bytes: int) -> List[Join]:
    """The joins of a rank's ``schedule`` (hops per forward step; step 0, the own block, is
    computed first in forward and last in backward, and joins nothing): per query range, the
    FULL hops of two or more steps (whose results, without a score_mod, do not depend on where
    their keys lie), where their keys are at most ``KEYS_PER_QUERY_ROW`` per query row, and
    the blocks they keep (``held_rows``: the rows held at each step; ``key_row_bytes``: the
    bytes of one row of K and V together) are at most ``MOST_KEPT_BYTES`` beyond the block of
    the last step, which the ring keeps anyway. None where a hop that joins nothing comes after
    a join in backward (at a forward step as early or earlier, the own block's aside)."""
    if has_score_mod:
        return []
    by_rows: Dict[Rows, List[Tuple[int, Hop]]] = {}
    for step, hops in enumerate(schedule[1:], start=1):
        for hop in hops:
            if hop.kind == BlockKind.FULL:
                by_rows.setdefault(hop.q_rows, []).append((step, hop))
    joins, kept = [], set()
    for q_rows, hops in sorted(by_rows.items()):
        keys = sum(hop.kv_rows[1] - hop.kv_rows[0] for _, hop in hops)
        own = {step for step, _ in hops}
        steps = kept | own
        if len(own) < 2 or keys > KEYS_PER_QUERY_ROW * (q_rows[1] - q_rows[0]):
            continue
        if sum(held_rows[s] for s in steps if s != len(schedule) - 1) * key_row_bytes > MOST_KEPT_BYTES:
            continue
        kept = steps
        parts, start = [], 0
        for step, hop in hops:
            n = hop.kv_rows[1] - hop.kv_rows[0]
            parts.append((step, hop, (start, start + n)))
            start += n
        joins.append(Join(q_rows, tuple(parts)))
    joined = {(step, id(hop)) for join in joins for step, hop, _ in join.parts}
    last_joined = max((step for step, _ in joined), default=0)
    if any((step, id(hop)) not in joined for step in range(1, last_joined + 1) for hop in schedule[step]):
        return []
    return joins


def first_backward_step(joins: List[Join], steps: int) -> int:
    """The backward step at which the joins run: the first that holds a block they read
    (backward takes the forward steps in reverse)."""
    return steps - 1 - max(step for join in joins for step, _, _ in join.parts)
