"""The first transfer of a ring pass runs beside the own block's compute (its receive does not
wait for it), so what it receives into must not be memory that the compute's temporaries were
freed from while the GPU has not run it yet: a step that brings both neighbours' rows at once
(a window over zigzag on 3 ranks) makes its second buffer after that compute is queued. Here
the own block's compute keeps temporaries the size of a block busy long after the host freed
them (blocks of 16 MiB: each in memory of its own, which torch's allocator hands whole to the
next request of that size on the stream it was freed on); a buffer taken from there would
have its received keys overwritten before the step reads them. The hazard is where buffers
come from that allocator: ranks sharing a GPU (as here on one GPU) or the process group's P2P;
with a GPU per rank the copy engines receive into buffers of their own."""
import pytest
import torch
import torch.distributed as dist

from support.harness import gpu_backend, on_a_gpu, run_world
import ringflex
from ringflex import mods
from ringflex.parallel import compute, ring

pytestmark = pytest.mark.gpu

_SEQ, _HEADS, _DIM = 3 * 2048, 16, 128  # a rank's K block: 16 x 2048 x 128 fp32, 16 MiB


def _with_slow_own_block(step_forward):
    """``step_forward``, after which the own block's step (the first of a pass) queues a long
    sleep and then writes temporaries the size of its K and V, freed at once on the host."""
    def slow(call, hops, q, keys):
        parts = step_forward(call, hops, q, keys)
        if not getattr(call, "slowed", False):
            call.slowed = True
            temporaries = [torch.empty_like(t) for t in keys((0, q.shape[2]))]
            torch.cuda._sleep(500_000_000)  # a few tenths of a second: the neighbours' rows arrive meanwhile
            for t in temporaries:
                t.fill_(1e4)
        return parts
    return slow


def _window_error(rank, world_size):
    """The largest difference of this rank's output shard of a window over zigzag, the own
    block slowed as above, from the same call over this rank alone."""
    device = on_a_gpu(rank)
    alone, _ = dist.new_subgroups(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, _HEADS, _SEQ, _DIM, generator=gen).to(device) for _ in range(3))
    mask = mods.sliding_window(256)
    with torch.no_grad():  # forward alone: each step's block whole, in the buffers of a pass
        want = ringflex.shard(ringflex.ring_flex_attention(q, k, v, mask_mod=mask, group=alone, backend="reference"),
                              2, layout="zigzag")
        shards = [ringflex.shard(t, 2, layout="zigzag") for t in (q, k, v)]
        # a group's first call builds its transport, which waits for the GPU: the hazard is at later calls
        ringflex.ring_flex_attention(*shards, mask_mod=mask, layout="zigzag", backend="reference")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # no memory freed before is left for the buffers to take
        ring.step_forward = _with_slow_own_block(compute.step_forward)
        out = ringflex.ring_flex_attention(*shards, mask_mod=mask, layout="zigzag", backend="reference")
    torch.cuda.synchronize()
    return (out - want).abs().max().item()


def test_the_first_transfer_receives_into_memory_the_own_compute_does_not_use():
    errors = run_world(3, _window_error, backend=gpu_backend(3), timeout=180)
    assert max(errors) < 1e-4, errors
