"""What a newcomer does first: the README's quickstart, pasted into a file and run on two CPU
processes, prints a small error; the wheel the project builds carries the whole package, its
license and type marker, and runs that quickstart without the source tree."""
import os
import re
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _quickstart() -> str:
    return re.search(r"^## Quickstart.*?^```python\n(.*?)^```", (ROOT / "README.md").read_text(),
                     re.S | re.M).group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(script: Path, pythonpath=None) -> list:
    """The script's output on rank 0, launched as torchrun would (env:// rendezvous)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    ranks = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in ranks]
    for p, output in zip(ranks, outputs):
        assert p.returncode == 0, output
    return outputs


def _error_printed(output: str) -> float:
    return float(re.search(r"max \|ring - one process\| = (\S+)", output).group(1))


def test_quickstart_runs_on_two_cpu_processes(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart())
    assert _error_printed(_run_two_ranks(script)[0]) < 1e-5


def test_wheel_carries_the_package_and_runs_the_quickstart(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("ringflex-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "ringflex").rglob("__init__.py")}
    assert {f"{p}/__init__.py" for p in packages} <= names
    assert "ringflex/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names), sorted(names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    script = tmp_path / "quickstart.py"
    script.write_text("import ringflex\nassert ringflex.__file__.startswith(%r), ringflex.__file__\n%s"
                      % (str(site), _quickstart()))
    assert _error_printed(_run_two_ranks(script, pythonpath=site)[0]) < 1e-5
