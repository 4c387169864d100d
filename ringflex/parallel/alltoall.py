"""The all-to-alls of a heads x ring mesh (``ringflex.heads``), in groups of heads.

Over the "heads" dimension of the mesh (``a`` ranks), ``to_sequence`` turns each rank's
[B, H, L, ...] (all heads of its L tokens) into, for each of ``groups`` groups of its slice of
the heads, [B, H/(a*groups), a*L, ...]: those heads for the tokens of the whole heads group,
in the group's rank order. ``to_heads`` is the reverse, one group at a time, into a tensor of
the first kind.

Groups are what lets the transfers hide: each group's transfers are issued on their own and
can be waited for on their own, so one group's attention runs while the next group's inputs
arrive and the last group's outputs leave. The ring's exchange (``comm.RingComm``) carries
them: between the GPUs of one host the copy engines, which use no SM and so run beside the
attention kernels (a collective's kernels would wait for the kernel that holds every SM),
elsewhere the process group's P2P. Every piece is one head of one batch for one rank's L
tokens, a run of contiguous memory on both ends, so no tensor is rearranged before or after.

A wait on CPU tensors (gloo) polls the mesh's failure mark, as the ring's transfers do
(``fault``): a rank whose peer failed in another ring of the mesh raises ``RingFailure``
instead of waiting for the group's timeout.
"""
from __future__ import annotations

from typing import List

from torch import Tensor

from . import fault
from .comm import RingComm


class Moving:
    """A tensor that transfers are filling; ``wait()`` orders the current stream after them
    (on CPU, waits for them) and returns it."""

    def __init__(self, tensor: Tensor, pending: list, mesh, what: str):
        self.tensor, self.pending, self.mesh, self.what = tensor, pending, mesh, what

    def wait(self) -> Tensor:
        try:
            for p in self.pending:
                if self.tensor.is_cuda:
                    p.wait()
                else:
                    fault.wait(p.works, self.mesh.heads_group, self.what, ring_group=self.mesh.flat)
        except BaseException as e:
            self.mesh.raised(e, self.what)
            raise
        self.pending = []
        return self.tensor


def _pieces(t: Tensor, heads, rows: slice) -> List[Tensor]:
    """``t[b, h, rows]`` for every batch b and head h of ``heads``: contiguous where ``t`` is."""
    return [t[b, h, rows] for b in range(t.shape[0]) for h in heads]


def _exchange(mesh, send_to, recv_from, what: str) -> list:
    """For each shift s of the heads group: ``send_to(rank + s)`` goes to that rank while
    ``recv_from(rank - s)`` is filled from that one. Nothing travels where the pieces are empty
    (the ranks agree on the shapes)."""
    a, me = mesh.heads, mesh.head_rank
    comm, pending = RingComm(mesh.heads_group), []
    try:
        for shift in range(1, a):
            send, recv = send_to((me + shift) % a), recv_from((me - shift) % a)
            if send and send[0].numel():
                pending.append(comm.exchange(send, recv, shift=shift))
    except BaseException as e:
        mesh.raised(e, what)
        raise
    return pending


def to_sequence(x: Tensor, mesh, groups: int, what: str) -> List[Moving]:
    """[B, H, L, ...] -> one ``Moving`` per group g of [B, n, a*L, ...], n = H/(a*groups): the
    heads g*n to (g+1)*n of this rank's slice, for the tokens of every rank of the heads group."""
    a, me = mesh.heads, mesh.head_rank
    x = x.contiguous()
    batch, length, rest = x.shape[0], x.shape[2], tuple(x.shape[3:])
    h = x.shape[1] // a
    n = h // groups
    moving = []
    for g in range(groups):
        y = x.new_empty(batch, n, a * length, *rest)
        y[:, :, me * length:(me + 1) * length] = x[:, me * h + g * n:me * h + (g + 1) * n]

        def send_to(rank, g=g):
            return _pieces(x, range(rank * h + g * n, rank * h + (g + 1) * n), slice(None))

        def recv_from(rank, y=y):
            return _pieces(y, range(n), slice(rank * length, (rank + 1) * length))

        moving.append(Moving(y, _exchange(mesh, send_to, recv_from, what), mesh, what))
    return moving


def to_heads(y: Tensor, group: int, out: Tensor, mesh, what: str) -> Moving:
    """Group ``group``'s [B, n, a*L, ...] (as ``to_sequence`` gives it) into its heads of
    ``out`` [B, H, L, ...], the heads layout, on every rank of the heads group."""
    a, me = mesh.heads, mesh.head_rank
    y = y.contiguous()
    n, length = y.shape[1], out.shape[2]
    h = out.shape[1] // a
    out[:, me * h + group * n:me * h + (group + 1) * n] = y[:, :, me * length:(me + 1) * length]

    def send_to(rank):
        return _pieces(y, range(n), slice(rank * length, (rank + 1) * length))

    def recv_from(rank):
        return _pieces(out, range(rank * h + group * n, rank * h + (group + 1) * n), slice(None))

    return Moving(out, _exchange(mesh, send_to, recv_from, what), mesh, what)
