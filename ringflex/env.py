"""``python -m ringflex.env``: versions, devices and which attention kernels can run here, and why not.

Paste its output into bug reports: most "slow" or "unsupported" reports come down to a
missing optional package or a CPU build of torch.
"""
from __future__ import annotations

import platform
from importlib import metadata
from typing import Dict, Optional

import torch
import torch.distributed as dist

from . import __version__, config
from .kernels import cudnn_reason
from .kernels.flex import flex_unavailable_reason
from .kernels.base import Mods
from .parallel import peer


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> Dict[str, str]:
    """Versions of ringflex, Python, torch, CUDA, cuDNN and the cuDNN frontend."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "ringflex": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda or "none (CPU build)",
        "cudnn (torch)": str(cudnn) if cudnn else "unavailable",
        "nvidia-cudnn-frontend": _package_version("nvidia-cudnn-frontend"),
        "transformers": _package_version("transformers"),
    }


def devices() -> Dict[str, str]:
    """CUDA devices, torch.distributed backends, what can carry the ring's transfers, and lending."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    engines = peer.local_reason(torch.device("cuda", 0)) if gpus else "no CUDA device"
    return {"cuda devices": ", ".join(gpus) or "none",
            "distributed backends": ", ".join(backends) if dist.is_available() else "torch.distributed unavailable",
            "copy engines": "available (GPUs of one host)" if engines is None else f"unavailable: {engines}"}


def backends() -> Dict[str, Optional[str]]:
    """Kernel name -> None if it can run a plain bf16 call here, else the reason it cannot."""
    if not torch.cuda.is_available():
        no_gpu = "no CUDA device (torch.cuda.is_available() is False)"
        return {"reference": None, "cudnn": no_gpu, "flex": no_gpu}
    q = torch.zeros(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    return {"reference": None, "cudnn": cudnn_reason(q, q, q, Mods(), None), "flex": flex_unavailable_reason(q)}


def report() -> str:
    lines = [f"{k:24s}{v}" for k, v in {**versions(), **devices()}.items()]
    lines.append("settings:")
    lines += [f"  {line}" for line in config.describe()] + [f"  error: {e}" for e in config.errors()]
    lines.append("kernels (backend=...):")
    lines += [f"  {name:22s}{'available' if reason is None else 'unavailable: ' + reason}"
              for name, reason in backends().items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
