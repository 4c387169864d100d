"""Re-sharding over the copy engines (``ringflex.parallel.reshard``): a move of bf16 shards
between the fixed layouts and random shardings is the permutation it stands for, bit for bit,
and its gradient the reverse; a call left in the default layout that re-shards matches the
same call in the sharding it moved to."""
import os

import pytest
import torch
import torch.distributed as dist

import ringflex
from ringflex import mods
from ringflex.parallel import peer, reshard
from ringflex.mod.fingerprint import fingerprint
from ringflex.plan import sharding
from ringflex.plan.layout import Sharding
from support.cases import random_sharding
from support.harness import gpu_backend, on_a_gpu, run_world

pytestmark = pytest.mark.gpu


def _moves(rank, world_size):
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    device = on_a_gpu(rank)
    assert peer.transport(dist.group.WORLD, device) is not None
    seq_len = 4096 * world_size
    gen = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, h, seq_len, d, generator=gen, device=device, dtype=torch.bfloat16)
            for h, d in ((8, 128), (2, 128), (2, 64))]
    layouts = [Sharding.of_layout(name, seq_len, world_size) for name in ("zigzag", "contiguous", "striped")]
    pairs = [(a, b) for a in layouts for b in layouts if a != b] + [(layouts[0], random_sharding(seq_len, world_size, 1))]
    wrong = []
    for source, target in pairs:
        local = [source.take(t, rank, dim=2).requires_grad_() for t in full]
        moved = reshard.move(local, 2, source, target, None, "a test move")
        torch.autograd.backward(moved, [target.take(t, rank, dim=2) * 2 for t in full])
        got = [*moved, *(t.grad for t in local)]
        want = [*(target.take(t, rank, dim=2) for t in full), *(source.take(t, rank, dim=2) * 2 for t in full)]
        if not all(g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, want)):
            wrong.append((source.name, target.name))
    torch.cuda.synchronize()
    return wrong


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_move_over_the_copy_engines_is_the_permutation(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    assert run_world(world_size, _moves, backend=gpu_backend(world_size)) == [[]] * world_size


def _default_call(rank, world_size):
    """A window left in the default layout (re-shard forced by the decision's cache) against the
    same call in the target sharding, moved by hand."""
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    device = on_a_gpu(rank)
    seq_len = 2048 * world_size
    mask_mod = mods.sliding_window(256)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, seq_len, 64, generator=gen, device=device, dtype=torch.bfloat16)
                     for _ in range(4))
    zigzag, contiguous = (Sharding.of_layout(n, seq_len, world_size) for n in ("zigzag", "contiguous"))
    torch.use_deterministic_algorithms(True)  # cuDNN's backward without atomics: the two calls repeat bit for bit
    key = (fingerprint(mask_mod), seq_len, world_size, "zigzag", 1, 4)
    sharding._RESHARDINGS[key] = sharding.Resharding(zigzag, contiguous, "moved for the test")
    local = [zigzag.take(t, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = ringflex.ring_flex_attention(*local, mask_mod=mask_mod)
    out.backward(zigzag.take(dout, rank, dim=2))
    there = [contiguous.take(t, rank, dim=2).requires_grad_() for t in (q, k, v)]
    want = ringflex.ring_flex_attention(*there, mask_mod=mask_mod, layout="contiguous")
    want.backward(contiguous.take(dout, rank, dim=2))
    back = [reshard.move([w.detach()], 2, contiguous, zigzag, None, "the check")[0]
            for w in (want, *(t.grad for t in there))]
    torch.cuda.synchronize()
    return [torch.equal(g.detach(), w) for g, w in zip((out, *(t.grad for t in local)), back)]


def test_a_call_that_reshards_matches_the_call_in_its_target_sharding():
    assert run_world(2, _default_call, backend=gpu_backend(2)) == [[True] * 4] * 2
