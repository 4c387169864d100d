"""dK/dV shares: in backward, each rank's share of the gradient of the block it holds goes
straight to the block's owner, over the rows it read of it in forward, in the kernel's gradient
dtype; the owner sums the shares once (``merge.RowSum``). ``call`` is a ``ring.RingCall``.

Over the copy engines a share arrives in place (``inplace``), as K/V blocks do: into the
leading rows of a receive buffer per distance that holds a whole block's dK or dV (the rows
differ by rank, the buffers every rank asks for do not), so no copy out of the mailbox waits
for the attention kernel that holds the SMs. A distance's share comes once per backward, so
its buffer is not filled again while the sum may still keep the share unsummed; and the sum
never hands it out as the gradient, which the next call's share would overwrite. Where a
block's dK and dV together are larger than ``IN_PLACE_BYTES`` the shares go through the
mailbox: a buffer per distance, kept for every call, grows with the block (a long sequence's
would hold gigabytes that no activation could use)."""
from __future__ import annotations

from typing import List

from torch import Tensor

from ..kernels.merge import RowSum, Rows, rows
from .compute import leading_rows, new_rows, rows_shape, some

IN_PLACE_BYTES = 128 << 20  # a block's dK and dV, at most, for its shares to arrive in place: 8k rows, 32 x 128, bf16


class Share:
    """The exchange of dK/dV shares under way: the own block's share on its way here, over
    rows ``rows`` of the block (none where that rank read none of it), into ``tensors``;
    ``in_place``: they lie in receive buffers that the next backward fills."""

    def __init__(self, rows_: Rows, tensors, transfer, sent, in_place: bool):
        self.rows, self.tensors, self.transfer, self.in_place = rows_, tensors, transfer, in_place
        self.sent = sent  # referenced until the transfer is waited for (a CPU send reads it until then)

    def arrive(self, own_sum: RowSum) -> None:
        """Waits for the exchange (a CPU send completes only then) and adds the share that arrived."""
        self.transfer.wait()
        if some(self.rows):
            own_sum.add(self.rows, *self.tensors, reused=self.in_place)


def rows_arriving(call, steps: int) -> List[Rows]:
    """The rows of the own block whose dK/dV shares arrive, one range per rank that read some."""
    if call.comm is None:
        return []
    distances = [d for step in range(1, steps) for d in call.distances_at(step)]
    return [r for d in distances for r in [call.rows_read(call.comm.rank + d, d)] if some(r)]


def of_piece(parts, held: Rows, first: int) -> list:
    """Of a step's ``parts`` (rows of the block held, dk, dv), those over the rows one rank's
    block sent (``held``, of its block, lying from row ``first`` of the block held:
    ``RingCall.pieces``), in that rank's block rows."""
    end, shift = first + held[1] - held[0], held[0] - first
    found = []
    for (lo, hi), dk, dv in parts:
        a, b = max(lo, first), min(hi, end)
        if b > a:
            found.append(((a + shift, b + shift), rows(dk, (a - lo, b - lo)), rows(dv, (a - lo, b - lo))))
    return found


def exchange(call, distance: int, parts, k: Tensor, v: Tensor, acc) -> Share:
    """Sends this rank's share of the dK/dV of the block it holds (the rank ``distance`` before
    it owns it) to that rank and receives its own block's share from the rank ``distance``
    after it, which holds the block now: each over the rows that rank read of it in forward
    (``RingCall.rows_read``, which every rank knows), summed over its hops (``parts``: block rows,
    dk, dv) in fp32 where they overlap and rounded once into the kernel's gradient dtype.
    Returns the exchange under way."""
    rank, dtype = call.comm.rank, call.kernel.grad_dtype(k.dtype)
    mine, theirs = call.rows_read(rank, distance), call.rows_read(rank + distance, distance)
    send = _share(parts, mine, k, v, dtype, acc)
    in_place = arrives_in_place(call, k, v, dtype)
    if in_place:
        recv = [leading_rows(call.comm.receive_buffer(("share", distance, i), t.shape, dtype, t.device),
                             theirs[1] - theirs[0]) for i, t in enumerate((k, v))]
    else:
        recv = [new_rows(t, theirs, t.shape[3], dtype=dtype) for t in (k, v)]
    transfer = call.comm.exchange(send, recv, shift=-distance)
    return Share(theirs, recv, transfer, send, in_place)


def arrives_in_place(call, k: Tensor, v: Tensor, dtype) -> bool:
    """Whether the shares of the own block (``k``, ``v``) arrive in place, in ``dtype``: over
    the copy engines, where its dK and dV take at most ``IN_PLACE_BYTES`` (alike on every
    rank: the shards are equal)."""
    return (call.comm.receives_in_place(k.device)
            and (k.numel() + v.numel()) * dtype.itemsize <= IN_PLACE_BYTES)


def _share(parts, r: Rows, k: Tensor, v: Tensor, dtype, acc) -> List[Tensor]:
    """This rank's dK/dV share over block rows ``r``: its hops' ``parts`` summed (0 where none
    reaches), rounded once into ``dtype``; a single part over all of ``r`` in ``dtype`` as it is,
    rows of a larger gradient too (a joined call's: the copy engines read them in place)."""
    if len(parts) == 1 and parts[0][0] == r and all(t.dtype == dtype for t in parts[0][1:]):
        return list(parts[0][1:])
    share = RowSum([rows_shape(k, r, k.shape[3]), rows_shape(v, r, v.shape[3])], dtype, acc, k.device,
                   [_within(kv_rows, r) for kv_rows, _, _ in parts])
    for kv_rows, dk, dv in parts:
        share.add(_within(kv_rows, r), dk, dv)
    return share.result()


def _within(r: Rows, base: Rows) -> Rows:
    """Block rows ``r`` as rows of the part of the block that starts at ``base[0]``."""
    return r[0] - base[0], r[1] - base[0]
