"""What the parts of the cuDNN kernel share: the frontend (imported lazily), a handle per
device, cuDNN's tile and the size of the plan caches."""
from __future__ import annotations

import sys
from typing import Dict

import torch

CUDNN_TILE = 64  # cuDNN's tile: the sizes of the row chunks it runs are multiples of it
MAX_PLANS = 256  # entries kept by each cache of plans, lowerings and batchings (LRU)

_HANDLES: Dict[int, list] = {}  # device index -> [handle, the raw stream it is bound to]


def cudnn():
    """The cuDNN frontend module (an optional dependency: imported on first use only)."""
    import cudnn as frontend

    return frontend


def handle(device: torch.device):
    """The device's cuDNN handle, bound to its current stream. Every kernel call asks for it:
    the stream is read raw (``torch.cuda.current_stream`` builds a Python object at every
    call) and bound only when it changed."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = [cudnn().create_handle(), None]
    entry = _HANDLES[index]
    stream = torch._C._cuda_getCurrentRawStream(index)
    if entry[1] != stream:
        cudnn().set_stream(handle=entry[0], stream=stream)
        entry[1] = stream
    return entry[0]


def destroy_handles() -> None:
    """Destroys every handle (at exit, after the graphs built on them)."""
    frontend = sys.modules.get("cudnn")
    for bound, _ in _HANDLES.values():
        frontend.destroy_handle(bound)
    _HANDLES.clear()
