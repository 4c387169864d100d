"""A process that built cuDNN graphs with a score_mod exits without nanobind's report of
leaked instances: ringflex frees its graphs and handles before the interpreter tears down."""
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPT = textwrap.dedent("""
    import torch
    import ringflex
    from ringflex import mods
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = ringflex.ring_flex_attention(q, k, v, score_mod=mods.softcap(20.0), mask_mod=mods.causal, backend="cudnn")
    out.sum().backward()
    torch.cuda.synchronize()
    print("built")
""")


def test_no_leak_report_at_exit():
    pytest.importorskip("cudnn")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "built" in done.stdout, done.stderr
    assert "leaked" not in done.stderr, done.stderr
