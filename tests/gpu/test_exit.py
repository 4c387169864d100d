"""Processes exit without warnings: one that built cuDNN graphs with a score_mod without
nanobind's report of leaked instances (ringflex frees its graphs and handles before the
interpreter tears down), and ranks that shared a GPU's memory by CUDA IPC without torch's of
shared CUDA tensors still held at exit."""
import os
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


SHARING = textwrap.dedent("""
    import torch, torch.distributed as dist
    import ringflex
    from ringflex import mods
    from ringflex.parallel import peer
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 64, device="cuda:0") for _ in range(3))
    lq, lk, lv = (ringflex.shard(t, dim=2).requires_grad_() for t in (q, k, v))
    out = ringflex.ring_flex_attention(lq, lk, lv, mask_mod=mods.causal, backend="reference")
    out.sum().backward()
    torch.cuda.synchronize()
    assert peer.in_use(dist.group.WORLD, lq.device) == "copy-engine"
    print("ran")
    dist.destroy_process_group()
""")


def test_ranks_sharing_a_gpu_exit_without_warnings(tmp_path):
    """Two ranks on GPU 0 (mailboxes and receive buffers mapped by CUDA IPC) run a call and exit."""
    script = tmp_path / "sharing.py"
    script.write_text(SHARING)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, RINGFLEX_TRANSPORT="copy-engine"))
    assert done.returncode == 0 and done.stdout.count("ran") == 2, done.stderr
    for warning in ("Producer process", "Exception ignored", "Traceback"):
        assert warning not in done.stderr, done.stderr
