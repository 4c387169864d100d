"""The fused merge's Triton kernels (``kernels/fused_kernels.py``) run on the CPU in Triton's
interpreter, where Triton is installed (torch's CPU builds do not ship it: skipped there;
tests/gpu/test_fused_merge.py compiles and runs them on a GPU). Two sums in one launch (a
block's dK and dV) give bit for bit what each sum gives alone, and are exact in fp32; the
merge gives torch's merge's numbers; ring calls whose merges and sums all go through the
kernels give the definition's numbers."""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent("""
    import math
    import torch
    from support.interpreted import fused_on_the_cpu
    from support.two_ranges import mismatches
    from ringflex.kernels import fused_merge
    from ringflex.kernels.merge import merge_in_torch, merge_parts

    launches = fused_on_the_cpu()
    g = torch.Generator().manual_seed(0)
    wrong = []
    for dtype in (torch.bfloat16, torch.float32):
        for count in (1, 2, 3, 4):
            for dims, length in (((128, 128), 100), ((192, 128), 33), ((64, 80), 7)):
                parts = [[torch.randn(2, 3, length + 5, dim, generator=g).to(part_dtype).narrow(2, 2, length)
                          for _ in range(count)] for dim, part_dtype in zip(dims, (torch.float32, torch.bfloat16))]
                together = [torch.zeros(p[0].shape, dtype=dtype) for p in parts]
                fused_merge.add(together[0], parts[0], beside=(together[1], parts[1]))
                for d, p in zip(together, parts):
                    alone = torch.ones_like(d)
                    fused_merge.add(alone, p)
                    exact = dtype == torch.bfloat16 or torch.allclose(d, sum(t.float() for t in p), atol=1e-6)
                    if not (torch.equal(d, alone) and exact):
                        wrong.append((dtype, count, dims, length))
    if launches.count("sum_pairs") != 24 or launches.count("sum_parts") != 48:
        wrong.append(("launches", launches.count("sum_pairs"), launches.count("sum_parts")))
    # merges of two to four parts, each with or without a res, rows that see no key among them
    for count in (2, 3, 4):
        for with_res in (False, True):
            shape = (2, 3, 37, 64)
            parts = []
            for i in range(count):
                lse = torch.randn(shape[:3], generator=g) * 4
                lse[:, :, i::5] = -math.inf
                res = torch.randn(shape[:3], generator=g) * 1e-3 if with_res and i % 2 else None
                parts.append((torch.randn(shape, generator=g), lse, res))
            got, got_lse, got_res = torch.empty(shape), torch.empty(shape[:3]), torch.empty(shape[:3])
            want, want_lse, want_res = torch.empty(shape), torch.empty(shape[:3]), torch.empty(shape[:3])
            merge_parts(got, parts, got_lse, got_res)
            merge_in_torch(want, parts, want_lse, want_res)
            close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=False)
                        for a, b in ((got, want), (got_lse.nan_to_num(-1e30), want_lse.nan_to_num(-1e30)),
                                     (got_res, want_res)))
            if not close or not torch.equal(got_lse.isneginf(), want_lse.isneginf()):
                wrong.append(("merge", count, with_res))
    # two ranges of rows of the same tensors in one launch (a joined call's results), as each alone
    wrong += mismatches(((3, 20), (50, 33)), (1, 2, 4), "cpu", g)
    print("wrong", wrong)
""")


def _interpreted(script: str, timeout: float, **env) -> subprocess.CompletedProcess:
    """``script`` run by a fresh Python with Triton's interpreter on (it must be set before
    Triton is imported), the repository and its tests importable; skips where Triton is not
    installed."""
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU builds do not ship it)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, cwd=root,
                          env=dict(os.environ, TRITON_INTERPRET="1", **env,
                                   PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")])))


def test_the_kernels_in_the_interpreter():
    """Two sums in one launch as each alone; merges of two to four parts, with and without a
    res, rows that see no key among them, as torch's merge; merges, sums and pairs of sums over
    two ranges of rows in one launch as over each range alone."""
    done = _interpreted(CHECK, 600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "wrong []", done.stdout


RING = textwrap.dedent("""
    from support.harness import run_world
    from support.interpreted import interpreted_failures
    for failures, launches in run_world(3, interpreted_failures, 6, timeout=900):
        print("failures", failures)
        print("launches", sorted(launches))
""")


def test_ring_calls_with_their_merges_and_sums_in_the_interpreted_kernels():
    """Local masks over zigzag (a rank's two neighbours: pairs of sums over two row ranges, and
    a joined step's results over two row ranges, merged in one launch) and random calls on the
    emulated cuDNN kernel over 3 ranks, every merge, sum and copy of rows in the fused kernels
    as on a GPU: the definition's numbers, forward and backward, and every kernel launched on
    every rank, over one range of rows and over two."""
    done = _interpreted(RING, 1200, RINGFLEX_LENDING="0")
    assert done.returncode == 0, done.stderr[-5000:]
    lines = done.stdout.strip().splitlines()
    assert [line for line in lines if line.startswith("failures")] == ["failures []"] * 3, done.stdout
    launched = [set(ast.literal_eval(line[len("launches "):])) for line in lines if line.startswith("launches")]
    assert len(launched) == 3 and all({"lse_merge", "sum_pairs", "sum_parts"} <= names for names in launched), done.stdout
    assert {"lse_merge over two ranges", "sum_pairs over two ranges"} <= set.union(*launched), done.stdout


HOST_WORK = textwrap.dedent("""
    import sys
    from benchmarks.probes import host_work
    sys.argv = ["host_work", "--world-size", "3", "--cases", "window:zigzag", "window:contiguous",
                "--tokens-per-rank", "256"]
    host_work.main()
""")


def test_host_work_counts_a_calls_launches_and_transfers():
    """``benchmarks/probes/host_work.py`` over 3 CPU ranks: each rank's transfers, cuDNN calls
    and launches per call; a window over zigzag merges a rank's joined step (both neighbours'
    rows) in one launch over two row ranges, over contiguous there is nothing to pair."""
    done = _interpreted(HOST_WORK, 900)
    assert done.returncode == 0, done.stderr[-5000:]
    zigzag, contiguous = done.stdout.split("window:contiguous")
    rows = {line.split("  ")[1].strip(): line.split()[-3:] for line in zigzag.splitlines()[1:] if line.startswith("  ")}
    assert rows["transfers"] == ["4", "4", "4"] and rows["cuDNN calls"] == ["4", "4", "4"], done.stdout
    assert "1" in rows["lse_merge over two ranges"], done.stdout
    assert "over two ranges" not in contiguous and "transfers" in contiguous, done.stdout
