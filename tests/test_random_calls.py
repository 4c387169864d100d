"""Random ring calls (``random_calls.py``: layouts, lengths, heads, mixed masks and
score_mods, sinks, LSE losses) equal the definition, forward and backward, over 2 to 4 ranks
(reference kernel, fp64); half of them lend any row that evens the ranks' work."""
import pytest

from harness import run_world
from random_calls import random_call, ring_errors

CALLS = 100  # per world size: seeds 1000 * world_size and on


def _failures(rank, world_size):
    from ringflex import lending
    quantum, failures = lending.QUANTUM, []
    for seed in range(1000 * world_size, 1000 * world_size + CALLS):
        lending.QUANTUM = 1 if seed % 2 else quantum
        call = random_call(seed, world_size)
        errors = ring_errors(call, call)
        if max(errors.values()) > 1e-8:
            failures.append(f"rank {rank} seed {seed} ({call.describe()}): {errors}")
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_random_calls_match_the_definition(world_size):
    failures = [line for lines in run_world(world_size, _failures) for line in lines]
    assert not failures, "\n".join(failures)
