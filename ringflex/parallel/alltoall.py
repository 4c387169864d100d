"""The all-to-alls of a heads x ring mesh (``ringflex.heads``), in groups of heads.

Over the "heads" dimension of the mesh (``a`` ranks), ``to_sequence`` turns each rank's
tensors [B, H, L, ...] (all heads of its L tokens) into, for each of ``groups`` groups of its
slice of the heads, [B, H/(a*groups), a*L, ...]: those heads for the tokens of the whole heads
group, in the group's rank order. ``to_heads`` is the reverse, one group at a time, into
tensors of the first kind.

Groups are what lets the transfers hide: each group's transfers are issued on their own and
waited for on their own, so one group's attention runs while the next group's inputs arrive
and the last group's outputs leave. The ring's exchange (``comm.RingComm``) carries them:
between the GPUs of one host the copy engines, which use no SM and so run beside the
attention kernels (a collective's kernels would wait for the kernel that holds every SM),
elsewhere the process group's P2P. One exchange per group and shift carries every tensor of
the call (q, k and v together); a batch's piece is contiguous on one end and rows at one
pitch on the other (``peer.rows``), which the copy engines move as they lie: nothing is
rearranged before or after.

Waits on CPU tensors (gloo) poll the mesh's failure mark, as the ring's transfers do
(``fault.GuardedComm``): a rank whose peer failed in another ring of the mesh raises
``RingFailure`` instead of waiting for the group's timeout.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

from torch import Tensor

from .fault import GuardedComm


class Moving:
    """Tensors that transfers are filling; ``wait()`` orders the current stream after them
    (on CPU, waits for them) and returns them."""

    def __init__(self, tensors: List[Tensor], pending: list, mesh, what: str):
        self.tensors, self.pending, self.mesh, self.what = tensors, pending, mesh, what

    def wait(self) -> List[Tensor]:
        try:
            for p in self.pending:
                p.wait()
        except BaseException as e:
            self.mesh.raised(e, self.what)
            raise
        self.pending = []
        return self.tensors


def _exchange(mesh, send_to: Callable[[int], list], recv_from: Callable[[int], list], what: str) -> list:
    """For each shift s of the heads group: ``send_to(rank + s)`` goes to that rank while
    ``recv_from(rank - s)`` is filled from that one. Nothing travels where the pieces are empty
    (the ranks agree on the shapes)."""
    a, me = mesh.heads, mesh.head_rank
    comm, pending = GuardedComm(mesh.heads_group, watched=mesh.flat), []
    comm.phase = what
    try:
        for shift in range(1, a):
            send, recv = send_to((me + shift) % a), recv_from((me - shift) % a)
            if any(t.numel() for t in send):
                pending.append(comm.exchange(send, recv, shift=shift))
    except BaseException as e:
        mesh.raised(e, what)
        raise
    return pending


def _heads(heads: int, a: int, n: int, rank: int, group: int) -> slice:
    """Group ``group`` (of ``n`` heads) of heads rank ``rank``'s slice of ``heads`` heads."""
    first = rank * (heads // a) + group * n
    return slice(first, first + n)


def _tokens(length: int, rank: int) -> slice:
    """Rank ``rank``'s ``length`` tokens in the heads group's sequence."""
    return slice(rank * length, (rank + 1) * length)


def to_sequence(tensors: Sequence[Tensor], mesh, groups: int, what: str) -> List[Moving]:
    """Each [B, H_t, L_t, ...] -> per group g, a ``Moving`` of [B, n_t, a*L_t, ...], n_t =
    H_t/(a*groups): heads g*n_t to (g+1)*n_t of this rank's slice, for the tokens of every
    rank of the heads group."""
    a, me = mesh.heads, mesh.head_rank
    tensors = [t.contiguous() for t in tensors]
    n = [t.shape[1] // a // groups for t in tensors]
    moving = []
    for g in range(groups):
        ys = [t.new_empty(t.shape[0], m, a * t.shape[2], *t.shape[3:]) for t, m in zip(tensors, n)]
        for t, y, m in zip(tensors, ys, n):
            y[:, :, _tokens(t.shape[2], me)] = t[:, _heads(t.shape[1], a, m, me, g)]

        def send_to(rank: int, g=g) -> list:
            return [t[b, _heads(t.shape[1], a, m, rank, g)] for t, m in zip(tensors, n) for b in range(t.shape[0])]

        def recv_from(rank: int, ys=ys) -> list:
            return [y[b, :, _tokens(y.shape[2] // a, rank)] for y in ys for b in range(y.shape[0])]

        moving.append(Moving(ys, _exchange(mesh, send_to, recv_from, what), mesh, what))
    return moving


def to_heads(ys: Sequence[Tensor], group: int, outs: Sequence[Tensor], mesh, what: str) -> Moving:
    """Group ``group``'s tensors [B, n_t, a*L_t, ...] (as ``to_sequence`` gives them) into their
    heads of ``outs`` [B, H_t, L_t, ...], the heads layout, on every rank of the heads group."""
    a, me = mesh.heads, mesh.head_rank
    ys = [y.contiguous() for y in ys]
    for y, out in zip(ys, outs):
        out[:, _heads(out.shape[1], a, y.shape[1], me, group)] = y[:, :, _tokens(out.shape[2], me)]

    def send_to(rank: int) -> list:
        return [y[b, :, _tokens(out.shape[2], rank)] for y, out in zip(ys, outs) for b in range(y.shape[0])]

    def recv_from(rank: int) -> list:
        return [out[b, _heads(out.shape[1], a, y.shape[1], rank, group)] for y, out in zip(ys, outs)
                for b in range(out.shape[0])]

    return Moving(list(outs), _exchange(mesh, send_to, recv_from, what), mesh, what)
