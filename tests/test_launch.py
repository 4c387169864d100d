"""``kernels.launch.Launcher``: which launches go through Triton's JIT and which straight to the
compiled kernel's launcher, with what arguments. A stand-in kernel records the launches, so
this runs without Triton or a GPU (tests/gpu/test_fused_merge.py launches the real kernels)."""
import types

import pytest
import torch

from ringflex.kernels import launch
from ringflex.kernels.launch import Launcher


class _Compiled:
    """A compiled kernel: records what its launcher is given."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _Jit:
    """A ``triton.jit`` function: ``kernel[grid](*args, **constants)`` compiles (here: makes a
    ``_Compiled``) and launches."""

    def __init__(self, fn):
        self.fn, self.launches, self.compiled = fn, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]
        return launch


def _kernel(x, y, n, m, A, B):  # noqa: ARG001 - the signature is what the launcher reads
    pass


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 77)
    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(  # Triton 3.5 on: empty chains of hooks
        launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None))
    monkeypatch.setattr(launch, "_knobs", lambda: knobs)
    return Launcher(_Jit(_kernel), free=["n"], num_warps=4)


def _rows(n=64, dtype=torch.float32, offset=0):
    return torch.zeros(n + 8, dtype=dtype)[offset:offset + n]


def test_the_first_launch_of_a_specialisation_compiles_and_the_next_go_to_the_launcher(launcher):
    x, y = _rows(), _rows()
    launcher.launch((3, 5), (x, y, 10, 16), dict(A=1, B=2))
    assert len(launcher.kernel.launches) == 1
    grid, args, kwargs = launcher.kernel.launches[0]
    assert grid == (3, 5) and args == (x, y, 10, 16) and kwargs == dict(A=1, B=2, num_warps=4)
    x2, y2 = _rows(), _rows()
    launcher.launch((4, 6), (x2, y2, 11, 16), dict(A=1, B=2))  # new tensors and a new free integer
    assert len(launcher.kernel.launches) == 1
    assert launcher.kernel.compiled[0].runs == [(4, 6, 1, 77, "function", "metadata", None, None, None,
                                                 x2, y2, 11, 16, 1, 2)]


@pytest.mark.parametrize("change", ["unaligned", "dtype", "specialised integer", "wide free integer", "constant"])
def test_what_triton_specialises_on_compiles_anew(launcher, change):
    launcher.launch((1, 1), (_rows(), _rows(), 10, 16), dict(A=1, B=2))
    args, constants = [_rows(), _rows(), 10, 16], dict(A=1, B=2)
    if change == "unaligned":
        args[0] = _rows(offset=1)  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[1] = _rows(dtype=torch.float16)
    elif change == "specialised integer":
        args[3] = 17
    elif change == "wide free integer":
        args[2] = 1 << 31
    else:
        constants["B"] = 3
    launcher.launch((1, 1), tuple(args), constants)
    assert len(launcher.kernel.launches) == 2 and launcher.kernel.compiled[0].runs == []
    launcher.launch((1, 1), tuple(args), constants)  # and that specialisation is kept too
    assert len(launcher.kernel.launches) == 2 and len(launcher.kernel.compiled[1].runs) == 1


@pytest.mark.parametrize("hooks", ["enter chain", "exit function", "no knobs"])
def test_a_launch_hook_or_an_older_triton_sends_every_launch_through_the_jit(launcher, hooks):
    if hooks == "enter chain":
        launcher.knobs.runtime.launch_enter_hook.calls.append(print)
    elif hooks == "exit function":
        launcher.knobs.runtime.launch_exit_hook = print
    else:
        launcher.knobs = None
    for _ in range(3):
        launcher.launch((1, 1), (_rows(), _rows(), 10, 16), dict(A=1, B=2))
    assert len(launcher.kernel.launches) == 3 and launcher.compiled == {}


def test_constants_out_of_the_kernels_order_are_refused(launcher):
    with pytest.raises(ValueError, match=r"_kernel takes its constants in the order \['A', 'B'\]"):
        launcher.launch((1, 1), (_rows(), _rows(), 10, 16), dict(B=2, A=1))
