"""A rank that raises inside the ring makes every other rank fail promptly instead of waiting.

The raising rank's process lives on (it goes to a barrier on another group), so what releases
the others is ringflex's failure mark, not a closed connection. Each fault runs on a group of
its own, with a timeout far above the bound the test asserts.
"""
import datetime
import time

import pytest
import torch
import torch.distributed as dist

import ringflex
from support.harness import run_world
from ringflex.parallel import fault

WORLD = 4
L = 4  # local tokens
RELEASE_BOUND_S = 15.0  # the other ranks must fail well within this (the group's timeout is 60 s)


def _fault_in_forward(score, b, h, q_idx, kv_idx):
    """Raises on rank 1 at forward step 1, where (contiguous layout) it holds rank 0's block."""
    if dist.get_rank() == 1 and not torch.is_grad_enabled() and int(kv_idx.max()) < L:
        raise RuntimeError("injected fault")
    return score


def _fault_in_backward(score, b, h, q_idx, kv_idx):
    """Raises on rank 2 at backward step 0, where it holds rank 3's block (the block forward
    ended on), before it sends its first dK/dV share (every rank waits for a share from it)."""
    if dist.get_rank() == 2 and torch.is_grad_enabled() and 3 * L <= int(kv_idx.min()):
        raise RuntimeError("injected fault")
    return score


LENDING_L = 64  # local tokens of the lending fault: enough for rank r to lend its window corner on


def _fault_in_borrowed_rows(score, b, h, q_idx, kv_idx):
    """Raises on rank 0 as it computes rows that rank 1 lent it (``lending``): queries that
    are not its own, against its own block, in forward."""
    if dist.get_rank() == 0 and not torch.is_grad_enabled() and int(q_idx.min()) >= LENDING_L:
        raise RuntimeError("injected fault")
    return score


def _run(score_mod, group, local=L, mask_mod=None):
    """Forward and backward on ``group``; (error text or None, seconds until it was raised)."""
    q, k, v = (torch.randn(1, 2, local, 8, requires_grad=True) for _ in range(3))
    start = time.monotonic()
    try:
        out = ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, layout="contiguous",
                                           group=group)
        out.sum().backward()
    except Exception as e:  # noqa: BLE001 (the test inspects the text)
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return None, time.monotonic() - start


def _faults(rank, world_size):
    timeout = datetime.timedelta(seconds=60)
    from ringflex.plan import lending
    lending.QUANTUM = 1
    groups = [dist.new_group(list(range(world_size)), timeout=timeout) for _ in range(3)]
    results = {}
    window = ringflex.mods.sliding_window(3 * LENDING_L // 8)  # its corners even out with loans: 4.5% less work
    for name, score_mod, group, local, mask_mod in (("forward", _fault_in_forward, groups[0], L, None),
                                                    ("backward", _fault_in_backward, groups[1], L, None),
                                                    ("lending", _fault_in_borrowed_rows, groups[2], LENDING_L, window)):
        results[name] = _run(score_mod, group, local, mask_mod)
        results[name + ", called again"] = _run(None, group)
        dist.barrier()  # the default group is healthy: the raising rank waits here, alive
    return results


def test_a_rank_raising_inside_the_ring_fails_every_rank():
    per_rank = run_world(WORLD, _faults, timeout=120)
    for name, phase, culprit in (("forward", "forward", 1), ("backward", "backward", 2), ("lending", "forward", 0)):
        origin = f"rank {culprit} raised in the ring's {phase}: RuntimeError: injected fault"
        for rank, results in enumerate(per_rank):
            text, seconds = results[name]
            if rank == culprit:
                assert text == "RuntimeError: injected fault", (name, rank, text)
            else:
                assert text is not None and text.startswith("RingFailure: ringflex: ") and origin in text, \
                    (name, rank, text)
                assert "the process group can no longer be used" in text
            assert seconds < RELEASE_BOUND_S, (name, rank, seconds)
            again, seconds = results[name + ", called again"]
            assert again.startswith("RingFailure: ringflex: the ring on this process group failed earlier"), again
            assert seconds < RELEASE_BOUND_S, (name, rank, seconds)


def _late_rank(rank, world_size, late_by):
    """Rank 2 reaches the call ``late_by`` seconds after the others; the warnings each rank gave."""
    import os
    import warnings
    os.environ["RINGFLEX_STRAGGLER_S"] = "0"  # name stragglers as early as they can be (2 s)
    q = torch.randn(1, 2, 8, 8)
    ringflex.ring_flex_attention(q, q, q)  # a first call that every rank makes at once
    if rank == 2:
        time.sleep(late_by)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ringflex.ring_flex_attention(q, q, q)
    return [str(w.message) for w in caught if "ringflex" in str(w.message)]


def test_ranks_that_wait_long_for_a_rank_name_it():
    """A rank that never makes a call every other rank makes leaves them waiting until the
    group's timeout; meanwhile each waiting rank says once which ranks it waits for. A rank
    late by less than that says nothing."""
    for rank, messages in enumerate(run_world(3, _late_rank, 4.5, timeout=120)):
        if rank == 2:
            assert messages == []
        else:
            assert len(messages) == 1 and messages[0].startswith(f"ringflex: rank {rank} has waited 3 s in "), messages
            assert "for rank(s) [2], which have not reached it: every rank of the group must make the same " \
                   "ring_flex_attention calls" in messages[0], messages
    assert run_world(3, _late_rank, 1.0, timeout=120) == [[], [], []]



class _Group:
    """A process group as ``fault`` sees it: a name, and a store (shared, as torch shares it)."""

    group_name = "ranks 0 to 3"


def test_a_failure_stays_with_its_group_object(monkeypatch):
    """A group made anew with the same ranks (``new_group(..., use_local_synchronization=True)``,
    as after a failure the error asks) gets the old group's name and store from torch: the old
    group's failure mark made its first call raise RingFailure."""
    store = dist.HashStore()
    monkeypatch.setattr(fault, "_store", lambda group: store)
    failed, anew = _Group(), _Group()
    fault.fail(failed, "rank 1 raised in the ring's forward")
    assert fault._remote_failure(failed) == "rank 1 raised in the ring's forward"
    assert fault._remote_failure(anew) is None


def test_a_rank_whose_gpu_context_broke_still_tells_the_others(monkeypatch):
    """A failure that broke the rank's CUDA context (an illegal instruction) makes releasing
    the GPU streams raise as well: the failure is marked for the other ranks first (they
    then release their own streams), and the release's error is a warning, so the rank
    raises its own error, not the release's."""
    store = dist.HashStore()
    monkeypatch.setattr(fault, "_store", lambda group: store)

    def broken(group):
        raise torch.AcceleratorError("CUDA error: an illegal instruction was encountered")

    monkeypatch.setattr(fault.peer, "release", broken)
    group = _Group()
    with pytest.warns(RuntimeWarning, match="could not release the ring's GPU streams.*illegal instruction"):
        fault.fail(group, "rank 1 raised in the ring's forward")
    assert fault._remote_failure(group) == "rank 1 raised in the ring's forward"


def test_a_transfer_the_transport_fails_is_named():
    """A peer's process that exits resets its connections: the error says which transfer broke
    (the rank marking the ring failed was named as if it had raised of itself)."""
    class Reset:
        def wait(self):
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(RuntimeError, match="^the forward transfer from rank 1 failed: RuntimeError: Connection reset"):
        fault.wait([Reset()], None, "the forward transfer from rank 1")


def test_a_long_wait_for_a_transfer_says_which(monkeypatch, recwarn):
    """A peer that skips its backward leaves the others in the backward ring: after
    ``RINGFLEX_STRAGGLER_S`` (at least 2 s) the waiting rank says which transfer it waits for."""
    class Late:
        def wait(self):
            time.sleep(2.3)

    monkeypatch.setenv("RINGFLEX_STRAGGLER_S", "0")
    fault.wait([Late()], None, "the backward transfer from rank 1")
    messages = [str(w.message) for w in recwarn if "ringflex" in str(w.message)]
    assert messages == ["ringflex: this rank has waited 2 s for the backward transfer from rank 1: every rank of the "
                        "group must make the same ring_flex_attention calls and backward passes"]
