"""The current CUDA stream, and a switch to another, at the host cost of reading a handle.

``torch.cuda.current_stream`` builds a new Stream object at every call, and ``torch.cuda.stream``
builds two; a ring call asks a few dozen times, on the host's path that the GPUs wait for where
the hops are short. A stream is known by its raw handle, which torch reads without building
anything (as ``kernels.launch`` reads it), so each stream is wrapped once and kept."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

_WRAPPED: Dict[Tuple[int, int], torch.cuda.Stream] = {}  # (device index, raw handle) -> its Stream


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, the same object each time a stream is current."""
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = _WRAPPED.get(key)
    if stream is None:
        stream = _WRAPPED[key] = torch.cuda.current_stream(index)
    return stream


class on_stream:
    """``torch.cuda.stream(stream)``: work queued inside goes to ``stream`` (None: no switch), and
    the stream current on its device before, and the current device, are restored on exit."""

    def __init__(self, stream: Optional[torch.cuda.Stream]):
        self.stream = stream

    def __enter__(self) -> None:
        if self.stream is not None:
            self.device = torch.cuda.current_device()
            self.previous = current_stream(self.stream.device)
            torch.cuda.set_stream(self.stream)  # makes the stream's device current

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            torch.cuda.set_stream(self.previous)
            if self.device != self.previous.device_index:
                torch.cuda.set_device(self.device)
