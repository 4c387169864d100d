"""The ring's error does not grow with the ring: world sizes 1, 2, 4 and 8 against a float64
oracle, fp32 and bf16, forward and backward; and two identical runs are bitwise identical."""
import pytest

from harness import run_world
from numerics import measure

# Relative to the reference's largest magnitude (see tests/numerics.py). bf16: one rounding of
# the result to bf16 is up to 2**-8 of it; fp32: the fp32 arithmetic of the hops and merges.
BOUND = {"float32": 2e-6, "bfloat16": 2 ** -8}
# How much worse than on one rank any ring may be: a quarter of a bf16 rounding, and for fp32
# the size of the fp32 error itself. A ring that rounded partial outputs to bf16 per hop
# exceeds both at 8 ranks (docs/reliability.md).
GROWTH = {"float32": 1e-6, "bfloat16": 2 ** -10}
WORLD_SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def by_world_size():
    return {w: run_world(w, measure, timeout=240) for w in WORLD_SIZES}


def test_error_is_bounded_and_does_not_grow_with_world_size(by_world_size):
    single = by_world_size[1][0][0]
    failures = []
    for world_size, per_rank in by_world_size.items():
        errors = per_rank[0][0]
        assert all(r[0] == errors for r in per_rank), "the ranks measured different errors"
        for (problem, dtype), errs in errors.items():
            for what, err, base in zip(("out", "dq", "dk", "dv"), errs, single[problem, dtype]):
                if err > BOUND[dtype] or err > base + GROWTH[dtype]:
                    failures.append(f"{world_size} ranks, {problem} {dtype} {what}: {err:.3g} "
                                    f"(1 rank: {base:.3g}, bound {BOUND[dtype]:.3g})")
    assert not failures, "\n".join(failures)


def test_identical_runs_are_bitwise_identical(by_world_size):
    for world_size, per_rank in by_world_size.items():
        assert all(repeatable for _, repeatable, _ in per_rank), f"{world_size} ranks: a rerun differed"
    again = run_world(4, measure, timeout=240)  # fresh processes give the same bits too
    assert [digest for *_, digest in again] == [digest for *_, digest in by_world_size[4]]
