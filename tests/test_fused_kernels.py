"""The fused merge's Triton kernels (``kernels/fused_kernels.py``) run on the CPU in Triton's
interpreter, where Triton is installed (torch's CPU builds do not ship it: skipped there;
tests/gpu/test_fused_merge.py compiles and runs them on a GPU). Two sums in one launch (a
block's dK and dV) give bit for bit what each sum gives alone, and are exact in fp32; ring
calls whose merges and sums all go through the kernels give the definition's numbers."""
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent("""
    import torch
    from ringflex.kernels import fused_merge

    def launch(kernel, grid_arguments):
        grid, arguments, constants = grid_arguments
        fused_merge._kernels()[kernel].kernel[grid](*arguments, **constants, num_warps=4)

    g = torch.Generator().manual_seed(0)
    wrong = []
    for dtype in (torch.bfloat16, torch.float32):
        for count in (1, 2, 3, 4):
            for dims, length in (((128, 128), 100), ((192, 128), 33), ((64, 80), 7)):
                parts = [[torch.randn(2, 3, length + 5, dim, generator=g).to(part_dtype).narrow(2, 2, length)
                          for _ in range(count)] for dim, part_dtype in zip(dims, (torch.float32, torch.bfloat16))]
                together = [torch.zeros(p[0].shape, dtype=dtype) for p in parts]
                tensors = [t for d, p in zip(together, parts) for t in fused_merge._padded(p) + [d]]
                launch(2, fused_merge._pair_arguments(tensors, count))
                for d, p in zip(together, parts):
                    alone = torch.ones_like(d)
                    launch(1, fused_merge._add_arguments(fused_merge._padded(p) + [alone], count))
                    exact = dtype == torch.bfloat16 or torch.allclose(d, sum(t.float() for t in p), atol=1e-6)
                    if not (torch.equal(d, alone) and exact):
                        wrong.append((dtype, count, dims, length))
    print("wrong", wrong)
""")


def test_two_sums_in_one_launch_as_each_alone_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU builds do not ship it)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=600, cwd=root,
                          env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root))
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
    """Local masks over zigzag (a rank's two neighbours: pairs of sums over two row ranges) and
    random calls on the emulated cuDNN kernel over 3 ranks, every merge, sum and copy of rows in
    the fused kernels as on a GPU: the definition's numbers, forward and backward, and every
    kernel launched on every rank."""
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU builds do not ship it)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", RING], capture_output=True, text=True, timeout=1200, cwd=root,
                          env=dict(os.environ, TRITON_INTERPRET="1", RINGFLEX_LENDING="0",
                                   PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")])))
    assert done.returncode == 0, done.stderr[-5000:]
    lines = done.stdout.strip().splitlines()
    assert [line for line in lines if line.startswith("failures")] == ["failures []"] * 3, done.stdout
    assert [line for line in lines if line.startswith("launches")] == [
        "launches ['lse_merge', 'sum_pairs', 'sum_parts']"] * 3, done.stdout
