"""The ring's error does not grow with the ring: world sizes 1, 2, 4 and 8 against a float64
oracle, fp32 and bf16, forward and backward; and two identical runs are bitwise identical."""
import pytest
import torch

import ringflex
from support.harness import run_world
from support.numerics import measure
from support.oracle import attention
from ringflex import mods

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


def score_ignoring_mods(seq_len: int, bias):
    """name -> (score_mod, mask_mod) whose result ignores the score, everywhere or in the first
    half of the rows: legal in flex_attention, with dq = dk = 0 there while dv and the gradient
    of a read tensor (``bias``, one value per head) are not."""
    return {
        "position_only": (lambda s, b, h, q, kv: torch.zeros_like(s) - 0.1 * (q - kv), mods.causal),
        "constant": (lambda s, b, h, q, kv: torch.zeros_like(s), None),
        "score_in_late_rows": (lambda s, b, h, q, kv: torch.where(q >= seq_len // 2, s, -0.1 * (q - kv)),
                               mods.causal),
        "bias_only": (lambda s, b, h, q, kv: torch.zeros_like(s) + bias[h], mods.causal),
    }


def _score_ignoring_errors(rank, world_size):
    """Per mod: the worst relative error of out, dq, dk, dv and the bias's gradient (summed over
    the ranks) of the ring against the fp64 oracle."""
    import torch.distributed as dist

    seq_len, layout = 16 * world_size, "zigzag"
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, seq_len, 8, generator=g, dtype=torch.float64) for _ in range(4))
    errors = {}
    for name in score_ignoring_mods(seq_len, None):
        bias, ring_bias = (torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True) for _ in range(2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = attention(*full, *score_ignoring_mods(seq_len, bias)[name])
        want.backward(dout)
        want = [want.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in (*full, bias)]
        local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
        score_mod, mask_mod = score_ignoring_mods(seq_len, ring_bias)[name]
        out = ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod, layout=layout,
                                           backend="reference")
        out.backward(ringflex.shard(dout, 2, layout=layout))
        d_bias = torch.zeros_like(ring_bias) if ring_bias.grad is None else ring_bias.grad
        dist.all_reduce(d_bias)
        got = [ringflex.unshard(t.contiguous(), 2, layout=layout) for t in (out.detach(), *(t.grad for t in local))]
        errors[name] = [((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()
                        for a, b in zip(got + [d_bias], want)]
    return errors


def test_score_mods_that_ignore_the_score_get_their_gradients():
    """dq = dk = 0 where the result ignores the score, instead of an autograd error that
    fails the ring for the process group."""
    for rank, errors in enumerate(run_world(2, _score_ignoring_errors)):
        failures = {name: errs for name, errs in errors.items() if max(errs) > 1e-10}
        assert not failures, f"rank {rank}: out/dq/dk/dv/dbias errors {failures}"
