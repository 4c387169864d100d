"""The examples as users run them: launched with torchrun on CPU ranks (gloo) at tiny sizes, each
against the same script in one process, which runs the plain model -- examples/train_example.py
(2 ranks), examples/hf_finetune.py (transformers' Trainer; a ring of 2, and 2 replicas x a ring
of 2 against one process accumulating 2 rows a step) and examples/fsdp_cp.py (FSDP2 x context
parallel on a 2 x 2 mesh)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(script: str, args, ranks: int, cwd: Path) -> str:
    """The script's output (stdout and stderr), launched by torchrun with ``ranks`` processes, or
    as a plain python script where ``ranks`` is 1."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(launcher + [str(EXAMPLES / script), *map(str, args)], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=280)
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_train_example_help_shows_defaults_and_every_backend():
    text = subprocess.run([sys.executable, str(EXAMPLES / "train_example.py"), "--help"], capture_output=True,
                          text=True, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    assert "{auto,cudnn,flex,reference}" in text
    assert "(default: 300)" in text and "(default: auto)" in text
    assert "(default: the sharding ringflex.shard_by_mask chooses" in " ".join(text.split())


def test_train_example_under_torchrun_matches_one_process(tmp_path):
    small = ["--steps", 3, "--batch", 2, "--seq-len", 32, "--dim", 32, "--progress-every", 0]
    ring = _run("train_example.py", small + ["--out", "ring.json"], 2, tmp_path)
    _run("train_example.py", small + ["--out", "single.json"], 1, tmp_path)
    progress = [line for line in ring.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["1/3", "2/3", "3/3"], ring
    assert "nan" not in ring and "tok_s" not in progress[0] and "tok_s=" in progress[1], progress
    assert re.search(r"done: 3 steps, world size 2, final loss \S+, \d+ tokens/s", ring), ring
    losses = [json.loads((tmp_path / name).read_text())["losses"] for name in ("ring.json", "single.json")]
    assert max(abs(a - b) / b for a, b in zip(*losses)) < 1e-12, losses


def test_train_example_with_one_step_reports_no_throughput(tmp_path):
    out = _run("train_example.py", ["--steps", 1, "--batch", 1, "--seq-len", 16, "--dim", 16, "--out", "one.json"], 1,
               tmp_path)
    assert "nan" not in out and "tokens/s from step 2 on" in out, out
    assert json.loads((tmp_path / "one.json").read_text())["tokens_per_s"] is None


def _held_out(out: str):
    """(losses Trainer logged, the held-out loss printed in full)."""
    logged = [float(x) for x in re.findall(r"^step \d+/\d+  loss=(\S+)", out, re.M)]
    return logged, float(re.search(r"held-out loss (\S+)", out).group(1))


@pytest.mark.parametrize("ranks,cp", [(2, 2), (4, 2)])
def test_hf_trainer_example_matches_one_process(ranks, cp, tmp_path):
    """Trainer with a ringflex-wrapped tiny Llama on packed documents: the held-out loss of the
    trained model as one process with transformers' own attention trains it (a data-parallel
    replica per ring: one process accumulates the rows the replicas read in a step)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    small = ["--steps", 3, "--rows", 8, "--seq-len", 32, "--hidden", 32]
    ring = _run("hf_finetune.py", small + ["--cp", cp], ranks, tmp_path)
    single = _run("hf_finetune.py", small + ["--accumulate", ranks // cp], 1, tmp_path)
    assert f"{ranks // cp} x a ring of {cp}" in ring, ring
    (ring_logged, ring_loss), (single_logged, single_loss) = _held_out(ring), _held_out(single)
    assert len(ring_logged) == 3 and ring_logged == single_logged, (ring_logged, single_logged)
    assert abs(ring_loss - single_loss) < 1e-9 * single_loss, (ring_loss, single_loss)


def test_fsdp_cp_example_on_a_2x2_mesh_matches_one_process(tmp_path):
    """FSDP2 over the flattened (dp, cp) mesh, the ring over cp, 4 CPU ranks."""
    small = ["--steps", 3, "--batch", 2, "--seq-len", 16, "--dim", 16, "--progress-every", 0]
    ring = _run("fsdp_cp.py", small, 4, tmp_path)
    single = _run("fsdp_cp.py", small, 1, tmp_path)
    assert "(2 dp x 2 cp)" in ring and "(one process)" in single
    losses = [[float(x) for x in re.search(r"losses (.*)", out).group(1).split()] for out in (ring, single)]
    assert len(losses[0]) == 3 and max(abs(a - b) / b for a, b in zip(*losses)) < 1e-12, losses
