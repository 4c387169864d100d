"""Ranks that ran the ring exit with status 0: no thread of ringflex's outlives its work into the
interpreter's exit (where it would abort the process), launched as a user launches a script.
Each run also looks for such threads once its calls return."""
import os
import subprocess
import sys
import textwrap

import pytest

RUNS = 10  # a thread left blocked in torch's C++ aborts every run; the repeats are for exits that race

SCRIPT = textwrap.dedent("""
    import sys, threading
    import torch, torch.distributed as dist
    import ringflex
    from ringflex import mods

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    q, k, v = (ringflex.shard(torch.randn(1, 2, 64, 16, dtype=torch.float64), dim=2).requires_grad_()
               for _ in range(3))
    for _ in range(2):
        ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal, backend="reference").sum().backward()
    left = [t.name for t in threading.enumerate() if t.name.startswith("ringflex")]
    if left:
        sys.exit(f"ringflex threads still running after the calls returned: {left}")
""")


# processes that each import torch take seconds apiece on a busy 2-core machine; a rank that
# hangs fails at its own 120 s below
@pytest.mark.timeout(600)
def test_two_ranks_exit_cleanly_every_time(tmp_path):
    script = tmp_path / "ring.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failures = []
    for run in range(RUNS):
        store = tmp_path / f"store{run}"
        ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(store)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
        for rank, process in enumerate(ranks):
            output, _ = process.communicate(timeout=120)
            if process.returncode != 0:
                failures.append(f"run {run} rank {rank}: exit status {process.returncode}\n{output[-2000:]}")
    assert not failures, "\n".join(failures)
