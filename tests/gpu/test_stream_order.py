"""The first transfer of a ring pass runs beside the own block's compute (its receive does not
wait for it), so what it receives into must not be memory that the compute's temporaries were
freed from while the GPU has not run it yet: a step that brings both neighbours' rows at once
(a window over zigzag on 3 ranks, where the cuDNN kernel joins a step's hops) makes its second
buffer after that compute is queued. Here the own block's compute is followed by a long sleep
and then by writes into every piece of memory that torch's allocator holds free for the
compute stream and could hand to a buffer of a block; a buffer taken from there has its
received keys overwritten before the step reads them. Whether the buffers lie in that memory
is checked too: the allocator decides it, not the timing. The hazard is where buffers come from
that allocator: the process group's P2P (the copy engines receive into buffers of their own,
``inplace``), which the calls here stand in for by turning the copy engines' receive buffers off."""
import importlib.util

import pytest
import torch
import torch.distributed as dist

from support.harness import gpu_backend, on_a_gpu, run_world
import ringflex
from ringflex import mods
from ringflex.parallel import comm, compute, ring

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                                                 reason="needs nvidia-cudnn-frontend")]

_SEQ, _HEADS, _DIM = 3 * 2048, 32, 128  # a rank's K block: 32 x 2048 x 128 bf16, 16 MiB


def _span(t):
    """The device addresses ``t``'s storage covers."""
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _with_slow_own_block(step_forward, freed):
    """``step_forward``, after which the own block's step (the first of a pass) takes every
    piece of free memory that could serve a block, queues a long sleep, writes into them all
    and frees them at once on the host; their addresses go into ``freed``."""
    def slow(call, hops, q, keys):
        parts = step_forward(call, hops, q, keys)
        if not freed:
            block, taken = keys((0, q.shape[2]))[0], []
            reserved = torch.cuda.memory_reserved()
            while torch.cuda.memory_reserved() == reserved:  # until no free piece that size is left
                taken.append(torch.empty_like(block))
            torch.cuda._sleep(500_000_000)  # a few tenths of a second: the neighbours' rows arrive meanwhile
            for t in taken:
                t.fill_(1e4)
            freed.extend(_span(t) for t in taken)
        return parts
    return slow


def _received_beside(exchange, compute_stream, spans):
    """``RingComm.exchange``, noting the receive buffers of the transfers issued on another
    stream than ``compute_stream`` (those that run beside its work) into ``spans``."""
    def noted(self, send, recv, *args, **kwargs):
        if torch.cuda.current_stream() != compute_stream:
            spans.extend(_span(t) for t in recv)
        return exchange(self, send, recv, *args, **kwargs)
    return noted


def _window_call(rank, world_size):
    """This rank's largest difference of its output shard of a window over zigzag, the own
    block slowed as above, from the same call over this rank alone, and how many of the
    buffers received into beside the own block's compute lie in memory that compute freed."""
    device = on_a_gpu(rank)
    alone, _ = dist.new_subgroups(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, _HEADS, _SEQ, _DIM, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    mask = mods.sliding_window(256)
    with torch.no_grad():  # forward alone: each step's block whole, in the buffers of a pass
        want = ringflex.shard(ringflex.ring_flex_attention(q, k, v, mask_mod=mask, group=alone, backend="cudnn"),
                              2, layout="zigzag")
        shards = [ringflex.shard(t, 2, layout="zigzag") for t in (q, k, v)]
        # a group's first call builds its transport, which waits for the GPU: the hazard is at later calls
        ringflex.ring_flex_attention(*shards, mask_mod=mask, layout="zigzag", backend="cudnn")
        torch.cuda.synchronize()
        comm.RingComm.receives_in_place = lambda self, device: False  # the blocks come from torch's allocator
        freed, received = [], []
        ring.step_forward = _with_slow_own_block(compute.step_forward, freed)
        comm.RingComm.exchange = _received_beside(comm.RingComm.exchange, torch.cuda.current_stream(), received)
        out = ringflex.ring_flex_attention(*shards, mask_mod=mask, layout="zigzag", backend="cudnn")
    torch.cuda.synchronize()
    overlapping = [r for r in received if any(r[0] < end and start < r[1] for start, end in freed)]
    return (out.float() - want.float()).abs().max().item(), len(received), len(overlapping)


def test_the_first_transfer_receives_into_memory_the_own_compute_does_not_use():
    results = run_world(3, _window_call, backend=gpu_backend(3), timeout=180)
    errors, received, overlapping = zip(*results)
    assert sum(received) > 0, results  # the ring's first transfers were seen
    assert sum(overlapping) == 0, results  # where the allocator handed a buffer memory the compute still uses
    assert max(errors) < 0.05, results  # bf16 roundings; a block overwritten: errors of thousands
