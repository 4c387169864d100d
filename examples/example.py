"""A ring of processes computes causal, softcapped attention over one long sequence and checks
it against one process computing the whole sequence.

    torchrun --nproc_per_node=4 examples/example.py                    # CPU, gloo
    torchrun --nproc_per_node=2 examples/example.py --device cuda      # GPUs, NCCL
"""
import argparse
import os

import torch
import torch.distributed as dist

import ringflex
import ringflex.training
from ringflex import mods


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layout", default="zigzag", choices=ringflex.LAYOUTS)
    args = parser.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    device, dtype = (("cuda", torch.bfloat16) if args.device == "cuda" else ("cpu", torch.float32))

    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v = (torch.randn(1, args.heads, args.seq_len, args.head_dim, device=device, dtype=dtype) for _ in range(3))
    score_mod, mask_mod = mods.softcap(30.0), mods.causal

    local = [ringflex.shard(t, dim=2, layout=args.layout).requires_grad_() for t in (q, k, v)]
    out = ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod, layout=args.layout)
    out.sum().backward()
    full_out = ringflex.unshard(out.detach(), dim=2, layout=args.layout)

    if rank == 0:
        from ringflex.kernels.base import Mods
        from ringflex.kernels.reference import ReferenceKernel
        from ringflex.plan.layout import Segment
        whole = Segment(0, 1, args.seq_len)
        expected, *_ = ReferenceKernel().forward(q, k, v, whole, whole, Mods(score_mod, mask_mod),
                                                args.head_dim ** -0.5, masked=True)
        err = (full_out.float() - expected.float()).abs().max().item()
        print(f"world size {dist.get_world_size()}, {args.seq_len} tokens, layout {args.layout}: "
              f"max |ring - single process| = {err:.2e}; dq norm on rank 0 = {local[0].grad.float().norm():.4f}")
    ringflex.training.destroy_process_group()


if __name__ == "__main__":
    main()
