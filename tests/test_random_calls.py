"""Random ring calls (``random_calls.py``: layouts, lengths, heads, mixed masks and
score_mods, sinks, LSE losses, learnable biases, [B, S, H, D] memory, calls without grad
mode) equal the definition, forward and backward: over 2 to 4 ranks and over rings of part
of the ranks (reference kernel, fp64; half of them lend any row that evens the ranks' work),
with blocks planned from small tiles,
and on the cuDNN kernel with its frontend emulated (``tests/gpu/test_cudnn_kernel.py``),
which runs its planning, batching and lowering on the CPU; local masks over zigzag on 3 to 5
ranks, whose steps bring both neighbours' rows at once, on that kernel too."""

import pytest
import torch
import torch.distributed as dist

from support.calls import agreed_calls
from support.emulated_cudnn import on_every_ring_call
from support.harness import run_world
from support.random_calls import local_mask_call, random_call, ring_errors

CALLS = 100  # per world size: seeds 1000 * world_size and on


def _failures(rank, world_size, rings, tiles=False):
    """Calls on rings of ``world_size // rings`` ranks each (every rank in one of them), each
    ring with seeds of its own. ``tiles``: every block planned from tiles of keys (with
    RINGFLEX_MIN_TILE small, as long blocks are on GPUs), seeds of their own."""
    from ringflex.plan import extents, lending
    if tiles:
        extents._DENSE_AREA = 0
    size = world_size // rings
    groups = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(rings)] if rings > 1 else [None]
    ring = rank // size
    quantum, failures = lending.QUANTUM, []
    first = 1000 * world_size + 100_000 * (rings > 1) + 10_000 * ring + 500_000 * tiles
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


def _in_place_failures(rank, world_size, count):
    """``count`` random calls whose K/V blocks and dK/dV shares arrive in buffers that every
    later call fills again (``support.in_place``), against the definition; and how many
    buffers of shares they made."""
    from support.in_place import receive_in_place
    buffers, failures = receive_in_place(), []
    for seed in range(20_000 * world_size, 20_000 * world_size + count):
        call = random_call(seed, world_size)
        errors = ring_errors(call, random_call(seed, world_size))
        if max(errors.values()) > 1e-8:
            failures.append(f"rank {rank} seed {seed} ({call.describe()}): {errors}")
    return failures, sum(key[0] == "share" for key in buffers)


@pytest.mark.parametrize("world_size", [3, 4])
def test_random_calls_with_blocks_and_shares_received_in_place(world_size):
    """As over the copy engines: each buffer is asked for by every rank alike (whole blocks,
    whatever rows a rank receives), a share's is filled once per backward, and no result is
    left in one."""
    results = run_world(world_size, _in_place_failures, 30)
    failures = [line for lines, _ in results for line in lines]
    assert not failures, "\n".join(failures)
    assert all(shares > 0 for _, shares in results)


@pytest.mark.parametrize("world_size", [3, 4])
def test_random_calls_planned_from_small_tiles(world_size, monkeypatch):
    """The same with blocks planned from tiles of 2 rows: hops cut to the keys they see, so
    each transfer carries only the rows its reader reads and forward keeps what it received
    where that fills one block, under masks nobody listed."""
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    failures = [line for lines in run_world(world_size, _failures, 1, True) for line in lines]
    assert not failures, "\n".join(failures)


def _emulated_cudnn_failures(rank, world_size):
    from ringflex.kernels.base import Mods
    cudnn = on_every_ring_call()
    failures = []
    for seed in range(1000 * world_size, 1000 * world_size + CALLS):
        made = dict(gathers=False, max_chunks=24)  # longer blocks: tiles, splits and batches of documents
        call = random_call(seed, world_size, dtype=torch.float32, **made)
        if call.learnable is not None or cudnn.lowering_error(Mods(call.score_mod, call.mask_mod)):
            continue  # ringflex runs those on flex_attention
        errors = ring_errors(call, random_call(seed, world_size, **made))
        if max(errors.values()) > 2e-4:
            failures.append(f"rank {rank} seed {seed} ({call.describe()}): {errors}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_random_calls_on_the_emulated_cudnn_kernel(world_size):
    failures = [line for lines in run_world(world_size, _emulated_cudnn_failures) for line in lines]
    assert not failures, "\n".join(failures)


def _joined_step_failures(rank, world_size, count):
    """``count`` local-mask calls on the emulated cuDNN kernel against the definition, and how
    many of them took a step that brings several ranks' rows (``RingCall.pieces``)."""
    on_every_ring_call()
    calls, failures = agreed_calls(), []
    for seed in range(7000 * world_size, 7000 * world_size + count):
        call = local_mask_call(seed, world_size, dtype=torch.float32)
        errors = ring_errors(call, local_mask_call(seed, world_size))
        if max(errors.values()) > 2e-4:
            failures.append(f"rank {rank} seed {seed} ({call.describe()}): {errors}")
    return failures, sum(any(len(d) > 1 for d in c.distances) for c in calls)


@pytest.mark.parametrize("world_size, count", [(3, 40), (4, 40), (5, 20)])  # five processes share two cores
def test_local_masks_whose_steps_join_both_neighbours_on_the_emulated_cudnn_kernel(world_size, count, monkeypatch):
    """Windows and packed documents over zigzag (no rows lent): each rank reads its two
    neighbours' rows, which arrive in one step as one block where they fill one, and the
    kernel runs their hops as one call where it can (rows no hop reaches between them): the
    numbers of the definition, forward and backward, at least half the calls by way of such a step."""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    results = run_world(world_size, _joined_step_failures, count)
    failures = [line for lines, _ in results for line in lines]
    assert not failures, "\n".join(failures)
    assert all(joined >= count // 2 for _, joined in results), [joined for _, joined in results]
