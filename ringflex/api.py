"""The public entry point: ``ring_flex_attention``.

A call reads top to bottom: this rank checks its arguments and plans its part of the ring
(``_plan``), keeping what went wrong as a message; the ranks agree on the call (the same
refusal on every rank, before any transfer: ``parallel.agreement``); the ring runs and
merges the hops' results (``parallel.ring``).
"""
from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import checks, config, heads
from .config import warn_once
from .kernels import select_kernel
from .kernels.base import HopKernel, Mods
from .mod import captured
from .mod.trace import tensors_requiring_grad
from .parallel import agreement, comm, debug, mesh as meshes, reshard
from .parallel.fault import GuardedComm
from .parallel.groups import rank_and_size, ring_of
from .parallel.ring import RingAttention, RingCall
from .parallel.shard import warn_if_launched_alone
from .plan import layout as layouts
from .plan import lending
from .plan.sharding import Resharding, resharding
from .plan.blocks import Hop, MaskCache, PlanCache, check_lookups, keys_read, plan_hops

_PLANS = PlanCache()
_CALL_PLANS = MaskCache()  # (schedule, offer, reads) of this rank's part of a call (``_plan``)
_COLD_CAPTURE = ("ring_flex_attention is being captured in a CUDA graph, but no call with this mask, these shapes and "
                 "this backend ran before: a first call plans the ring and builds its kernels, which a capture cannot "
                 "hold. Run the call once eagerly before capturing (torch.cuda.make_graphed_callables does)")


def _ring_group(group):
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        warn_if_launched_alone()
    return ring_of(group)


def _no_shares(world_size: int):
    """What a rank that rejects a call shares of its plan: as many ints as a plan's shares."""
    return [0] * (2 * world_size) + lending.NO_OFFER


def reject(error: str, group=None):
    """Raises ``error`` as the ``CallRejected`` of a ring call on every rank of ``group``: for a
    call refused before ``ring_flex_attention`` (by ``RingFlexMode``, ``varlen_attention``),
    which may be refused on one rank only while the others wait in their calls' check."""
    heads_ring = meshes.describe(group)
    if heads_ring is not None:
        return heads.reject(heads_ring, error)
    group = _ring_group(group)
    agreement.reject(group, error, _no_shares(dist.get_world_size(group) if group is not None else 1))


@torch.compiler.disable(reason="ring_flex_attention runs collectives and plans from the mask at run time: "
                        "it is a graph break by design, the code around it compiles")
@captured.one_walk()  # its checks, plans, agreement and kernels read the mods: each is walked once
def ring_flex_attention(
    q: Tensor, k: Tensor, v: Tensor, *,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    group=None,
    layout=None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: Optional[Tensor] = None,
):
    """Attention over a sequence sharded across the ranks of ``group`` (a ProcessGroup, a 1-D
    DeviceMesh such as the context-parallel dimension ``mesh["cp"]`` of a larger mesh, or None:
    the default group; or a 2-D DeviceMesh of dimensions "heads" and "ring": heads x ring, see
    ``ringflex.heads``).

    q: [B, Hq, S_local, D]; k, v: [B, Hkv, S_local_kv, D(v)], each rank's shard of the
    sequence in ``layout`` (see ``ringflex.shard``): a name of ``LAYOUTS``, a ``Sharding``
    (``ringflex.shard_by_mask`` chooses one from the mask), or None: "zigzag", ``shard``'s
    default, where a call whose mask another sharding runs more than 10% faster, the move of
    its tokens included (by the cost model of ``plan.sharding``), re-shards: q, k and v move
    to that sharding over the ring's transfers and the output back, so the caller still sees zigzag
    shards, and it says so once. A layout passed (``layout="zigzag"`` too) never moves the
    tokens. ``score_mod(score, b, h, q_idx, kv_idx)``
    and ``mask_mod(b, h, q_idx, kv_idx)`` are flex_attention's, and see GLOBAL positions.
    Returns this rank's output [B, Hq, S_local, Dv] (and the log-sum-exp [B, Hq, S_local],
    fp32, fp64 for fp64 inputs, if ``return_lse``; differentiable, as flex_attention's: a loss that reads it
    costs a second backward call per hop). Tensors the score_mod reads that require grad (a
    learnable bias) get this rank's share of their gradient (cuDNN gives none: such calls run
    on flex_attention on a GPU). ``backend``: "auto", "cudnn", "flex" or "reference"
    (docs/guide.md, "Backends"). ``sinks``: attention sinks as gpt-oss has them, one logit per query head [Hq]
    in every softmax's denominator with no value (differentiable; the LSE then includes them).
    Every rank must make the same call: a bad or mismatched call
    raises the same ``CallRejected`` (a ValueError) on every rank before any transfer, and a
    rank that fails inside the ring makes the ranks waiting for it raise ``RingFailure`` (see
    docs/reliability.md).
    """
    chose_layout = layout is not None
    layout = layouts.or_default(layout)
    heads_ring = meshes.describe(group)
    if heads_ring is not None:
        return heads.attention(heads_ring, ring_flex_attention, q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                               layout=layout, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                               backend=backend, sinks=sinks)
    group = _ring_group(group)
    _warn_if_bound(score_mod, mask_mod)
    mods = Mods(score_mod, mask_mod)
    world_size = dist.get_world_size(group) if group is not None else 1
    debugging = config.debugging()
    agreement.raise_if_failed_before(group)

    # 1. Check and plan on this rank. What goes wrong stays a message until every rank knows it.
    error = checks.local_error(q, k, v, score_mod, mask_mod, layout, scale, enable_gqa, backend, group, sinks)
    plan, cause, default, moved = None, None, None, None
    if error is None:
        try:
            if not chose_layout and world_size > 1:
                default = _resharding(mask_mod, q, k, world_size)
                moved = default if default is not None and default.target is not None else None
                layout = moved.target if moved else layout
            plan = _plan(q, k, v, mods, group, layout, backend, debugging)
        except BaseException as e:  # noqa: BLE001 (a mask_mod that raises on one rank fails all)
            # a KeyboardInterrupt too: leaving before the agreement would pair the other ranks'
            # agreement with this rank's next call
            error, cause = agreement.planning_error(e), e

    # 2. One agreement among the ranks. It runs while the ring computes the own block, and the
    # ring waits for it before the first transfer; a rank that failed waits for it here.
    grad = not error and torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                                         for t in (q, k, v, sinks, *plan.tensors))
    args = None if error else dict(
        q=q, k=k, v=v, layout=layout, backend=backend, enable_gqa=enable_gqa, scale=scale, score_mod=score_mod,
        mask_mod=mask_mod, sinks=sinks, return_lse=return_lse, debug=debugging, kernel=plan.kernel.name, grad=grad)
    agreed = agreement.start(group, args, plan.shares() if plan else _no_shares(world_size), error, cause)
    if agreed.failed_here or debugging or moved:  # raises here (or agrees before the checks or the move below)
        agreed.wait()
    if default is not None and rank_and_size(group)[0] == 0:  # where it moves, or what staying costs
        warn_once(default.message)
    if moved:  # the ranks agree on the layout: every rank moves, to the same sharding
        q, k, v = reshard.move((q, k, v), 2, moved.source, moved.target, group, "re-sharding of q, k and v")

    # 3. The ring, and the merge of its hops' results.
    transfers = None
    if world_size > 1:
        transfers = debug.DebugComm(group) if debugging else GuardedComm(group)
    call = RingCall(comm=transfers, schedule=plan.schedule, kernel=plan.kernel, mods=mods,
                    scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale), agreement=agreed,
                    tensors=plan.tensors, offer=plan.offer, lse_grad=return_lse, grad=grad)
    if debugging:
        debug.check_inputs(group, q, k, v)
        q, k, v = debug.watch_grads(group, q, k, v)
    out, lse = RingAttention.apply(q, k.contiguous(), v.contiguous(), call, sinks, *plan.tensors)
    if debugging:
        debug.check_outputs(group, out, lse)
    if moved:  # back to the caller's shards; the LSE apart, so a loss that does not read it costs no LSE backward
        out, = reshard.move((out,), 2, moved.target, moved.source, group, "re-sharding of the output")
        if return_lse:
            lse, = reshard.move((lse,), 2, moved.target, moved.source, group, "re-sharding of the LSE")
    return (out, lse) if return_lse else out


def _resharding(mask_mod, q: Tensor, k: Tensor, world_size: int) -> Optional[Resharding]:
    """How a call left in the default layout runs where that layout is not within 10% of the
    mask's best sharding, the same on every rank (``plan.sharding.resharding``): where q and k
    have one length, and so move alike. During a CUDA-graph capture, whose device cannot price
    the mask, only as the eager calls before it."""
    if q.shape[2] != k.shape[2]:
        return None
    return resharding(mask_mod, q.shape[2] * world_size, world_size, layouts.DEFAULT, batch=q.shape[0],
                      heads=q.shape[1], device=q.device, price=not comm.capturing(q))


def _warn_if_bound(score_mod, mask_mod) -> None:
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if isinstance(mod, types.MethodType):
            warn_once(f"ringflex: the {name} is a bound method ({mod.__qualname__}), a new object at every "
                      "access, and ringflex keeps traces and plans by the mod object: it is traced anew at every "
                      "call (about 10 ms of host time). Pass a function or a closure built once (docs/guide.md, "
                      "'Writing mods')")


@dataclass
class _Plan:
    """This rank's part of a call, planned before the ranks agree."""

    schedule: List[List[Hop]]  # schedule[i]: the hops against the K/V block held at step i
    kernel: HopKernel
    tensors: Tuple[Tensor, ...]  # the score_mod's captured tensors that require grad
    offer: Optional[lending.Offer]  # this rank's side of lending (None: one rank, or lending off)
    reads: List[int]  # per step, the rows of the block held then that the hops read (``keys_read``), flat

    def shares(self) -> List[int]:
        """What every rank learns of this plan in the agreement: the rows of the block held at
        each step that its hops read, and the offer's shares."""
        return self.reads + (self.offer.shares if self.offer is not None else lending.NO_OFFER)


def _plan(q: Tensor, k: Tensor, v: Tensor, mods: Mods, group, layout: str, backend: str, debugging: bool) -> _Plan:
    """This rank's plan of a call whose arguments passed ``checks.local_error``. It evaluates
    the mods, which may raise (on this rank only): the caller makes that a refusal of every rank.
    A training loop makes the same call at every step: its schedule, offer and reads are kept
    (``_CALL_PLANS``, by the mask_mod as the plan cache keeps plans), so such a call looks them
    up once instead of planning its steps, the next rank's hops and the offer anew."""
    world_size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    mask_mod, score_mod = mods.mask_mod, mods.score_mod
    q_len, kv_len = q.shape[2] * world_size, k.shape[2] * world_size
    tensors = tensors_requiring_grad(score_mod, q.device)
    kernel = select_kernel(backend, q, k, v, mods, tensor_grads=bool(tensors), lengths=(q_len, kv_len))
    min_tile = config.MIN_TILE.value()
    segments = functools.partial(layouts.segments, layout, world_size=world_size)

    def segments_of_call():  # this rank's query segments, and the key segments of each step's block
        return segments(q_len, rank=rank), [segments(kv_len, rank=(rank - step) % world_size)
                                            for step in range(world_size)]

    def plan_args(q_segs, kv_segs_per_step):
        return (mask_mod, score_mod is not None, q.shape[0], q.shape[1], q_segs, kv_segs_per_step, q.device,
                min_tile, kernel)

    def planned(q_segs, kv_segs_per_step):
        capturing = comm.capturing(q)
        try:  # planning works on the host and the device at once: never inside a CUDA-graph capture
            return _PLANS.get(*plan_args(q_segs, kv_segs_per_step), planned_only=capturing)
        except LookupError:
            if not capturing:  # an IndexError or KeyError of the mask_mod itself
                raise
            raise RuntimeError(_COLD_CAPTURE) from None

    def plan_and_offer():
        q_segs, kv_segs_per_step = segments_of_call()
        schedule = planned(q_segs, kv_segs_per_step)
        offer = None
        if world_size > 1:  # the next rank's hops against this rank's block, planned here too: it may lend them here
            next_hops = planned(segments(q_len, rank=(rank + 1) % world_size), kv_segs_per_step[:1])[0]
            offer = lending.offer(mask_mod, schedule, next_hops, kernel.name,
                                  kernel.call_pairs(q.shape[0], q.shape[1], q.shape[3]), q.device)
        return schedule, offer, [x for span in keys_read(schedule, world_size) for x in span]

    key = (score_mod is not None, *q.shape[:2], q.shape[3], q_len, kv_len, layout, world_size, rank, str(q.device),
           min_tile, kernel.name, config.LENDING.value())
    schedule, offer, reads = _CALL_PLANS.lookup(mask_mod, key, plan_and_offer)
    if debugging or score_mod is not None:
        q_segs, kv_segs_per_step = segments_of_call()
        stale = debugging and debug.plan_error(schedule, plan_hops(*plan_args(q_segs, kv_segs_per_step)))
        if stale:
            raise ValueError(stale)
        if score_mod is not None:  # the mask's lookups are checked where it is planned
            check_lookups(score_mod, "score_mod", q.shape[0], q.shape[1], q_segs, kv_segs_per_step, q.device)
    return _Plan(schedule, kernel, tensors, offer, reads)
