"""What the parts of the cuDNN kernel share: the frontend (imported lazily), a handle per
device, cuDNN's tile and the size of the plan caches."""
from __future__ import annotations

import sys
from typing import Dict

import torch

TILE = 64  # cuDNN's tile: sub-block sizes are multiples of it
MAX_PLANS = 256  # entries kept by each cache of plans, lowerings and batchings (LRU)

_HANDLES: Dict[int, object] = {}


def cudnn():
    """The cuDNN frontend module (an optional dependency: imported on first use only)."""
    import cudnn as frontend

    return frontend


def handle(device: torch.device):
    """The device's cuDNN handle, bound to its current stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn().create_handle()
    bound = _HANDLES[index]
    cudnn().set_stream(handle=bound, stream=torch.cuda.current_stream(index).cuda_stream)
    return bound


def destroy_handles() -> None:
    """Destroys every handle (at exit, after the graphs built on them)."""
    frontend = sys.modules.get("cudnn")
    for bound in _HANDLES.values():
        frontend.destroy_handle(bound)
    _HANDLES.clear()
