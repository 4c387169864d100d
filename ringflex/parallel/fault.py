"""Failing together: a rank that raises inside the ring tells the others, so none waits forever.

A point-to-point transfer knows nothing of its peer's failure: a rank whose score_mod raises
at step 2 simply stops sending, and while its process lives on (a training loop that logs
and carries on, a notebook) its neighbours wait in a receive until the process group's
timeout (30 minutes for gloo). gloo has no working abort in torch 2.13 (``abort()`` and
``shutdown()`` leave the connections open), so ringflex tears the ring down itself:

- an exception inside the ring marks the group as failed, with the exception's text, under
  one key of the group's rendezvous store, and the rank remembers it;
- waits on CPU (gloo) transfers poll that key while they wait, so every other rank raises
  ``RingFailure`` within milliseconds;
- a failed group stays failed (transfers in flight can no longer be matched): every later
  call on it raises at once.

Waits on CUDA transfers block the GPU stream, not the CPU, so they cannot poll. On NCCL
ringflex marks the failure but cannot release a rank already blocked in NCCL; the process
group's own timeout does. Over the copy engines (``peer``), whose waits have no timeout, the
rank that marks the failure raises every flag its own and its neighbours' streams may wait
on: their streams run on (what the released copies deliver is garbage) and every rank
raises ``RingFailure`` at its next call. A failure that broke the rank's CUDA context leaves
it unable to raise flags; the others then release their own streams once their hosts see the
mark (a rank whose host is itself blocked on its GPU cannot, and waits for the process
group's timeout, as on NCCL).
"""
from __future__ import annotations

import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Optional, Sequence

import torch.distributed as dist
from torch import Tensor

from .. import config
from . import peer
from .comm import RingComm

_KEY = "failed"
_POLL_STORE_S = 0.01  # how often a waiting rank looks for a failure in the store
# A collective wait polls without sleeping this long, then sleeps at most _PAUSE_S between
# polls: the argument check's wait for a rank whose host is a few ms behind ends within
# _PAUSE_S of its arrival, and every ms of that lag the GPUs may idle.
_SPIN_S = 0.002
_PAUSE_S = 2e-4
_FAILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> what failed
_ARRIVED_S = 1.0  # a collective waited on this long is marked reached in the store
_COLLECTIVES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> collectives waited on
_INCARNATIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its number among its name's
_MET: dict = {}  # group name -> how many groups of that name this process has met


class RingFailure(RuntimeError):
    """Another rank of the ring failed (or this group failed earlier); the group is unusable."""


class RaisedTogether(Exception):
    """Base of errors that every rank raises at the same point: the ring needs no tearing down."""


class CallRejected(RaisedTogether, ValueError):
    """Every rank rejected the call together, before any transfer: the group stays usable."""


def _store(group):
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except (AttributeError, KeyError, RuntimeError):
        return None


def _key(group, name: str) -> str:
    """``name`` as a key of ``group``'s store, which a group made anew with the same ranks may
    share (``new_group(..., use_local_synchronization=True)`` names it as the old one): scoped
    to the group object, by how many groups of its name came before it here. Every rank meets
    them in the same order, as it makes them and calls the ring on them."""
    if group not in _INCARNATIONS:
        name_of_group = getattr(group, "group_name", "")
        _INCARNATIONS[group] = _MET.get(name_of_group, 0)
        _MET[name_of_group] = _INCARNATIONS[group] + 1
    return f"ringflex/{_INCARNATIONS[group]}/{name}"


def _straggler_after() -> float:
    """How long a rank waits before it says which ranks (or transfer) it waits for."""
    try:
        return max(config.STRAGGLER_S.value(), 2 * _ARRIVED_S)
    except ValueError:  # the argument check rejects the call with the message
        return float(config.STRAGGLER_S.default)


def failure(group) -> Optional[str]:
    """What made ``group`` fail, as this rank knows it, or None."""
    return _FAILED.get(group) if group is not None else None


def fail(group, message: str) -> None:
    """Marks ``group`` failed here and, best effort, for every rank (its store may be gone),
    then releases the GPU streams waiting on the copy engines' flags, which have no timeout.
    The mark comes first: a failure that broke this rank's CUDA context (an illegal address
    or instruction) makes the release raise too, and the other ranks, told by the mark, then
    release their own streams."""
    if group in _FAILED:
        return
    _FAILED[group] = message
    store = _store(group)
    if store is not None:
        try:
            store.set(_key(group, _KEY), message)
        except (RuntimeError, ValueError):  # the store lived on a rank that is gone
            pass
    try:
        peer.release(group)
    except RuntimeError as e:  # torch.AcceleratorError is one: the context is broken, the mark told the others
        warnings.warn(f"ringflex: this rank could not release the ring's GPU streams after the failure ({e})",
                      RuntimeWarning, stacklevel=2)


def _remote_failure(group) -> Optional[str]:
    store = _store(group)
    if store is None:
        return None
    key = _key(group, _KEY)
    try:
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    except (RuntimeError, ValueError) as e:
        return f"the rendezvous store cannot be reached ({e})"
    return None


def wait(works: Sequence, group, what: str, ring_group=None) -> None:
    """Waits for CPU transfers or collectives ``works`` on ``group``; raises RingFailure as
    soon as a rank of ``ring_group`` (default: ``group``) has marked it failed.

    gloo completes a transfer only inside ``wait()`` and closes the connection when a wait
    times out, so a helper thread does the (blocking) wait while this one polls the store.
    After a failure the helper stays blocked until the group's own timeout; it is a daemon.
    Otherwise it is joined before this returns: a daemon thread still inside torch's C++ code
    when the interpreter exits is stopped there, and the process aborts ("terminate called
    without an active exception").
    """
    ring_group = group if ring_group is None else ring_group
    done, errors = threading.Event(), []

    def wait_all():
        try:
            for w in works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 (handed to the waiting thread)
            errors.append(e)
        finally:
            done.set()

    helper = threading.Thread(target=wait_all, name="ringflex-wait", daemon=True)
    helper.start()
    start, said = time.monotonic(), False
    while not done.wait(_POLL_STORE_S):
        _raise_if_failed(ring_group, what)
        waited = time.monotonic() - start
        if not said and waited >= _straggler_after():  # a peer that never reached this pass (its backward)
            said = True
            who = f"rank {dist.get_rank(group)}" if group is not None else "this rank"
            warnings.warn(f"ringflex: {who} has waited {waited:.0f} s for {what}: every rank of the group must make "
                          "the same ring_flex_attention calls and backward passes", RuntimeWarning, stacklevel=2)
    helper.join()
    if errors:  # the transport's own error (a connection reset: the peer's process may be gone)
        raise RuntimeError(f"{what} failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]


def wait_collective(work, group, what: str, ring_group=None, stragglers: Optional["Stragglers"] = None) -> None:
    """``wait`` for a gloo collective, which progresses on gloo's own threads: polled here,
    without a helper thread (the argument check of every call waits on one). A long wait
    says which ranks have not arrived, where given the collective's ``Stragglers``."""
    ring_group = group if ring_group is None else ring_group
    start = time.monotonic()
    look_at_store, pause = start + _POLL_STORE_S, 0.0
    while not work.is_completed():
        # A quick answer costs no latency (the CPU is only yielded), a slow one little CPU.
        spinning = time.monotonic() - start < _SPIN_S
        time.sleep(0 if spinning else pause)
        if not spinning:
            pause = min(_PAUSE_S, 2 * pause or 1e-5)
        if time.monotonic() >= look_at_store and not work.is_completed():
            look_at_store = time.monotonic() + _POLL_STORE_S
            _raise_if_failed(ring_group, what)
            if stragglers is not None:
                stragglers.poll(time.monotonic() - start)
    work.wait()  # raises the collective's own error, if any


class Stragglers:
    """Which ranks a long wait in a collective of ``group`` waits for, said once as a warning.

    Made where the collective is issued, which every rank does in the same order, so each
    collective has the same number everywhere. A rank that has waited ``_ARRIVED_S`` marks in
    the store that it reached it; after ``RINGFLEX_STRAGGLER_S`` (default 60) seconds it names
    the ranks with no mark, as seen then and again ``_ARRIVED_S`` later (a rank that arrived in
    between marks itself meanwhile). A wait shorter than ``_ARRIVED_S`` touches no store."""

    def __init__(self, group, what: str):
        count = _COLLECTIVES.get(group, 0)
        _COLLECTIVES[group] = count + 1
        self.group, self.what, self.prefix = group, what, _key(group, f"arrived/{count}/")
        self.marked = self.done = False
        self.missing: Optional[set] = None

    def poll(self, waited: float) -> None:
        if self.done or waited < _ARRIVED_S:
            return
        store, rank = _store(self.group), dist.get_rank(self.group)
        if store is None:
            self.done = True
            return
        after = _straggler_after()
        try:
            if not self.marked:
                store.set(self.prefix + str(rank), "1")
                self.marked = True
            if waited < after + (_ARRIVED_S if self.missing is not None else 0):
                return
            missing = {r for r in range(dist.get_world_size(self.group)) if not store.check([self.prefix + str(r)])}
        except (RuntimeError, ValueError):  # the store lived on a rank that is gone
            self.done = True
            return
        if self.missing is None:
            self.missing = missing
            return
        self.done = True
        late = sorted(missing & self.missing)
        if late:
            warnings.warn(f"ringflex: rank {rank} has waited {waited:.0f} s in {self.what} for rank(s) {late}, which "
                          "have not reached it: every rank of the group must make the same ring_flex_attention calls "
                          "(and backward passes)", RuntimeWarning, stacklevel=2)


def _raise_if_failed(ring_group, what: str) -> None:
    """Raises RingFailure if a rank of ``ring_group`` has marked it failed (marking it here too)."""
    remote = _remote_failure(ring_group)
    if remote is not None:
        fail(ring_group, remote)
        raise RingFailure(f"ringflex: {what} stopped because {remote}; the process group can no "
                          "longer be used: create a new one")


class _PolledPending:
    sent = None  # as RingComm's: the process group orders its sends itself

    def __init__(self, pending, group, what: str):
        self.pending, self.group, self.what = pending, group, what  # the pending keeps the sent tensors alive

    def wait(self) -> None:
        wait(self.pending.works, self.group, self.what)


class GuardedComm(RingComm):
    """RingComm whose CPU transfers give up when a rank of the ring has failed."""

    phase = "ring"  # set by ``guard``: which pass of the ring the transfers belong to

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], shift: int = 1, send_after=None):
        pending = super().exchange(send, recv, shift, send_after)
        if send[0].is_cuda:
            return pending
        source = (self.rank - shift) % self.world_size
        return _PolledPending(pending, self.group, f"the {self.phase} transfer from rank {source}")


@contextmanager
def guard(comm: Optional[RingComm], phase: str):
    """Runs one pass of the ring; an exception inside it marks the ring failed for all ranks."""
    if comm is None:
        yield
        return
    if isinstance(comm, GuardedComm):
        comm.phase = phase
    try:
        yield
    except (RingFailure, RaisedTogether):  # the others know already
        raise
    except BaseException as e:
        fail(comm.group, f"rank {comm.rank} raised in the ring's {phase}: {type(e).__name__}: {e}")
        raise
