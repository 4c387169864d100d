"""The first transfer of a ring pass runs beside the own block's compute (its receive does not
wait for it), so what it receives into must not be memory that the compute's temporaries were
freed from while the GPU has not run it yet: a step that brings both neighbours' rows at once
(a window over zigzag on 3 ranks) makes its second buffer after that compute is queued. Here
the own block's compute keeps its temporaries busy long after the host freed them, which a
buffer taken from the compute stream's memory would share: the received keys would be
overwritten before the step reads them."""
import pytest
import torch

from support.harness import gpu_backend, on_a_gpu, run_world
from support.oracle import attention
import ringflex
from ringflex import mods
from ringflex.parallel import compute, ring

pytestmark = pytest.mark.gpu

_SEQ, _HEADS, _KV_HEADS, _DIM = 3 * 512, 4, 1, 64


def _with_slow_own_block(step_forward):
    """``step_forward``, after which the own block's step (the first of a pass) queues a long
    sleep and then writes temporaries the size of a K and a V block, freed at once on the host."""
    def slow(call, hops, q, keys):
        parts = step_forward(call, hops, q, keys)
        if not getattr(call, "slowed", False):
            call.slowed = True
            k, v = keys((0, q.shape[2]))
            temporaries = [torch.empty_like(k), torch.empty_like(v)]
            torch.cuda._sleep(200_000_000)  # about 0.1 s: the neighbours' rows arrive meanwhile
            for t in temporaries:
                t.fill_(1e4)
        return parts
    return slow


def _window_error(rank, world_size):
    """The largest error of this rank's output shard of a window over zigzag, with the own
    block slowed as above, against the definition in fp64."""
    device = on_a_gpu(rank)
    ring.step_forward = _with_slow_own_block(compute.step_forward)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, _SEQ, _DIM, generator=gen, dtype=torch.float64)
               for heads in (_HEADS, _KV_HEADS, _KV_HEADS))
    mask = mods.sliding_window(256)
    shards = [ringflex.shard(t.to(device, torch.float32), 2, layout="zigzag") for t in (q, k, v)]
    with torch.no_grad():  # forward alone: each step's block whole, in the buffers of a pass
        out = ringflex.ring_flex_attention(*shards, mask_mod=mask, layout="zigzag", enable_gqa=True,
                                           backend="reference")
    want = ringflex.shard(attention(q, k, v, mask_mod=mask), 2, layout="zigzag")
    return (out.cpu().double() - want).abs().max().item()


def test_the_first_transfer_receives_into_memory_the_own_compute_does_not_use():
    errors = run_world(3, _window_error, backend=gpu_backend(3), timeout=180)
    assert max(errors) < 1e-5, errors
