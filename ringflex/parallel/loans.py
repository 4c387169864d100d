"""The loans of a call, carried out: the transfers and the compute that lending adds to the
ring once the ranks agree on it (``plan.lending`` decides who lends what). A rank's lent rows
go to the previous rank, which computes them against its own block and sends back their
output and LSE (``lend_forward``), and in backward their dQ (``lend_backward``,
``borrowed_backward``); their dK/dV stay with the owner of the keys. ``call`` is a
``ring.RingCall`` whose ``loan`` is set.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.merge import RowMerge, RowSum, Rows, rows
from ..kernels.reference import compute_dtype
from ..plan.blocks import widened
from .compute import hop_backward, hop_forward, lse_as_attention, new_rows, rows_shape
from .kv import allocated_beside
from .streams import on_stream


def lend_forward(call, q: Tensor, k: Tensor, v: Tensor, first_stream):
    """The forward's loans: this rank's lent rows go to the previous rank, the rows borrowed
    from the next rank are computed against the own block and their output and LSE go back.
    The queries leave from ``first_stream`` (beside the own block's compute, as the first K/V
    block does). Returns the borrowed queries (backward computes them again) and the transfer
    of the lent rows' results (output, lse and res: zeros where the kernel gave none) with
    their buffers."""
    loan, acc = call.loan, compute_dtype(q.dtype)
    sent, held = _travelling(loan.lent, q), _travelling(loan.borrowed, q)
    borrowed_q, = allocated_beside(first_stream, lambda: (new_rows(q, held, q.shape[3]),))
    with on_stream(first_stream):
        queries = call.comm.exchange([rows(q, sent)], [borrowed_q], shift=-1)
    queries.wait()
    # over the borrowed rows alone: a single hop's result is then what goes back, uncopied
    results = RowMerge(rows_shape(q, loan.borrowed, v.shape[-1]), q.dtype, acc, q.device,
                       [_shifted(h.q_rows, loan.borrowed) for h in loan.borrowed_hops])
    for hop in loan.borrowed_hops:
        results.add(_shifted(hop.q_rows, loan.borrowed), *hop_forward(
            call, hop, rows(borrowed_q, _shifted(hop.q_rows, held)), rows(k, hop.kv_rows), rows(v, hop.kv_rows)))
    lent_results = [new_rows(q, loan.lent, v.shape[-1])] + [new_rows(q, loan.lent, dtype=acc) for _ in range(2)]
    out, lse, res = results.result()
    back = [out, lse, torch.zeros_like(lse) if res is None else res]
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


def lend_backward(call, dout, out, lse, res, dlse):
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
    send = [rows(t, _travelling(loan.lent, out)) for t in given]
    recv = [new_rows(t, _travelling(loan.borrowed, out), *t.shape[3:]) for t in given]
    return call.comm.exchange(send, recv, shift=-1), recv


def borrowed_backward(call, q, k, v, borrowed_q, borrowed_inputs, d_tensors):
    """The borrowed rows' share of backward, against the own block: their dq goes back to the
    next rank (returned: the transfer and the buffer of the lent rows' dq that arrives here);
    their (key rows, dk, dv) are added to the own block's sum at the last step."""
    loan = call.loan
    transfer, (out, dout, lse, res, *dlse) = borrowed_inputs
    transfer.wait()
    lse_grad = lse_as_attention(dlse[0], out, lse) if dlse else None
    held = _travelling(loan.borrowed, q)
    dq = RowSum([rows_shape(q, loan.borrowed, q.shape[3])], q.dtype, compute_dtype(q.dtype), q.device,
                [_shifted(h.q_rows, loan.borrowed) for h in loan.borrowed_hops])  # over the borrowed rows alone
    keys = []
    for hop in loan.borrowed_hops:
        r = _shifted(hop.q_rows, held)
        hq, hk, hv, ht = hop_backward(call, hop, rows(borrowed_q, r), rows(k, hop.kv_rows), rows(v, hop.kv_rows),
                                      rows(out, r), rows(lse, r), rows(res, r), dout, lse_grad, r)
        for total, g in zip(d_tensors, ht):
            total += g
        dq.add(_shifted(hop.q_rows, loan.borrowed), hq)
        keys.append((hop.kv_rows, hk, hv))
    dq_lent = new_rows(q, loan.lent, q.shape[3])
    return (call.comm.exchange(dq.result(), [dq_lent]), dq_lent), keys
