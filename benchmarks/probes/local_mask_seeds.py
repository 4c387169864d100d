"""Given seeds of ``tests/support/random_calls.local_mask_call`` run on the GPU, in bf16,
against fp64 on the CPU, outside ``tools/fuzz_ring.py`` (run with torchrun; ranks may share a
GPU): which of the fuzz's surroundings a failure of its needs.

    SEEDS="27000 27001" torchrun --nproc_per_node=3 -m benchmarks.probes.local_mask_seeds

NEWGROUP=1: the ring on a group made for it, as the fuzz's; SUBGROUPS=1: one-rank subgroups
made too; FREE=1: ``weigh_cudnn_calls_as_free``; TOGETHER=1: the ranks start each call
together (a gloo all_reduce first).
"""
import os

import torch
import torch.distributed as dist

from tests.support.harness import weigh_cudnn_calls_as_free
from tests.support.random_calls import local_mask_call, ring_errors
from tools import ranks


def main():
    device = ranks.init("cuda")
    group = dist.new_group(backend=dist.get_backend()) if os.environ.get("NEWGROUP") else None
    if os.environ.get("SUBGROUPS"):
        dist.new_subgroups(1)
    if os.environ.get("FREE"):
        weigh_cudnn_calls_as_free()
    for seed in [int(s) for s in os.environ["SEEDS"].split()]:
        call = local_mask_call(seed, dist.get_world_size(), device, torch.bfloat16)
        if os.environ.get("TOGETHER"):
            dist.all_reduce(torch.tensor([0]))
        try:
            errors = ring_errors(call, local_mask_call(seed, dist.get_world_size(), values_of=torch.bfloat16),
                                 "auto", group, floor=0.1)
        except Exception as e:  # noqa: BLE001 (printed; the other ranks may wait on this GPU: end at once)
            print("rank", dist.get_rank(), "seed", seed, "FAILED", str(e)[:80], flush=True)
            os._exit(1)
        print("rank", dist.get_rank(), "seed", seed, {k: round(v, 4) for k, v in errors.items()}, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
