"""The ring: K/V blocks travel around the ranks, each step runs the hops of the plan.
Of each block only the rows that some other rank reads travel (``RingCall.travelling``),
widened to a power of two (``widened``).

Results accumulate in fp32 (fp64 for fp64 inputs) and are rounded once into the input dtype
(``merge.RowMerge`` / ``RowSum``). Backward runs the ring in reverse, from the block forward
ended on, so each block's last stop is its owner: the dK/dV accumulated for a block travel
with it and are complete when they arrive.

Where the ranks agree on loans (``ringflex.lending``), query rows travel the other way: a
rank's lent rows go to the previous rank, which computes them against its own block and
sends back their output and LSE (``_lend_forward``), and in backward their dQ
(``_lend_backward``, ``_borrowed_backward``).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor
from torch._C import _functions as autograd_nodes

from .. import captured
from ..kernels.base import HopKernel, Mods
from ..kernels.reference import compute_dtype
from ..lending import Loan, Offer
from ..plan import Hop, part_planner, steps_needed, travelling_rows
from .comm import RingComm, capture_error
from .fault import guard
from .merge import RowMerge, RowSum, Rows, contiguous_rows, lse_weights, optional_rows, rows


@dataclass
class RingCall:
    """Everything forward and backward of one call need besides the tensors."""

    comm: Optional[RingComm]  # None on a single rank
    schedule: List[List[Hop]]  # schedule[i]: hops against the K/V block held at step i
    kernel: HopKernel
    mods: Mods
    scale: float
    agreement: Any = None  # the cross-rank argument check under way: ``wait()`` before the first transfer
    travelling: Optional[List[Rows]] = None  # per block (by owner): the rows of it that travel; None: all
    own_rows_read: Optional[Rows] = None  # what the other ranks read of the own block, as planned locally
    tensors: Tuple[Tensor, ...] = ()  # captured tensors of the score_mod that require grad
    offer: Optional[Offer] = None  # this rank's side of lending, before the ranks agree
    loan: Optional[Loan] = None  # the rows lent and borrowed, once they agree (``lending``)
    lse_grad: bool = False  # a loss may read the LSE (return_lse): lent rows take its gradient along

    def agree(self, device) -> None:
        """Waits for the argument check. Then the ring runs only the steps some rank needs,
        moves only the rows of each block that some rank reads (``plan.travelling_rows``), and
        lends rows where that evens the ranks' work (``lending``)."""
        if self.agreement is None:
            return
        self.agreement.wait()
        shared = self.agreement.shared
        world = len(shared)
        reads = [[(s[i], s[i + 1]) for i in range(0, 2 * world, 2)] for s in shared]
        self.schedule = self.schedule[:steps_needed(reads)]
        if self.comm is not None:
            self.travelling = travelling_rows(reads, len(self.schedule))
        if self.comm is not None and self.offer is not None:
            planned_part = part_planner(self.kernel, self.mods.mask_mod, self.mods.score_mod is not None, device)
            self.loan = self.offer.agree([s[2 * world:] for s in shared], self.comm.rank, planned_part)
            if self.loan is not None:
                self.schedule = [self.schedule[0], list(self.loan.kept), *self.schedule[2:]]

    def rows_travelling(self, step: int, length: int) -> Rows:
        """The rows of the block held at (forward) ``step`` that travel on."""
        if self.travelling is None:
            return (0, length)
        return widened(self.travelling[(self.comm.rank - step) % self.comm.world_size], length)

    def rows_held(self, step: int, length: int) -> Rows:
        """The rows of the block held at (forward) ``step``: the own block whole, others as they travel."""
        return (0, length) if step == 0 else self.rows_travelling(step, length)


class _KVStream:
    """The K/V block of each step: ``first``, then blocks received into two buffers that
    alternate (no step allocates, and a block is never overwritten while it is still being
    read or sent), and for the last step ``last``, where the rank holds that block already:
    then the ring skips the transfer that would bring it. A received block holds only the
    rows of it that travel (``RingCall.rows_held``), in the leading memory of a buffer
    sized for a whole block. The number of steps is read when the first transfer starts:
    forward may shorten the schedule once the ranks agree."""

    def __init__(self, call: RingCall, first, last=None, reverse: bool = False):
        self.call, self.reverse, self.last = call, reverse, last
        self.current = first
        self.shapes = [t.shape for t in (last or first)]  # the own block, whole
        self.offset = self.rows(0)[0]  # the first row of the block that ``current`` holds
        self.buffers = []
        # A transfer starts only after the work queued before it on the current stream. The
        # first one may be issued after the own block's compute is queued (forward waits for
        # the argument check there), so it goes from a stream that waits for the inputs alone
        # and still overlaps that compute. Its receive buffer is allocated before that compute
        # is queued: memory freed by the compute's temporaries is then not handed to it.
        self.first_stream, self.first_send = None, None
        if self.transfers > 0:
            self._add_buffer()
            if not reverse and call.own_rows_read is not None:
                # Sliced now: a copy queued after the own block's attention kernel would wait for
                # the SMs it holds, and the first transfer with it.
                sent = widened(call.own_rows_read, self.shapes[0][2])
                self.first_send = sent, tuple(contiguous_rows(rows(t, sent)) for t in first)
            k = first[0]
            if k.is_cuda:
                self.first_stream = torch.cuda.Stream(k.device)
                self.first_stream.wait_stream(torch.cuda.current_stream(k.device))

    def _add_buffer(self):
        self.buffers.append(tuple(torch.empty(shape, dtype=t.dtype, device=t.device)
                                  for shape, t in zip(self.shapes, self.current)))

    @property
    def steps(self) -> int:
        return len(self.call.schedule)

    @property
    def transfers(self) -> int:
        return self.steps - 1 - (self.last is not None and self.steps > 1)

    def _forward_step(self, step: int) -> int:
        return self.steps - 1 - step if self.reverse else step

    def rows(self, step: int) -> Rows:
        """Which rows of its block the stream holds at ``step`` (the own block: all)."""
        return self.call.rows_held(self._forward_step(step), self.shapes[0][2])

    def travelling(self, step: int) -> Rows:
        """The rows of the block held at ``step`` that travel, local to what is held."""
        return self.local(self.call.rows_travelling(self._forward_step(step), self.shapes[0][2]))

    def local(self, r: Rows) -> Rows:
        """Rows ``r`` of a block as rows of what ``current`` holds of it."""
        return r[0] - self.offset, r[1] - self.offset

    def keys(self, hop: Hop):
        """The current block's keys and values of ``hop``."""
        return tuple(rows(t, self.local(hop.kv_rows)) for t in self.current)

    def start(self, step: int):
        """Starts passing the current block on; the next one arrives in ``advance``."""
        if step >= self.transfers:
            return None
        if len(self.buffers) <= step % 2:
            self._add_buffer()
        lo, hi = self.rows(step + 1)
        sliced, self.first_send = self.first_send, None
        with torch.cuda.stream(self.first_stream) if step == 0 and self.first_stream else nullcontext():
            if step == 0 and sliced is not None and sliced[0] == self.travelling(0):
                send = sliced[1]
            else:
                send = tuple(contiguous_rows(rows(t, self.travelling(step))) for t in self.current)
            recv = tuple(_leading_rows(b, hi - lo) for b in self.buffers[step % 2])
            return self.call.comm.exchange(send, recv, reverse=self.reverse), send, recv, lo

    def close(self) -> None:
        """Ends the stream's pass: the current stream joins the first transfer's stream (a CUDA
        graph being captured must join every stream it forked) and the transport ends its pass."""
        if self.first_stream is not None:
            torch.cuda.current_stream(self.first_stream.device).wait_stream(self.first_stream)
        if self.call.comm is not None:
            self.call.comm.end_pass(self.current[0].device)

    def advance(self, step: int, pending) -> None:
        if pending is not None:
            transfer, _, self.current, self.offset = pending  # ``send`` stays referenced until here
            transfer.wait()
        elif step + 2 == self.steps and self.last is not None:
            self.current, self.offset = self.last, 0


def widened(r: Rows, length: int) -> Rows:
    """Rows ``r`` of a block of ``length`` rows widened inside it to a power of two (or to the
    whole block). A received block holds these rows, so its row count, and with it the strides
    a kernel sees, takes one of a few values whatever the mask: the cuDNN kernel builds a
    graph for each (0.1 to 1.5 s), and packed documents would otherwise ask for a new one
    whenever a document straddling the ranks changes length. Costs at most twice the rows."""
    lo, hi = r
    if hi <= lo:
        return r
    n = min(length, 1 << (hi - lo - 1).bit_length())
    hi = min(length, lo + n)
    return hi - n, hi


def _leading_rows(buffer: Tensor, n: int) -> Tensor:
    """A [B, H, n, ...] tensor in the leading memory of ``buffer`` (contiguous, as received)."""
    shape = (*buffer.shape[:2], n, *buffer.shape[3:])
    return buffer.view(-1)[:math.prod(shape)].view(shape)


def _masked(hop: Hop) -> bool:
    return hop.kind != hop.kind.FULL


def ring_forward(call: RingCall, q: Tensor, k: Tensor, v: Tensor):
    """This rank's (out, lse, res) (``kernels.base``), the block of the last step (backward
    starts on it) and the queries borrowed from the next rank (None where none are: ``lending``)."""
    blocks = _KVStream(call, (k, v))
    own_parts, merged, returned, borrowed_q = [], None, None, None
    step = 0
    while step < len(call.schedule):  # the ranks' agreement may shorten and change it
        # The rank's own block needs no transfer: it is computed while the argument check
        # completes, and no block leaves before every rank has agreed to the call.
        pending = blocks.start(step) if step else None
        for hop in call.schedule[step]:
            part = hop.q_rows, *call.kernel.forward(rows(q, hop.q_rows), *blocks.keys(hop), hop.q_seg, hop.kv_seg,
                                                    call.mods, call.scale, _masked(hop))
            own_parts.append(part) if merged is None else merged.add(*part)
        if not step:
            call.agree(q.device)
            pending = blocks.start(step)
            if call.loan is not None:
                borrowed_q, returned = _lend_forward(call, q, k, v, blocks.first_stream)
            lent = [call.loan.lent] if call.loan is not None and _some(call.loan.lent) else []
            merged = RowMerge((*q.shape[:3], v.shape[-1]), q.dtype, compute_dtype(q.dtype), q.device,
                              [hop.q_rows for hops in call.schedule for hop in hops] + lent)
            for part in own_parts:
                merged.add(*part)
        blocks.advance(step, pending)
        step += 1
    if returned is not None:  # the lent rows' results, computed by the previous rank
        transfer, lent_results = returned
        transfer.wait()
        if _some(call.loan.lent):
            merged.add(call.loan.lent, *lent_results)
    if call.comm is not None:
        call.comm.join_sends(q.device)  # the caller's K/V left first: it may change them once this returns
    blocks.close()
    # The block of the last step: backward starts on it, so it is saved until then.
    last = blocks.current if blocks.current[0] is k else tuple(_compact(t) for t in blocks.current)
    return (*merged.result(), last, borrowed_q)


def _some(r: Rows) -> bool:
    return r[1] > r[0]


def _rows_shape(like: Tensor, r: Rows, *tail: int) -> Tuple[int, ...]:
    """[B, H, rows of ``r``, *tail] of ``like``."""
    return (*like.shape[:2], r[1] - r[0], *tail)


def _new_rows(like: Tensor, r: Rows, *tail: int, dtype=None) -> Tensor:
    """A new ``_rows_shape`` tensor on ``like``'s device, of its dtype unless ``dtype``."""
    return torch.empty(_rows_shape(like, r, *tail), dtype=dtype or like.dtype, device=like.device)


def _lend_forward(call: RingCall, q: Tensor, k: Tensor, v: Tensor, first_stream):
    """The forward's loans: this rank's lent rows go to the previous rank, the rows borrowed
    from the next rank are computed against the own block and their output and LSE go back.
    The queries leave from ``first_stream`` (beside the own block's compute, as the first K/V
    block does). Returns the borrowed queries (backward computes them again) and the transfer
    of the lent rows' results (output, lse and res: zeros where the kernel gave none) with
    their buffers."""
    loan, acc = call.loan, compute_dtype(q.dtype)
    sent, held = _travelling(loan.lent, q), _travelling(loan.borrowed, q)
    with torch.cuda.stream(first_stream) if first_stream is not None else nullcontext():
        # Allocated on that stream too: the receive does not wait for the own block's compute,
        # so it must not get memory that the compute's temporaries were freed from (the
        # current stream's), as ``_KVStream``'s first buffer must not.
        borrowed_q = _new_rows(q, held, q.shape[3])
        queries = call.comm.exchange([contiguous_rows(rows(q, sent))], [borrowed_q], reverse=True)
    if first_stream is not None:
        borrowed_q.record_stream(torch.cuda.current_stream(q.device))  # computed on, and saved for backward
    queries.wait()
    # over the borrowed rows alone: a single hop's result is then what goes back, uncopied
    results = RowMerge(_rows_shape(q, loan.borrowed, v.shape[-1]), q.dtype, acc, q.device,
                       [_shifted(h.q_rows, loan.borrowed) for h in loan.borrowed_hops])
    for hop in loan.borrowed_hops:
        results.add(_shifted(hop.q_rows, loan.borrowed), *call.kernel.forward(
            rows(borrowed_q, _shifted(hop.q_rows, held)), rows(k, hop.kv_rows), rows(v, hop.kv_rows), hop.q_seg,
            hop.kv_seg, call.mods, call.scale, _masked(hop)))
    lent_results = [_new_rows(q, loan.lent, v.shape[-1])] + [_new_rows(q, loan.lent, dtype=acc) for _ in range(2)]
    out, lse, res = results.result()
    back = [t.contiguous() for t in (out, lse, torch.zeros_like(lse) if res is None else res)]
    return borrowed_q, (call.comm.exchange(back, lent_results), lent_results)


def _travelling(lent: Rows, q: Tensor) -> Rows:
    """The rows of a rank's queries that travel for its lent rows ``lent``: those, widened as
    K/V blocks are (``widened``). The borrower's kernels see strides that follow these rows,
    so a new packed batch, which lends other rows, meets graphs built before unless its lent
    rows cross a power of two. Results come back for the lent rows alone."""
    return widened(lent, q.shape[2])


def _shifted(r: Rows, base: Rows) -> Rows:
    """Rows ``r`` of a rank's queries as rows of the part of them from ``base[0]`` on."""
    return r[0] - base[0], r[1] - base[0]


def _compact(received: Tensor) -> Tensor:
    """A received block in memory of its own size where that frees more than half of the
    whole-block buffer it fills part of (the rows a window reads over the contiguous layout),
    which saving the view would keep alive: in a model, once per attention layer until its
    backward. The copy is a pass on the SMs, so a block half the buffer (zigzag, causal) stays."""
    if received.untyped_storage().nbytes() > 2 * received.numel() * received.element_size():
        return received.clone()
    return received


def ring_backward(call: RingCall, dout, q, k, v, out, lse, res, last_k, last_v, dlse=None, borrowed_q=None):
    """The ring in reverse. It starts on the block forward ended on (``last_k``, ``last_v``,
    kept for it) and passes blocks to the previous rank, so every block visits the ranks in
    the reverse order and its last stop is its owner, which holds it already (no transfer).
    The dK/dV of a block follow it as partial sums over the rows of it that travel: each rank
    adds its hops' share to the sum it received and passes it on, and the owner's share
    completes it. So the finished gradient never travels: no transfer is left that compute
    could not hide. The first sum is one rank's share and travels in the dtype the kernel
    returned it in (the input dtype for cuDNN: half the bytes of fp32); later ones travel in
    fp32; the owner rounds once. ``dlse`` (None where the loss does not read the LSE) adds the
    LSE's share of dq and dk, a second kernel call per hop (``_lse_as_attention``) that needs
    no transfer; ``dout`` is None where the loss reads the LSE alone. The gradients of
    ``call.tensors`` are this rank's share (its queries' scores), summed over its hops: as for
    any weight, the ranks' shares add up. ``res``: the LSE's res (``kernels.base``), or None.
    Lent rows (``call.loan``) send their output, dO and LSE to the previous rank, which
    computes them again from ``borrowed_q`` (its forward kept them) and returns their dQ;
    their dK/dV join its own block's sum at the last step."""
    acc = compute_dtype(q.dtype)
    steps = len(call.schedule)
    sum_dtypes = [acc] * steps  # of the partial sum each step sends; the last step's is the gradient
    sum_dtypes[0], sum_dtypes[-1] = call.kernel.grad_dtype(k.dtype), k.dtype
    schedule = call.schedule[::-1]
    loan = call.loan
    lent = [loan.lent] if loan is not None and _some(loan.lent) else []
    dq = RowSum([q.shape], q.dtype, acc, q.device, [hop.q_rows for hops in schedule for hop in hops] + lent)
    borrowed_inputs = _lend_backward(call, dout, out, lse, res, dlse) if loan is not None else None
    blocks = _KVStream(call, (last_k, last_v), last=(k, v), reverse=True)
    received = None  # the partial sums on their way here: (tensors, transfer)
    lse_grad = _lse_as_attention(dlse, out, lse) if dlse is not None else None
    d_tensors = [torch.zeros_like(t, dtype=acc) for t in call.tensors]
    borrowed_keys, returned = [], None  # the borrowed rows' (key rows, dk, dv); the lent rows' dq on its way
    for step, hops in enumerate(schedule):
        kv_pending = blocks.start(step)
        arriving = blocks.travelling(step)  # what the partial sum on its way covers
        own_block = step + 1 == steps
        sums = RowSum([t.shape for t in blocks.current], sum_dtypes[step], acc, k.device,
                      [arriving] * (received is not None and arriving[1] > arriving[0])
                      + [blocks.local(hop.kv_rows) for hop in hops] + [r for r, *_ in borrowed_keys] * own_block)
        if own_block:  # first: an own hop that covers every key row, added last, becomes the sum
            for keys in borrowed_keys:
                sums.add(*keys)
        for i, hop in enumerate(hops):
            hop_k, hop_v = blocks.keys(hop)
            hq, hk, hv, ht = _hop_backward(call, hop, rows(q, hop.q_rows), hop_k, hop_v, rows(out, hop.q_rows),
                                           rows(lse, hop.q_rows), optional_rows(res, hop.q_rows), dout, lse_grad,
                                           hop.q_rows)
            for total, g in zip(d_tensors, ht):
                total += g
            dq.add(hop.q_rows, hq)
            if i == 0:  # the first kernel ran while the sum of the ranks before arrived
                received = _receive(received, sums, arriving)
            sums.add(blocks.local(hop.kv_rows), hk, hv)
        received = _receive(received, sums, arriving)
        total = sums.result()
        if step + 1 < steps:  # ``total`` stays referenced until this transfer is waited for
            arriving_next = blocks.travelling(step + 1)  # the rows of the next step's block that travel
            incoming = [_new_rows(t, arriving_next, *t.shape[3:]) for t in total]  # one dtype on every rank
            received = (incoming, call.comm.exchange(total, incoming, reverse=True))
        if step == 0 and borrowed_inputs is not None:  # after the sum left: it does not wait for them
            returned, borrowed_keys = _borrowed_backward(call, q, k, v, borrowed_q, borrowed_inputs, d_tensors)
        blocks.advance(step, kv_pending)
    blocks.close()
    if returned is not None:
        transfer, dq_lent = returned
        transfer.wait()
        if lent:
            dq.add(loan.lent, dq_lent)
    (dq,), (dk, dv) = dq.result(), total
    return dq, dk, dv, d_tensors


def _hop_backward(call: RingCall, hop: Hop, q, k, v, out, lse, res, dout, lse_grad, r: Rows):
    """One hop's (dq, dk, dv, gradients of ``call.tensors``) from its rows ``q``, ``out``, ``lse``,
    ``res`` and keys ``k``, ``v``; ``dout`` and ``lse_grad`` (``_lse_as_attention``'s, or None) are
    whole and taken at rows ``r``. With ``lse_grad`` a second call over zero values adds the
    LSE's share; ``dout`` None: the loss reads the LSE alone."""
    args = hop.q_seg, hop.kv_seg, call.mods, call.scale, _masked(hop), call.tensors
    if dout is not None:
        hq, hk, hv, *ht = call.kernel.backward(q, k, v, out, lse, rows(dout, r), *args, res=res)
    if lse_grad is None:
        return hq, hk, hv, ht
    lse_out, lse_dout = (rows(t, r) for t in lse_grad)
    lq, lk, lv, *lt = call.kernel.backward(q, k, torch.zeros_like(v), lse_out, lse, lse_dout, *args, res=res)
    if dout is None:  # the loss reads the LSE alone, which the values do not change
        return lq, lk, torch.zeros_like(lv), lt
    acc = compute_dtype(q.dtype)  # added in fp32, before any rounding
    return hq.to(acc) + lq, hk.to(acc) + lk, hv, [a + b for a, b in zip(ht, lt)]


def _lend_backward(call: RingCall, dout, out, lse, res, dlse):
    """Starts backward's loans: the lent rows' output, dO, LSE and its res (and the LSE's
    gradient where the call returns the LSE) go to the previous rank, which computes their
    share; a gradient the loss did not give, or a res the kernel did not, travels as zeros, as
    the borrower cannot tell. Returns the transfer of the borrowed rows' inputs with their
    buffers."""
    loan = call.loan
    given = [out, dout if dout is not None else torch.zeros_like(out), lse,
             res if res is not None else torch.zeros_like(lse)]
    if call.lse_grad:
        given.append(dlse if dlse is not None else torch.zeros_like(lse))
    send = [contiguous_rows(rows(t, _travelling(loan.lent, out))) for t in given]
    recv = [_new_rows(t, _travelling(loan.borrowed, out), *t.shape[3:]) for t in given]
    return call.comm.exchange(send, recv, reverse=True), recv


def _borrowed_backward(call: RingCall, q, k, v, borrowed_q, borrowed_inputs, d_tensors):
    """The borrowed rows' share of backward, against the own block: their dq goes back to the
    next rank (returned: the transfer and the buffer of the lent rows' dq that arrives here);
    their (key rows, dk, dv) are added to the own block's sum at the last step."""
    loan = call.loan
    transfer, (out, dout, lse, res, *dlse) = borrowed_inputs
    transfer.wait()
    lse_grad = _lse_as_attention(dlse[0], out, lse) if dlse else None
    held = _travelling(loan.borrowed, q)
    dq = RowSum([_rows_shape(q, loan.borrowed, q.shape[3])], q.dtype, compute_dtype(q.dtype), q.device,
                [_shifted(h.q_rows, loan.borrowed) for h in loan.borrowed_hops])  # over the borrowed rows alone
    keys = []
    for hop in loan.borrowed_hops:
        r = _shifted(hop.q_rows, held)
        hq, hk, hv, ht = _hop_backward(call, hop, rows(borrowed_q, r), rows(k, hop.kv_rows), rows(v, hop.kv_rows),
                                       rows(out, r), rows(lse, r), rows(res, r), dout, lse_grad, r)
        for total, g in zip(d_tensors, ht):
            total += g
        dq.add(_shifted(hop.q_rows, loan.borrowed), hq)
        keys.append((hop.kv_rows, hk, hv))
    dq_lent = _new_rows(q, loan.lent, q.shape[3])
    return (call.comm.exchange([t.contiguous() for t in dq.result()], [dq_lent]), dq_lent), keys


def _lse_as_attention(dlse: Tensor, out: Tensor, lse: Tensor):
    """(out, dout) under which a hop's backward over ZERO values gives the LSE's share of dq
    and dk. A backward computes dS = P * (dout V^T - rowsum(dout * out)); with V = 0 and
    rowsum(dout * out) = -dlse that is P * dlse, the LSE's derivative (its softmax weights)
    times dlse, through the score_mod as any dS. dout holds ones in two columns and out -dlse
    split over them (the input dtype's rounding of it, then of what that leaves), so dlse
    keeps about twice the input dtype's precision. Rows that see no key (LSE -inf) take none,
    whatever the loss made of their LSE (an infinite dlse would spread NaN to every key)."""
    dlse = torch.where(lse.isneginf(), 0.0, dlse)
    lse_out, lse_dout = torch.zeros_like(out), torch.zeros_like(out)
    columns = min(2, out.shape[-1])
    high = dlse.to(out.dtype)
    lse_out[..., 0] = -high
    if columns == 2:
        lse_out[..., 1] = high.to(dlse.dtype) - dlse
    lse_dout[..., :columns] = 1
    return lse_out, lse_dout


def _receive(received, sums: RowSum, r: Rows):
    """Adds the partial sum on its way (if any) over rows ``r`` once it has arrived; returns None."""
    if received is not None:
        tensors, transfer = received
        transfer.wait()
        if r[1] > r[0]:
            sums.add(r, *tensors)
    return None


def _with_sinks(out: Tensor, lse: Tensor, res: Optional[Tensor], sinks: Tensor):
    """Attention with a sink per head (a logit in every softmax's denominator, with no value),
    from attention without: the LSE grows to logaddexp(lse, sink) and each row shrinks by
    exp(lse - that), in fp32 (a merge with a part of output 0: ``merge.lse_weights``). A row
    that sees no key keeps output 0, its LSE the sink's. Backward needs nothing more: given
    this output and LSE, a hop's backward computes the softmax over the keys and the sink
    (``_sink_grad`` gives the sink's own gradient). Returns (out, lse, res)."""
    keep, _, lse, res = lse_weights(lse, res, sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse), None)
    return (out.to(lse.dtype) * keep.unsqueeze(-1)).to(out.dtype), lse, res


def _sink_grad(out: Tensor, lse: Tensor, res: Optional[Tensor], dout: Optional[Tensor], dlse: Optional[Tensor],
               sinks: Tensor) -> Tensor:
    """The sinks' gradient from this rank's rows: per row, the sink's softmax weight times
    (dlse - rowsum(dout * out)), as for a key whose value is 0; summed over batches and rows."""
    weight = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse - (0.0 if res is None else res))
    delta = 0.0 if dout is None else (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return (weight * ((0.0 if dlse is None else dlse) - delta)).sum((0, 2)).to(sinks.dtype)


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
            out, lse, res, (last_k, last_v), borrowed_q = ring_forward(call, q, k, v)
        if sinks is not None:
            out, lse, res = _with_sinks(out, lse, res, sinks)
        ctx.call = call
        ctx.mods_read = _mods_read(call.mods)
        ctx.save_for_backward(q, k, v, out, lse, res, last_k, last_v, sinks, borrowed_q)
        ctx.set_materialize_grads(False)  # a loss that does not read the LSE costs no LSE backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, res, last_k, last_v, sinks, borrowed_q = ctx.saved_tensors
        capture = ctx.call.comm is not None and capture_error(q, ctx.call.comm.group)
        if capture:  # raised before any transfer: the same on every rank, none is left waiting
            raise RuntimeError(f"ring_flex_attention backward: {capture}")
        dout = None if dout is None else dout.contiguous()  # None: the loss reads the LSE alone
        with guard(ctx.call.comm, "backward"), torch.no_grad():  # also under create_graph=True
            _check_mods_unchanged(ctx.mods_read, ctx.call.mods)
            dq, dk, dv, d_tensors = ring_backward(ctx.call, dout, q, k, v, out, lse, res, last_k, last_v, dlse=dlse,
                                                  borrowed_q=borrowed_q)
            d_sinks = _sink_grad(out, lse, res, dout, dlse, sinks) if ctx.needs_input_grad[4] else None
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
