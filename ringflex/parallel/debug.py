"""``RINGFLEX_DEBUG=1``: checks at every transfer of the ring, for hunting hangs, NaN and mismatches.

Every check is collective over the ring's control group, so what one rank finds, every rank
raises (``RingDebugError``, the same message everywhere) instead of leaving the others in a
transfer. It costs a device-to-host copy of every block and one small all_gather per
transfer: for debugging, not training. All ranks must agree on the mode (the argument check
compares it). On top of the argument check (which in this mode also hashes the values of the
tensors a mod captures, such as document ids), it checks:

- before the ring: q, k and v are finite, and the cached plan equals a freshly made one (a
  captured tensor edited without a version bump, e.g. through ``.data``, makes it stale);
- at every transfer: all ranks are at the same transfer of the same pass, and the block a
  rank received is bit for bit the block its predecessor sent (shape, dtype, bytes) and has
  no NaN or +inf (-inf is the LSE of a row that sees no key, which lent rows bring back);
- after forward: the output is finite and the log-sum-exp is never NaN or +inf;
- after backward: dq, dk and dv are finite.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..mod.fingerprint import digest
from . import agreement
from .fault import GuardedComm, RaisedTogether


class RingDebugError(RaisedTogether, RuntimeError):
    """A RINGFLEX_DEBUG check failed (raised on every rank alike)."""


def _agree(group, error: Optional[str], what: str, values: Sequence[int] = ()):
    """Every rank's ``values``; raises RingDebugError on every rank if any rank has an error."""
    if group is None:
        if error:
            raise RingDebugError(f"ring_flex_attention: {error}")
        return [list(values)]
    return agreement.exchange(group, values, error, what, RingDebugError)


def _nonfinite(name: str, t: Tensor) -> Optional[str]:
    bad = ~torch.isfinite(t.detach())
    if not bad.any():
        return None
    first = tuple(int(i) for i in bad.nonzero()[0])
    return f"{name} has {int(bad.sum())} NaN/Inf values (the first at index {first})"


def check_inputs(group, q: Tensor, k: Tensor, v: Tensor) -> None:
    error = next(filter(None, (_nonfinite(n, t) for n, t in (("q", q), ("k", k), ("v", v)))), None)
    _agree(group, error, "the debug check of the inputs")


def plan_error(cached, fresh) -> Optional[str]:
    """Why a cached plan cannot be trusted, or None (a local check; the argument check shares it)."""
    if cached == fresh:
        return None
    return ("the cached plan differs from a fresh plan of the same mask: a tensor the mask_mod captures "
            "was changed without bumping its version (e.g. through .data); pass a new tensor instead")


def check_outputs(group, out: Tensor, lse: Tensor) -> None:
    error = _nonfinite("the output", out)
    if error is None and (lse.isnan().any() or (lse == float("inf")).any()):
        error = "the log-sum-exp has NaN or +inf values"
    _agree(group, error and f"forward produced bad values: {error}", "the debug check of the output")


def _describe(t: Tensor) -> list:
    """[shape and dtype hash, bytes hash, no NaN or +inf] of a block that travels."""
    host = t.detach().cpu().contiguous()
    sound = not (host.isnan().any() or (host == float("inf")).any())
    return [digest(repr((tuple(t.shape), t.dtype)).encode()),
            digest(host.view(-1).view(torch.uint8).numpy().tobytes()), int(sound)]


class DebugComm(GuardedComm):
    """GuardedComm that checks every transfer across ranks once it completes."""

    _PHASES = ("ring", "forward", "backward")

    def __init__(self, group):
        super().__init__(group)
        self.transfers = dict.fromkeys(self._PHASES, 0)  # per pass of the ring

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], shift: int = 1, send_after=None):
        pending = super().exchange(send, recv, shift, send_after)
        index = self.transfers[self.phase]
        self.transfers[self.phase] += 1
        return _CheckedPending(self, pending, send, recv, self.phase, index, shift)


class _CheckedPending:
    def __init__(self, comm: DebugComm, pending, send, recv, phase: str, index: int, shift: int):
        self.comm, self.pending, self.send, self.recv, self.phase, self.index = comm, pending, send, recv, phase, index
        self.shift, self.sent = shift, pending.sent

    def wait(self) -> None:
        self.pending.wait()
        comm = self.comm
        where = [DebugComm._PHASES.index(self.phase), self.index]
        sent = [x for t in self.send for x in _describe(t)]
        received = [x for t in self.recv for x in _describe(t)]
        records = _agree(comm.group, None, f"the debug check of {self.phase} transfer {self.index}",
                         where + sent + received)
        _check_transfer(records, len(sent), self.phase, self.shift)


def _check_transfer(records, n: int, phase: str, shift: int = 1) -> None:
    """Raises RingDebugError (on every rank: all see the same records) if the transfer went wrong.
    ``shift``: each rank received from the rank ``shift`` before it."""
    world = len(records)
    where = {tuple(rec[:2]) for rec in records}
    if len(where) > 1:
        detail = ", ".join(f"rank {r}: {DebugComm._PHASES[rec[0]]} transfer {rec[1]}" for r, rec in enumerate(records))
        raise RingDebugError(f"ring_flex_attention: the ranks are at different transfers ({detail})")
    index = records[0][1]
    for r, rec in enumerate(records):
        source = (r - shift) % world
        sent, received = records[source][2:2 + n], rec[2 + n:2 + 2 * n]
        for t in range(0, n, 3):
            what = f"{phase} transfer {index}, tensor {t // 3}"
            if sent[t] != received[t]:
                raise RingDebugError(f"ring_flex_attention: rank {r} received a block of another shape or dtype "
                                     f"than rank {source} sent ({what})")
            if sent[t + 1] != received[t + 1]:
                raise RingDebugError(f"ring_flex_attention: rank {r} received other bytes than rank "
                                     f"{source} sent ({what})")
            if not sent[t + 2]:
                raise RingDebugError(f"ring_flex_attention: rank {source} sent a block with NaN or +inf "
                                     f"values ({what})")


class _WatchGrads(torch.autograd.Function):
    """Identity whose backward checks that the ring's gradients are finite on every rank."""

    @staticmethod
    def forward(ctx, group, q, k, v):
        ctx.group = group
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        names = (("dq", dq), ("dk", dk), ("dv", dv))
        error = next(filter(None, (_nonfinite(n, g) for n, g in names if g is not None)), None)
        _agree(ctx.group, error and f"backward produced bad values: {error}", "the debug check of the gradients")
        return None, dq, dk, dv


def watch_grads(group, q: Tensor, k: Tensor, v: Tensor):
    """q, k, v unchanged; their gradients are checked when backward reaches them."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return q, k, v
    return _WatchGrads.apply(group, q, k, v)
