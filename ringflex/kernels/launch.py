"""Triton kernels launched straight through their compiled launcher.

At every launch Triton's JIT binds each argument, works out what it specialises on (a
pointer's alignment, an integer's value or width), builds a cache key and looks it up: for
the fused merge's 25 to 55 arguments that takes several times the host time of the launcher
itself, and a ring call launches about ten. A call that is bound by its host (short
sequences, packed documents) waits for all of it. For the same
reason the device and its stream are read raw (``torch.cuda.current_stream`` builds a Python
object: a few us a launch).

``Launcher`` keeps, for each kernel, the compiled kernel of each specialisation it has
launched, keyed by what Triton specialises on, so that only the first launch of each goes
through the JIT. Where Triton launches differently (before 3.4: no ``triton.knobs``) or a
launch hook is set (a profiler's), every launch goes through the JIT, as before.
"""
from __future__ import annotations

import inspect
from typing import Dict, Sequence

import torch
from torch import Tensor

from ..config import warn_once

_INT32 = 1 << 31


def _knobs():
    """``triton.knobs`` (Triton 3.4 on), or None, said once: then every launch goes through the JIT."""
    try:
        from triton import knobs
    except ImportError:
        import triton
        warn_once(f"ringflex: Triton {triton.__version__} launches the fused merge through its JIT, about 30 us "
                  "more host time per launch than Triton 3.4 or newer, which ringflex launches directly")
        return None
    return knobs


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _current_stream(device: int) -> int:
    """The device's current stream, raw (``torch.cuda.current_stream`` makes a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _set(hook) -> bool:
    """Whether a launch hook is set: a function, or a chain of them (Triton 3.5 on) not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """``launch(grid, args, constants)`` of one ``triton.jit`` function whose arguments are
    ``args`` (tensors and ints, in order) and then ``constants`` (its ``tl.constexpr``
    parameters, in order); ``free``: the names of its integers Triton does not specialise on
    (``do_not_specialize``), whose width alone it compiles for."""

    def __init__(self, kernel, free: Sequence[str], num_warps: int):
        self.kernel, self.num_warps = kernel, num_warps
        names = list(inspect.signature(kernel.fn).parameters)
        self.free = frozenset(names.index(n) for n in free)
        self.names = names
        self.compiled: Dict[tuple, object] = {}
        self.tensors = self.ints = None  # the positions of the tensor and specialised integer arguments
        self.knobs = _knobs()

    def _key(self, args: Sequence, constants: tuple) -> tuple:
        """What the compiled kernel depends on, as Triton specialises: each pointer's dtype and
        16-byte alignment, each specialised integer's value, the other integers' width."""
        if self.tensors is None:  # where the tensors and integers are: the same at every launch
            self.tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
            self.ints = [i for i, a in enumerate(args) if i not in self.free and not isinstance(a, Tensor)]
        return (_current_device(), constants, *[(args[i].dtype, args[i].data_ptr() % 16 == 0) for i in self.tensors],
                *[args[i] for i in self.ints], all(-_INT32 <= args[i] < _INT32 for i in self.free))

    def launch(self, grid, args: Sequence, constants: dict) -> None:
        values = tuple(constants.values())
        hooked = self.knobs is None or _set(self.knobs.runtime.launch_enter_hook) or _set(
            self.knobs.runtime.launch_exit_hook)
        key = None if hooked else self._key(args, values)
        compiled = self.compiled.get(key) if key is not None else None
        if compiled is None:
            if self.names[len(args):] != list(constants):
                raise ValueError(f"ringflex: {self.kernel.fn.__name__} takes its constants in the order "
                                 f"{self.names[len(args):]}, given {list(constants)}")
            compiled = self.kernel[grid](*args, **constants, num_warps=self.num_warps)
            if key is not None:
                self.compiled[key] = compiled
            return
        compiled.run(grid[0], grid[1], 1, _current_stream(key[0]), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *values)
