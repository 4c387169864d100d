"""Warm ring calls take no new device memory: once a few calls have run, every buffer comes back
from torch's caching allocator. A device allocation at each call costs host time and grows the
memory reserved: the allocator caches memory per stream, so a buffer made on a stream taken
new for each call (from torch's pool of 32) meets no memory of its own. Each call is issued on
a drained GPU: calls issued back to back may take some while the host runs ahead (memory a
side stream still reads is held until the GPU gets there), which is bounded."""
import os

import pytest
import torch

from support.harness import gpu_backend, on_a_gpu, run_world, weigh_cudnn_calls_as_free
import ringflex
from ringflex import mods

_ROUNDS, _CALLS = 6, 4


def _rounds_until_steady(rank, world_size, name):
    """Rounds of ``_CALLS`` fwd+bwd calls until one takes no device allocation (cudaMalloc),
    at most ``_ROUNDS`` (then ``_ROUNDS + 1``); the same count on every rank, which takes a
    round more where any rank allocated."""
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    weigh_cudnn_calls_as_free()  # lending at these sizes: the lent rows' buffers are made on the first transfer's stream
    dev = on_a_gpu(rank)
    torch.manual_seed(rank)
    mask = mods.causal if name == "causal" else mods.sliding_window(512)
    q, k, v = (torch.randn(1, 4, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    for round_ in range(1, _ROUNDS + 1):
        before = torch.cuda.memory_stats()["num_device_alloc"]
        for _ in range(_CALLS):
            ringflex.ring_flex_attention(q, k, v, mask_mod=mask, layout="zigzag").backward(dout)
            torch.cuda.synchronize()
        nccl = torch.distributed.get_backend() == "nccl"  # gloo, where ranks share a GPU, sums on the CPU
        allocated = torch.tensor([torch.cuda.memory_stats()["num_device_alloc"] - before], device=dev if nccl else "cpu")
        torch.distributed.all_reduce(allocated)
        if round_ > 1 and allocated.item() == 0:  # the first round's calls are the first ones
            return round_
    return _ROUNDS + 1


@pytest.mark.gpu
@pytest.mark.parametrize("name, world_size", [("window", 2), ("causal", 4), ("window", 4)])
def test_warm_ring_calls_reach_a_steady_state_without_device_allocations(name, world_size):
    """Over two ranks the window lends rows (``weigh_cudnn_calls_as_free``); over four, zigzag
    reads both neighbours' rows in one step."""
    got = run_world(world_size, _rounds_until_steady, name, timeout=300, backend=gpu_backend(world_size))
    assert max(got) <= _ROUNDS, f"device allocations in every round of {_CALLS} calls: {got}"
