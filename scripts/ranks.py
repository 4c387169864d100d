"""How the GPU scripts join their ranks under torchrun: a GPU per rank over NCCL, or, where
the ranks outnumber the GPUs, ranks sharing them over gloo (NCCL refuses ranks that share a
GPU; ringflex's copy-engine transport carries their ring, through CUDA IPC)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init(device_type: str = "cuda") -> torch.device:
    """Sets this rank's device, initialises the default process group and returns the device."""
    if device_type != "cuda":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % gpus)
    dist.init_process_group("gloo" if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > gpus else "nccl")
    return torch.device("cuda", torch.cuda.current_device())
