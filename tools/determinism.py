"""Are two identical calls bitwise identical? Per backend, forward and backward, as a markdown table.

    python -m tools.determinism --device cuda --backends reference cudnn   # one GPU
    torchrun --nproc_per_node=2 -m tools.determinism --device cuda --backends cudnn
    python -m tools.determinism                                                # CPU, reference
    python -m tools.determinism --device cuda --backends cudnn --deterministic # cuDNN without atomics

(from the repository root)

The ring itself fixes the order of every sum (hops, merges, dK/dV round the ring), so a call
is bitwise repeatable exactly when its kernel is. Each problem runs ``--runs`` times (3); the
table gives the largest difference between the first run and a later one (0 means bitwise
equal) and the fastest later run's time (rank 0's, the device drained before and after).
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist

import ringflex
from ringflex import mods
from tools import ranks


def problems(seq_len, device):
    doc_ids = mods.document_ids([seq_len // 4, seq_len // 8, seq_len // 2, seq_len // 8], device=device)
    return {"no_mask": (None, None), "causal": (None, mods.causal),
            "documents": (None, mods.document(doc_ids)), "causal_softcap": (mods.softcap(30.0), mods.causal)}


def run(q, k, v, dout, score_mod, mask_mod, backend):
    """out, dq, dk, dv of one fwd+bwd, and its wall time in ms (the device drained before and after)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    out = ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend=backend)
    out.backward(dout)
    sync()
    return [out.detach(), q.grad, k.grad, v.grad], (time.perf_counter() - start) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", nargs="+", default=["reference"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--local-len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="calls per problem (at least 2)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True): cuDNN's backward then sums dQ without atomics")
    args = parser.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode (reference kernel)
        torch.use_deterministic_algorithms(True)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        device = ranks.init(args.device)
    else:
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)
    rank = dist.get_rank() if world_size > 1 else 0
    seq_len = args.local_len * world_size
    if rank == 0:
        print(f"{world_size} rank(s), {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
              f"torch {torch.__version__}, S={seq_len} H={args.heads} D={args.head_dim}"
              f"{', deterministic algorithms' if args.deterministic else ''}\n")
        print("| backend | dtype | problem | out | dq | dk | dv | fwd+bwd ms |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(0)
    for backend in args.backends:
        for dtype in (getattr(torch, d) for d in args.dtypes):
            if backend == "cudnn" and dtype == torch.float32:
                continue  # the cuDNN kernel takes fp16 / bf16 only
            full = [torch.randn(1, args.heads, seq_len, args.head_dim, generator=g).to(dtype) for _ in range(4)]
            q, k, v, dout = (ringflex.shard(t, 2).to(device) for t in full)
            for name, (score_mod, mask_mod) in problems(seq_len, device).items():
                first, _ = run(q, k, v, dout, score_mod, mask_mod, backend)
                diffs, ms = [0.0] * 4, math.inf
                for _ in range(args.runs - 1):
                    again, took = run(q, k, v, dout, score_mod, mask_mod, backend)
                    diffs = [max(d, (a.float() - b.float()).abs().max().item()) for d, a, b in zip(diffs, first, again)]
                    ms = min(ms, took)
                if world_size > 1:
                    diffs = ranks.max_over_ranks(diffs, device)
                if rank == 0:
                    cells = " | ".join("0" if d == 0 else f"{d:.2e}" for d in diffs)
                    print(f"| {backend} | {str(dtype).replace('torch.', '')} | {name} | {cells} | {ms:.2f} |", flush=True)
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
