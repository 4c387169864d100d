"""Makes the tests' shared code and the repository's scripts importable: ``tests/`` (this
folder, for ``support``, also from ``tests/gpu/``) and the repository root (for ``tools``,
``benchmarks`` and ``examples``) are on sys.path while the tests run."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (pyproject's marker) are skipped where torch sees no CUDA device."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
