"""Device allocations per ring call once warm (torch's caching allocator statistics), per
mask and layout (run with torchrun; ranks may share a GPU).

    torchrun --nproc_per_node=4 -m benchmarks.probes.device_allocations --seq-len 32768 \
        --cases window:zigzag window:contiguous documents:zigzag causal:zigzag

Each rank prints, per fwd+bwd call over ``--calls`` calls after ``--warmup``, the device
allocations and frees (cudaMalloc / cudaFree: host time each, and memory reserved for good),
the allocator's retries and the tensors allocated. ``--drained`` issues each call on a
drained GPU: calls issued back to back may take new memory while the host runs ahead, as a
block that a side stream still reads (``record_stream``) is held until the GPU gets there.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.common import make_mods
from tools.ranks import init
import ringflex

STATS = {"num_device_alloc": "device allocations", "num_device_free": "device frees",
         "num_alloc_retries": "retries", "allocation.all.allocated": "tensors allocated"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--cases", nargs="+", default=["window:zigzag", "window:contiguous", "causal:zigzag"],
                   help="mask:layout")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--drained", action="store_true", help="each call on a drained GPU")
    args = p.parse_args()
    device = init()
    for case in args.cases:
        mask, layout = case.split(":")
        score_mod, mask_mod = make_mods(mask, args.seq_len, device, 4096, 4096)
        torch.manual_seed(0)
        q, k, v = (ringflex.shard(torch.randn(1, 32, args.seq_len, 128, device=device, dtype=torch.bfloat16), 2,
                                  layout=layout).requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)

        def call():
            ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, layout=layout).backward(dout)
            if args.drained:
                torch.cuda.synchronize()

        for _ in range(args.warmup):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        before = torch.cuda.memory_stats()
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        per_call = ", ".join(f"{name} {(after.get(key, 0) - before.get(key, 0)) / args.calls:g}"
                             for key, name in STATS.items())
        print(f"rank {dist.get_rank()}, {case}, per call: {per_call}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
