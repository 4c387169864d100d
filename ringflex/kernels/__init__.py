"""Per-hop attention kernels behind one interface (``base.HopKernel``), and the choice among them."""
from __future__ import annotations

import warnings
from typing import Optional

from .base import HopKernel, Mods
from .reference import ReferenceKernel

_WARNED = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _cudnn_reason(q, k, v, mods) -> Optional[str]:
    """Why the cuDNN kernel cannot run this call, or None if it can."""
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    try:
        from .cudnn import cudnn_unavailable_reason
    except ImportError as e:  # the optional extra is missing
        return f"nvidia-cudnn-frontend is not installed ({e}); pip install 'ringflex[cudnn]'"
    return cudnn_unavailable_reason(q, k, v, mods)


def _flex_reason(q) -> Optional[str]:
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    try:
        from .flex import FlexKernel  # noqa: F401
    except ImportError as e:
        return f"torch flex_attention is unavailable ({e})"
    return None


def select_kernel(backend: str, q, k, v, mods: Mods) -> HopKernel:
    """The kernel for ``backend``; "auto" prefers cuDNN, then flex_attention, then the
    reference kernel, and says once why it did not take a faster one on a GPU."""
    if backend == "reference":
        return ReferenceKernel()
    if backend in ("cudnn", "auto"):
        reason = _cudnn_reason(q, k, v, mods)
        if reason is None:
            from .cudnn import CudnnKernel
            return CudnnKernel()
        if backend == "cudnn":
            raise ValueError(f"backend='cudnn' cannot run this call: {reason}")
        if q.is_cuda:
            _warn_once(f"ringflex: not using the cuDNN kernel: {reason}")
    if backend in ("flex", "auto"):
        reason = _flex_reason(q)
        if reason is None:
            from .flex import FlexKernel
            return FlexKernel()
        if backend == "flex":
            raise ValueError(f"backend='flex' cannot run this call: {reason}")
        if q.is_cuda:
            _warn_once(f"ringflex: using the slow reference kernel: {reason}")
    return ReferenceKernel()
