"""The one interface every per-hop attention kernel implements.

A *hop* is attention of one contiguous Q segment against one contiguous KV segment.
Both segments carry their GLOBAL token positions (``Segment``), so the kernel evaluates
the user's ``score_mod`` / ``mask_mod`` at exactly the indices one GPU would see.

Conventions (the flex_attention ones):
  q: [B, Hq, Lq, D]   k: [B, Hkv, Lk, D]   v: [B, Hkv, Lk, Dv]   with Hkv dividing Hq;
  query head h reads key/value head h // (Hq // Hkv).
  lse: natural-log log-sum-exp of the scaled, modified, masked scores, [B, Hq, Lq], as two
  numbers: lse (the nearest float to it) and res (what lse could not hold; None: 0). Where
  every score of a row is huge (an additive -1e30 or finfo.min mask), the LSE m + log(l)
  rounds log(l) away: without res, merges would weigh hops by 1 instead of l and a
  backward's exp(s - lse) would sum to l, not 1 (``split_lse``).
  A row that sees no key in this hop has out 0, lse -inf and res 0 (never NaN).
  Returned tensors belong to the caller: the ring keeps them until later hops are merged in.
  A segment is None when positions cannot matter (a FULL block and no score_mod): the
  planner then joins neighbouring blocks into one larger call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from ..plan.blocks import Hop
from ..plan.layout import Segment

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what every kernel takes

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
Extent = Tuple[Tuple[int, int], Tuple[int, int]]  # local (rows, keys) of a block, each [begin, end)
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Mods:
    """The user's score modification and mask, kept together because every hop needs both."""

    score_mod: Optional[ScoreMod] = None
    mask_mod: Optional[MaskMod] = None


class HopKernel(Protocol):
    """Forward and backward of one hop. Kernels hold no per-call state."""

    name: str

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, q_seg: Optional[Segment], kv_seg: Optional[Segment],
        mods: Mods, scale: float, masked: bool,
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Returns (out [B, Hq, Lq, Dv] in any float dtype, lse [B, Hq, Lq] float32/64, res like lse or None).

        ``masked=False`` means the planner proved the block FULL: mask_mod may be skipped.
        """
        ...

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
        q_seg: Optional[Segment], kv_seg: Optional[Segment], mods: Mods, scale: float, masked: bool,
        tensors: Sequence[Tensor] = (), res: Optional[Tensor] = None,
    ) -> Tuple[Tensor, ...]:
        """Returns this hop's (dq, dk, dv, *the gradients of ``tensors``); dk/dv have Hkv heads.

        ``out``, ``lse`` and ``res`` are the GLOBAL (merged over all hops) output and
        log-sum-exp, which makes the per-hop gradients add up to the exact gradient. Rows
        whose global lse is -inf contribute nothing. ``tensors``: captured tensors the
        score_mod reads that require grad (``trace.tensors_requiring_grad``), their gradients
        in fp32 (fp64 for fp64 inputs).
        """
        ...

    def forward_hops(self, q: Tensor, k: Tensor, v: Tensor, hops: Sequence[Hop], mods: Mods, scale: float
                     ) -> Optional[Tuple[Tensor, Tensor, Optional[Tensor]]]:
        """Several hops of one block in one call, where the kernel can: ``hops`` hold disjoint
        rows of ``q`` and disjoint keys of ``k`` (their rows are local to these tensors), and
        the result is (out, lse, res) over every row of ``q``, each hop's rows as ``forward``
        gives them (rows in no hop: any value). None where it cannot: the ring then runs the
        hops one by one. A rank's own block over zigzag is two diagonal blocks (packed
        documents: two ragged batches), which cost the host a call each, and, where they fill
        the block, one result to merge and sum, not two."""
        ...

    def backward_hops(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                      hops: Sequence[Hop], mods: Mods, scale: float, res: Optional[Tensor] = None
                      ) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
        """``forward_hops``' backward: (dq, dk, dv) over every row of ``q`` and ``k`` (rows and
        keys in no hop: any value), or None where it cannot."""
        ...

    def plans_within(self, mask_mod: Optional[MaskMod], has_score_mod: bool, q_seg: Segment, kv_seg: Segment,
                     device) -> Optional[Extent]:
        """Where the kernel computes no more than the visible part of this PARTIAL block by
        itself: the local rows and keys its calls reach, ``((r0, r1), (c0, c1))``; else None.
        The planner then makes that part one hop instead of splitting off the empty parts,
        which would only add calls and merges, and the ring merges and sums only its rows."""
        ...

    def call_pairs(self, batch: int, heads: int, head_dim: int) -> int:
        """What one more call costs beyond its pairs, as the number of (query, key) pairs that
        take as long at these sizes: lending weighs each rank's work by its calls too, where
        the ranks make different numbers of them (``lending``)."""
        ...

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the dk/dv ``backward`` returns for inputs of ``dtype``. A rank's dK/dV
        share of a block travels to the block's owner in it: no wider than needed, never rounded."""
        ...


class OneCallPerHop:
    """``HopKernel.forward_hops`` and ``backward_hops`` of a kernel that takes a step's hops a
    call each: the ring runs them one by one."""

    def forward_hops(self, q, k, v, hops, mods: Mods, scale: float) -> None:
        return None

    def backward_hops(self, q, k, v, out, lse, dout, hops, mods: Mods, scale: float, res=None) -> None:
        return None


def split_lse(top: Tensor, log_sum: Tensor) -> Tuple[Tensor, Tensor]:
    """The LSE ``top + log_sum`` (a row's max, or a merge's larger LSE, and the log of the
    sum of exp(x - top)) as (lse, res): the nearest float and what it could not hold, which
    is log_sum itself where |top| is huge and the rounding error elsewhere. Rows that see
    no key (log_sum -inf) get -inf and 0."""
    lse = top + log_sum
    return lse, torch.where(lse.isneginf(), 0.0, (top - lse) + log_sum)
