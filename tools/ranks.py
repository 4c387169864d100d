"""How the tools join their ranks under torchrun: a GPU per rank over NCCL, or, where
the ranks outnumber the GPUs, ranks sharing them over gloo (NCCL refuses ranks that share a
GPU; ringflex's copy-engine transport carries their ring, through CUDA IPC)."""
from __future__ import annotations

import os
from typing import List, Sequence

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


def max_over_ranks(values: Sequence[float], device: torch.device, group=None) -> List[float]:
    """Each of ``values``' maximum over the ranks (on the CPU over gloo, on ``device`` over NCCL)."""
    t = torch.tensor(values, dtype=torch.float64, device="cpu" if dist.get_backend(group) == "gloo" else device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def launch(run, args) -> None:
    """``run(args)`` on this process's ranks (``init`` for ``args.device``), the process group
    destroyed after, whatever ``run`` raised: a script's ``main``."""
    init(args.device)  # ranks sharing a GPU (a smoke test on one) run over gloo
    try:
        run(args)
    finally:
        dist.destroy_process_group()
