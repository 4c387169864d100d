"""python -m ringflex.env reports versions and why each backend can or cannot run; Progress prints
the first and last step and at most one line per interval; the tools run; the test harness
shows where a hanging rank waits."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.harness import run_world
from ringflex import env
from ringflex.progress import Progress

ROOT = Path(__file__).resolve().parents[1]


def test_env_report():
    reasons = env.backends()
    assert reasons["reference"] is None
    if not torch.cuda.is_available():
        assert "CUDA" in reasons["cudnn"]
    run = subprocess.run([sys.executable, "-m", "ringflex.env"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for word in ("torch", torch.__version__, "nvidia-cudnn-frontend", "reference", "available"):
        assert word in run.stdout, word
    assert "RINGFLEX_LENDING=" in run.stdout and "RINGFLEX_TRANSPORT=" in run.stdout  # the settings
    if not torch.cuda.is_available():
        assert env.devices()["copy engines"] == "unavailable: no CUDA device"


def test_progress_lines():
    out = io.StringIO()
    progress = Progress(5, label="step", interval=3600, file=out, enabled=True)
    for step in range(1, 6):
        progress.update(step, loss=1.0 / step)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/5", "5/5"]
    assert "loss=0.2" in lines[-1] and "eta 0s" in lines[-1]
    quiet = io.StringIO()
    Progress(2, file=quiet, enabled=False).update(2)
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="positive number of steps"):
        Progress(0)


def test_determinism_script_reports_bitwise_repeats_on_cpu():
    """``python -m tools.determinism`` (reference kernel, one process): every cell 0, and a time."""
    out = subprocess.run([sys.executable, "-m", "tools.determinism", "--local-len", "32", "--heads", "1", "--head-dim",
                          "8", "--dtypes", "float32", "--runs", "2"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| reference")]
    assert len(rows) == 4 and all(cell.strip() == "0" for row in rows for cell in row[3:7])
    assert all(float(row[7]) > 0 for row in rows)


def test_balance_probe_plans_the_ranks_work_as_a_ring_call_does():
    """benchmarks/probes/balance_probe.py times each rank's planned hops on one GPU; its plans (here on
    the CPU) lend a window's corner rows to rank 0 only where lending is on, and keep every
    pair: the busiest rank's pairs fall to the mean."""
    from benchmarks.probes.balance_probe import rank_hops
    from ringflex import mods
    from ringflex.plan import lending

    mask = mods.sliding_window(256)
    work = {lend: rank_hops(mask, 2048, 2, "contiguous", lend, torch.device("cpu")) for lend in (False, True)}
    pairs = {lend: [sum(int(lending.pairs(mask, hop, "cpu").sum()) for hop, _ in hops) for hops in work[lend]]
             for lend in work}
    assert [owner for _, owner in work[True][0]] == [0, 0]  # rank 0: its own block, and the borrowed rows
    mean = sum(pairs[False]) / 2
    assert sum(pairs[True]) == 2 * mean and max(pairs[False]) > 1.06 * mean and max(pairs[True]) < 1.01 * mean, pairs


def _ring_passes(rank, world_size):
    from benchmarks.probes.ring_passes import Passes
    import ringflex
    from ringflex import mods

    passes = Passes()
    passes.install()
    q, k, v = (ringflex.shard(torch.randn(1, 2, 256, 8, generator=torch.Generator().manual_seed(i)), 2)
               .requires_grad_() for i in range(3))
    with passes:
        ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal, layout="zigzag").sum().backward()
    return passes.ops, passes.bytes


def test_ring_passes_lists_what_runs_outside_the_kernels():
    """benchmarks/probes/ring_passes.py lists a ring call's operations outside its hop kernels: the
    merges and gradient sums, none of the reference kernel's own (no matmul)."""

    for ops, moved in run_world(2, _ring_passes):
        assert any("merge_parts" in op for op in ops) and any("sum_parts" in op for op in ops), ops
        assert not any(op.startswith(("matmul", "mm", "bmm", "softmax", "_softmax")) for op in ops), ops
        assert moved > 0


def _fuzz(rank, world_size, argv):
    from tools import fuzz_ring
    return fuzz_ring.fuzz(fuzz_ring.parse_args(argv), torch.device("cpu"))


def _fuzz_printed(rank, world_size, argv):
    import contextlib
    import io
    from tools import fuzz_ring
    fuzz_ring.REPORT_EVERY_S = -1  # a report after every call
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        fuzz_ring.fuzz(fuzz_ring.parse_args(argv), torch.device("cpu"))
    return printed.getvalue()


def test_fuzz_script_reports_how_far_it_got_and_takes_the_sizes_given():
    """Rank 0 prints the calls run so far as it goes (a run cut short still says how far it
    got); ``--sizes`` sets the most chunks per rank of the random layouts."""
    argv = ["--device", "cpu", "--backend", "reference", "--no-gathers", "--seeds", "5", "2", "--sizes", "4"]
    printed = run_world(2, _fuzz_printed, argv)
    assert printed[0].splitlines()[-1].startswith("2 calls so far (0 failed), through seed 6"), printed[0]
    assert printed[1] == ""


def test_fuzz_script_weighs_calls_beyond_the_tolerance_against_the_reference_kernel():
    """``tools/fuzz_ring.py`` over two gloo ranks on the reference kernel, with a tolerance no
    bf16 call meets: every call is run again on the reference kernel and, whole, in each
    rank's process alone, which err as much, so none fails (and no rank is left waiting in a
    collective the other skipped)."""
    argv = ["--device", "cpu", "--backend", "reference", "--no-gathers", "--seeds", "0", "2", "--tolerance", "1e-9"]
    for ran, failed in run_world(2, _fuzz, argv):
        assert (ran, failed) == (2, [])


def test_fuzz_script_runs_local_masks_over_zigzag():
    """``--local-masks``: windows and packed documents over zigzag, which on three ranks read
    both neighbours, against the definition (on the reference kernel here)."""
    argv = ["--device", "cpu", "--backend", "reference", "--local-masks", "--seeds", "0", "3"]
    for ran, failed in run_world(3, _fuzz, argv):
        assert (ran, failed) == (3, [])


def _fuzz_on_a_broken_context(rank, world_size):
    import contextlib
    import io
    from tools import fuzz_ring

    class Ended(Exception):
        pass

    def broken(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: an illegal instruction was encountered")

    def exit_(code):
        raise Ended(code)

    fuzz_ring.ring_errors, fuzz_ring.os._exit = broken, exit_
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        try:
            fuzz_ring.fuzz(fuzz_ring.parse_args(["--device", "cpu", "--local-masks", "--seeds", "4", "3"]),
                           torch.device("cpu"))
        except Ended as e:
            return e.args[0], printed.getvalue()
    return None, printed.getvalue()


def test_fuzz_script_ends_when_a_call_breaks_the_cuda_context():
    """A call that breaks the rank's CUDA context (its other ranks may wait on this GPU for good)
    ends the run at once, exit code 1, naming the call's seed."""
    code, printed = run_world(1, _fuzz_on_a_broken_context)[0]
    assert code == 1
    assert printed.startswith("seed 4, rank 0: zigzag") and "illegal instruction" in printed, printed


def _hangs_on_rank_1(rank, world_size):
    if rank == 1:
        _waits_forever()
    return rank


def _waits_forever():
    import time
    while True:
        time.sleep(0.05)


def test_a_hanging_rank_fails_the_run_with_its_stacks():
    """The test harness's timeout names the ranks still running and shows where each waits."""
    with pytest.raises(TimeoutError) as raised:
        run_world(2, _hangs_on_rank_1, timeout=8)
    message = str(raised.value)
    assert message.startswith("ranks [1] did not finish within 8 s")
    assert "--- rank 1, shortly before the deadline" in message and "_waits_forever" in message


def test_check_ring_checks_the_sharding_shard_by_mask_chooses():
    """``tools.check_ring --layouts by-mask``: each case in ``shard_by_mask``'s sharding of its mask
    (striped for both here) and in the default layout, against one device, over a 2-rank CPU ring;
    cross-attention, whose keys have another length than a Sharding's, in the default layout only."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(launcher + ["-m", "tools.check_ring", "--device", "cpu", "--local-len", "16", "--layouts",
                                      "by-mask", "default", "--cases", "prefix_lm", "documents", "cross_no_mask"],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=280)
    assert done.returncode == 0, done.stdout
    lines = [line.split() for line in done.stdout.splitlines() if line.split()[-1:] in (["ok"], ["FAIL"])]
    assert [(case, layout.rstrip(":"), ok) for case, layout, *_, ok in lines] == [
        ("prefix_lm", "by-mask", "ok"), ("prefix_lm", "default", "ok"), ("documents", "by-mask", "ok"),
        ("documents", "default", "ok"), ("cross_no_mask", "default", "ok")], done.stdout
    assert "all cases within tolerance" in done.stdout
