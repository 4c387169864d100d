"""The ring: each step brings K/V rows straight from their owners and runs the plan's hops
against them. Step s brings the blocks of the ranks ``RingCall.distances_at(s)`` back (0: the
own block), over the distances at which some rank reads keys (``plan.blocks.
distances_needed``): a mask that reads the ranks on either side brings two blocks, whatever
the number of ranks. Of each block only the rows that its receiver reads travel
(``RingCall.rows_sent``), widened to a power of two (``plan.blocks.widened``). Where those
rows fill one block at most (a window or packed documents over zigzag, whose ranks read both
neighbours), they travel together and form one block: one step after the own block, whose
hops the kernel may take as one call (``RingCall.pieces``).

Results accumulate in fp32 (fp64 for fp64 inputs) and are rounded once into the input dtype
(``merge.RowMerge`` / ``RowSum``). Backward runs the steps in reverse, on the blocks forward
kept (``kv``: every block it received where they fill one block at most, so no K/V moves;
else the block it ended on, after which each block comes from its owner again), to the own
block; each rank's share of a block's dK/dV goes straight to the owner, which sums the
shares once.

Where the ranks agree on loans (``plan.lending``), query rows travel the other way: a
rank's lent rows go to the previous rank, which computes them against its own block and
sends back their output and LSE, and in backward their dQ (``loans``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor
from torch._C import _functions as autograd_nodes

from ..kernels.base import HopKernel, Mods
from ..kernels.merge import RowMerge, RowSum, Rows
from ..kernels.reference import compute_dtype
from ..kernels.sinks import sink_grad, with_sinks
from ..mod import captured
from ..plan.blocks import Hop, distances_needed, part_planner, widened
from ..plan.lending import Loan, Offer
from . import shares
from .comm import RingComm, capture_error
from .compute import lse_as_attention, some, step_backward, step_forward
from .fault import guard
from .kv import HeldBlocks, KVStream, saved
from .loans import borrowed_backward, lend_backward, lend_forward


@dataclass
class RingCall:
    """Everything forward and backward of one call need besides the tensors."""

    comm: Optional[RingComm]  # None on a single rank
    schedule: List[List[Hop]]  # schedule[i]: hops against the K/V block held at step i
    kernel: HopKernel
    mods: Mods
    scale: float
    agreement: Any = None  # the cross-rank argument check under way: ``wait()`` before the first transfer
    tensors: Tuple[Tensor, ...] = ()  # captured tensors of the score_mod that require grad
    offer: Optional[Offer] = None  # this rank's side of lending, before the ranks agree
    loan: Optional[Loan] = None  # the rows lent and borrowed, once they agree (``plan.lending``)
    lse_grad: bool = False  # a loss may read the LSE (return_lse): lent rows take its gradient along
    reads: Optional[List[List[Rows]]] = None  # per rank and distance, the rows of that block it reads
    distances: Optional[List[Tuple[int, ...]]] = None  # per step, how many ranks back the owners of its rows are
    held: Optional[List[List[Tuple[int, Rows, int]]]] = None  # per step, its ``pieces`` as the ranks agreed them
    grad: bool = True  # backward may run (the ranks agreed): forward saves what it reads, else nothing
    keeps: bool = False  # forward keeps every block it receives for backward (``keeps_received``, once agreed)

    def agree(self, device, length: int) -> None:
        """Waits for the agreement. Then the ring runs only the steps of the distances some rank
        reads (``plan.blocks.distances_needed``), moves only the rows of a block that its
        receiver reads (``rows_sent``), lends rows where that evens the ranks' work
        (``plan.lending``: the next rank's rows, computed against this rank's block), and
        brings the rows of every other rank in one step where they fill one block at most
        (blocks of ``length`` rows: ``keeps_received``) and no rows are lent."""
        if self.agreement is None:
            return
        self.agreement.wait()
        shared = self.agreement.shared
        world = len(shared)
        reads = self.reads = [[(s[i], s[i + 1]) for i in range(0, 2 * world, 2)] for s in shared]
        needed = distances_needed(reads)
        self.distances = [(d,) for d in needed]
        self.schedule = [self.schedule[d] for d in needed]
        if self.comm is not None and self.offer is not None and needed[1:2] == [1]:
            planned_part = part_planner(self.kernel, self.mods.mask_mod, self.mods.score_mod is not None, device)
            self.loan = self.offer.agree([s[2 * world:] for s in shared], self.comm.rank, planned_part)
            if self.loan is not None:
                self.schedule = [self.schedule[0], list(self.loan.kept), *self.schedule[2:]]
        if self.loan is None and len(needed) > 2 and self.keeps_received(length):
            self.distances = [(0,), tuple(needed[1:])]
            self.schedule = [self.schedule[0], [replace(hop, kv_rows=(hop.kv_rows[0] + base - held[0],
                                                                      hop.kv_rows[1] + base - held[0]))
                                                for hops, (_, held, base) in zip(self.schedule[1:],
                                                                                 self.pieces(1, length))
                                                for hop in hops]]
        self.held = [self.pieces(step, length) for step in range(len(self.schedule))]

    def distances_at(self, step: int) -> Tuple[int, ...]:
        """How many ranks back the owners of the rows held at (forward) ``step`` are."""
        return (step,) if self.distances is None else self.distances[step]

    def pieces(self, step: int, length: int) -> List[Tuple[int, Rows, int]]:
        """Where the block held at (forward) ``step`` comes from, per distance (of blocks of
        ``length`` rows): (distance, the rows of that rank's block that travel here, the row of
        the block held where they start). A step that brings one rank's rows holds them at
        their own rows; one that brings several holds them one after another, from row 0."""
        if self.held is not None:
            return self.held[step]
        held = [(d, (0, length) if d == 0 else self._travelling(d, 0, length)) for d in self.distances_at(step)]
        if len(held) == 1:
            return [(*held[0], held[0][1][0])]
        found, base = [], 0
        for d, r in held:
            found.append((d, r, base))
            base += r[1] - r[0]
        return found

    def rows_read(self, rank: int, distance: int) -> Rows:
        """The rows of the block of the rank ``distance`` back that ``rank`` (mod the world)
        reads, as the ranks agreed: the rows of its dK/dV share of that block."""
        return self.reads[rank % len(self.reads)][distance]

    def rows_sent(self, distance: int, length: int) -> Rows:
        """The rows of the own block (of ``length`` rows) that travel to the rank ``distance``
        ahead: those that rank reads of it, widened (``plan.blocks.widened``). A block goes to
        each reader apart, so each gets its own rows: over zigzag a window's reader behind
        reads the block's first chunk, its reader ahead the second, and each transfer is half
        the block."""
        return self._travelling(distance, distance, length)

    def rows_held(self, step: int, length: int) -> Rows:
        """The rows of the block held at (forward) ``step``: the own block whole, another rank's
        as they travel (``rows_sent`` at their owner), several ranks' one after another (``pieces``)."""
        pieces = self.pieces(step, length)
        (_, _, start), (_, last, end) = pieces[0], pieces[-1]
        return start, end + last[1] - last[0]

    def keeps_received(self, length: int) -> bool:
        """Whether forward keeps every block it receives (of blocks of ``length`` rows) for
        backward, which then moves no K/V: where no rank receives more rows in all than its own
        block holds, so that a call keeps about one block more until its backward than its
        inputs (the first received into a whole-block buffer: at most one and a half over the
        process group's P2P, see ``kv.saved``). A window's or packed documents' two halves over
        zigzag; a ring of one transfer, whose block forward keeps anyway. Every rank decides
        alike, from the rows the ranks agreed each reads: a rank's sends in backward follow its
        readers' choice."""
        steps = range(1, len(self.schedule))
        if self.reads is None:  # no agreement: every row travels
            return len(steps) <= 1
        held = [[widened(self.rows_read(reader, d), length) for s in steps for d in self.distances_at(s)]
                for reader in range(len(self.reads))]
        return all(sum(hi - lo for lo, hi in blocks) <= length for blocks in held)

    def _travelling(self, distance: int, reader_ahead: int, length: int) -> Rows:
        """The rows of a block that travel at ``distance`` to its reader, ``reader_ahead`` ranks after this one."""
        if self.reads is None:  # no agreement: every row
            return (0, length)
        return widened(self.rows_read(self.comm.rank + reader_ahead, distance), length)


def ring_forward(call: RingCall, q: Tensor, k: Tensor, v: Tensor):
    """This rank's (out, lse, res) (``kernels.base``), the blocks it keeps for backward (every
    block it received, where it keeps them: ``RingCall.keeps_received``; else the block of
    the last step, which backward starts on; none where no backward will run: an evaluation's
    call copies no block out of its receive buffers) and the queries borrowed from the next
    rank (None where none are: ``loans``)."""
    blocks = KVStream(call, (k, v))
    # The own block needs no transfer: it is computed while the ranks agree on the call, and
    # no block leaves before they have (the agreement may shorten the schedule and lend rows).
    own = step_forward(call, call.schedule[0], q, blocks.keys)
    call.agree(q.device, k.shape[2])
    call.keeps = call.grad and call.keeps_received(k.shape[2])  # once: the stream, forward's end and backward read it
    pending = blocks.start(0)
    borrowed_q, returned = lend_forward(call, q, k, v, blocks.first_stream) if call.loan else (None, None)
    lent = [call.loan.lent] if call.loan is not None and some(call.loan.lent) else []
    merged = RowMerge((*q.shape[:3], v.shape[-1]), q.dtype, compute_dtype(q.dtype), q.device,
                      [hop.q_rows for hops in call.schedule for hop in hops] + lent)
    merged.add_each(own)
    blocks.advance(0, pending)
    for step in range(1, len(call.schedule)):
        pending = blocks.start(step)  # bring the next block from its owner
        merged.add_each(step_forward(call, call.schedule[step], q, blocks.keys))  # compute this step's hops, merge them
        blocks.advance(step, pending)  # wait for the next block
    if returned is not None:  # the lent rows' results, computed by the previous rank
        transfer, lent_results = returned
        transfer.wait()
        if some(call.loan.lent):
            merged.add(call.loan.lent, *lent_results)
    if call.comm is not None:
        call.comm.join_sends(q.device)  # the caller's K/V left first: it may change them once this returns
    blocks.close()
    kept = (blocks.received if call.keeps else [blocks.current]) if call.grad else []
    in_place = blocks.received_in_place
    return (*merged.result(), [tuple(saved(t, in_place) for t in block) for block in kept], borrowed_q)


def ring_backward(call: RingCall, dout, q, k, v, out, lse, res, kept, dlse=None, borrowed_q=None):
    """The ring's steps in reverse, on the blocks forward ``kept``: every block it received
    (``HeldBlocks``: no K/V moves), or the block it ended on, after which each step brings its
    block from the owner; it ends on the own block, which needs no transfer. At each step a rank sends its hops' share of
    the dK/dV of the block it holds straight to the block's owner (``shares``), in
    the dtype the kernel returned it in (the input dtype for cuDNN: half the bytes of fp32; a
    share of hops that reach the same rows is their fp32 sum rounded once, as a hop's several
    calls are), and receives its own block's share from the rank that holds that now. The
    owner sums the shares, its own hops' and the borrowed rows' once, in fp32, rounded once
    (``merge.RowSum``: one pass where they are at most four): no rank adds into another's
    partial sum, so no step waits for the rank before it, and no fp32 sum travels.
    ``dlse`` (None where the loss does not read the LSE) adds the LSE's share of dq and dk, a
    second kernel call per hop (``compute.lse_as_attention``) that needs no transfer; ``dout``
    is None where the loss reads the LSE alone. The gradients of ``call.tensors`` are this
    rank's share (its queries' scores), summed over its hops: as for any weight, the ranks'
    shares add up. ``res``: the LSE's res (``kernels.base``), or None. Lent rows
    (``call.loan``) send their output, dO and LSE to the previous rank, which computes them
    again from ``borrowed_q`` (its forward kept them) and returns their dQ; their dK/dV join
    its own block's sum."""
    acc = compute_dtype(q.dtype)
    steps = len(call.schedule)
    schedule = call.schedule[::-1]
    loan = call.loan
    lent = [loan.lent] if loan is not None and some(loan.lent) else []
    dq = RowSum([q.shape], q.dtype, acc, q.device, [hop.q_rows for hops in schedule for hop in hops] + lent)
    borrowed_inputs = lend_backward(call, dout, out, lse, res, dlse) if loan is not None else None
    if call.keeps:
        blocks = HeldBlocks(call, [(k, v), *kept])
    else:
        blocks = KVStream(call, kept[-1], last=(k, v), reverse=True)
    lse_grad = lse_as_attention(dlse, out, lse) if dlse is not None else None
    d_tensors = [torch.zeros_like(t, dtype=acc) for t in call.tensors]
    own_sum, arriving, returned = None, [], None  # the own block's dK/dV; shares on their way here; the lent dq
    for step, hops in enumerate(schedule):
        kv_pending = blocks.start(step)
        pieces = call.pieces(steps - 1 - step, k.shape[2])  # whose rows the block held are: (distance, rows, first row)
        results = step_backward(call, hops, q, blocks.keys, out, lse, res, dout, lse_grad)
        for *_, ht in results:
            for total, g in zip(d_tensors, ht):
                total += g
        dq.add_each((q_rows, hq) for q_rows, _, hq, *_ in results)
        parts = [(kv_rows, hk, hv) for _, kv_rows, _, hk, hv, _ in results]  # this step's (key rows, dk, dv)
        for share in arriving:  # waited for after this step's kernels, which ran while it came
            share.arrive(own_sum)
        arriving = [shares.exchange(call, distance, shares.of_piece(parts, rows_, first), k, v, acc)
                    for distance, rows_, first in pieces if distance]
        if step == 0:
            borrowed_keys = []  # the borrowed rows' (key rows, dk, dv): after the share left, not before it
            if borrowed_inputs is not None:
                returned, borrowed_keys = borrowed_backward(call, q, k, v, borrowed_q, borrowed_inputs, d_tensors)
            own_sum = RowSum([k.shape, v.shape], k.dtype, acc, k.device,
                             shares.rows_arriving(call, steps) + [r for r, *_ in borrowed_keys]
                             + [hop.kv_rows for hop in call.schedule[0]])
            for keys in borrowed_keys:
                own_sum.add(*keys)
        blocks.advance(step, kv_pending)
    blocks.close()
    own_sum.add_each(parts)  # the own block's hops, added last: one that covers every key row becomes the sum
    if returned is not None:
        transfer, dq_lent = returned
        transfer.wait()
        if lent:
            dq.add(loan.lent, dq_lent)
    (dq,), (dk, dv) = dq.result(), own_sum.result()
    return dq, dk, dv, d_tensors


def _mods_read(mods: Mods) -> Tuple[tuple, tuple]:
    return captured.snapshot(mods.score_mod), captured.snapshot(mods.mask_mod)


def _check_mods_unchanged(at_forward: Tuple[tuple, tuple], mods: Mods) -> None:
    """Backward evaluates the mods again: raises where what they read changed since forward (a
    captured tensor written in place, an attribute set, a global reassigned), which would give
    the gradients of another attention than the forward computed."""
    for name, before, now in zip(("score_mod", "mask_mod"), at_forward, _mods_read(mods)):
        if before != now:
            raise RuntimeError(f"ring_flex_attention backward: what the {name} reads changed since its forward (a "
                               "captured tensor written in place, an attribute set or a global reassigned), and "
                               "backward evaluates it again: change it only after backward, or pass a new mod (and "
                               "keep the tensors the old one reads)")


class RingAttention(torch.autograd.Function):
    """Autograd of the ring. ``call`` carries the plan, kernel, mods and scale to backward;
    ``sinks`` (or None) and ``call.tensors`` are inputs for their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, call: RingCall, sinks, *tensors):
        with guard(call.comm, "forward"):  # a failure here releases the other ranks
            out, lse, res, kept, borrowed_q = ring_forward(call, q, k, v)
        if sinks is not None:
            out, lse, res = with_sinks(out, lse, res, sinks)
        ctx.call = call
        ctx.mods_read = _mods_read(call.mods)
        ctx.save_for_backward(q, k, v, out, lse, res, sinks, borrowed_q, *(t for block in kept for t in block))
        ctx.set_materialize_grads(False)  # a loss that does not read the LSE costs no LSE backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, res, sinks, borrowed_q, *kept = ctx.saved_tensors
        capture = ctx.call.comm is not None and capture_error(q, ctx.call.comm.group)
        if capture:  # raised before any transfer: the same on every rank, none is left waiting
            raise RuntimeError(f"ring_flex_attention backward: {capture}")
        dout = None if dout is None else dout.contiguous()  # None: the loss reads the LSE alone
        # also under create_graph=True; the check's walk of the mods is the one backward reads
        with guard(ctx.call.comm, "backward"), torch.no_grad(), captured.one_walk():
            _check_mods_unchanged(ctx.mods_read, ctx.call.mods)
            dq, dk, dv, d_tensors = ring_backward(ctx.call, dout, q, k, v, out, lse, res, list(zip(kept[::2], kept[1::2])),
                                                  dlse=dlse, borrowed_q=borrowed_q)
            d_sinks = sink_grad(out, lse, res, dout, dlse, sinks) if ctx.needs_input_grad[4] else None
        grads = [dq, dk, dv, d_sinks, *(g.to(t.dtype) for g, t in zip(d_tensors, ctx.call.tensors))]
        if torch.is_grad_enabled():  # create_graph=True: the gradients are values, with no derivative
            # (torch's ``once_differentiable`` does this only where the incoming gradients
            # require grad; here q, k and v make the gradients depend on them too)
            given = [i for i, g in enumerate(grads) if g is not None]
            wrapped = autograd_nodes.DelayedError(b"ring_flex_attention has no second derivative: its gradients "
                                                  b"cannot be differentiated (create_graph=True)", len(given))(
                *(grads[i].detach().requires_grad_() for i in given))  # the node attaches only to what requires grad
            for i, g in zip(given, wrapped):
                grads[i] = g
        return (*grads[:3], None, *grads[3:])
