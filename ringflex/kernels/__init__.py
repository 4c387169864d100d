"""Per-hop attention kernels behind one interface (``base.HopKernel``), and the choice among them."""
from __future__ import annotations

from typing import Optional, Tuple

from ..config import warn_once
from .base import HopKernel, Mods
from .reference import ReferenceKernel

BACKENDS = ("auto", "cudnn", "reference", "flex")  # what ``backend`` may name
_TENSOR_GRADS = "the score_mod reads a tensor that requires grad, and cuDNN's fused backward gives no gradient for it"


def cudnn_reason(q, k, v, mods, lengths) -> Optional[str]:
    """Why the cuDNN kernel cannot run this call, or None if it can."""
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    try:
        from .cudnn import cudnn_unavailable_reason
    except ImportError as e:  # the optional extra is missing
        return f"nvidia-cudnn-frontend is not installed ({e}); pip install 'ringflex[cudnn]'"
    return cudnn_unavailable_reason(q, k, v, mods, lengths)


def select_kernel(backend: str, q, k, v, mods: Mods, tensor_grads: bool = False,
                  lengths: Optional[Tuple[int, int]] = None) -> HopKernel:
    """The kernel for ``backend``. "auto" prefers cuDNN; on a GPU where cuDNN cannot run the
    call it takes flex_attention, else the reference kernel, and says once why.
    ``tensor_grads``: the score_mod reads tensors that require grad
    (``mod.trace.tensors_requiring_grad``); ``lengths``: the global query and key lengths whose
    positions the mods see (default: q's and k's own)."""
    if backend in ("cudnn", "auto"):
        reason = _TENSOR_GRADS if tensor_grads else cudnn_reason(q, k, v, mods, lengths)
        if reason is None:
            from .cudnn import CudnnKernel
            return CudnnKernel()
        if backend == "cudnn":
            raise ValueError(f"backend='cudnn' cannot run this call: {reason}")
        if not q.is_cuda:
            return ReferenceKernel()
    if backend in ("flex", "auto"):
        from .flex import FlexKernel, flex_unavailable_reason
        flex_reason = flex_unavailable_reason(q)
        if flex_reason is None:
            if backend == "auto":
                warn_once(f"ringflex: using flex_attention (compiled at its first call), not cuDNN: {reason}")
            return FlexKernel()
        if backend == "flex":
            raise ValueError(f"backend='flex' cannot run this call: {flex_reason}")
        warn_once(f"ringflex: using the slow reference kernel, not cuDNN: {reason}; nor flex_attention: {flex_reason}")
    return ReferenceKernel()
