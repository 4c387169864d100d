"""Random ring calls (``random_calls.py``: layouts, lengths, heads, mixed masks and
score_mods, sinks, LSE losses, learnable biases, [B, S, H, D] memory) equal the definition,
forward and backward, over 2 to 4 ranks and over rings of part of the ranks (reference
kernel, fp64); half of them lend any row that evens the ranks' work."""
import pytest
import torch.distributed as dist

from harness import run_world
from random_calls import random_call, ring_errors

CALLS = 100  # per world size: seeds 1000 * world_size and on


def _failures(rank, world_size, rings):
    """Calls on rings of ``world_size // rings`` ranks each (every rank in one of them), each
    ring with seeds of its own."""
    from ringflex import lending
    size = world_size // rings
    groups = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(rings)] if rings > 1 else [None]
    ring = rank // size
    quantum, failures = lending.QUANTUM, []
    first = 1000 * world_size + 100_000 * (rings > 1) + 10_000 * ring
    for seed in range(first, first + CALLS // rings):
        lending.QUANTUM = 1 if seed % 2 else quantum
        call = random_call(seed, size)
        errors = ring_errors(call, random_call(seed, size), group=groups[ring])
        if max(errors.values()) > 1e-8:
            failures.append(f"rank {rank} seed {seed} ({call.describe()}): {errors}")
    return failures


@pytest.mark.parametrize("world_size,rings", [(2, 1), (3, 1), (4, 1), (4, 2)])
def test_random_calls_match_the_definition(world_size, rings):
    failures = [line for lines in run_world(world_size, _failures, rings) for line in lines]
    assert not failures, "\n".join(failures)
