"""What a score_mod cuDNN cannot run costs on one GPU: a T5-style relative bias
``table[h, clamp(q_idx - kv_idx, -128, 128) + 128]`` (a lookup by both positions), frozen and
learnable, fwd+bwd, on the flex_attention kernel (what ``auto`` takes) and on the reference
kernel (what it took before); for scale, causal+softcap on cuDNN and on flex_attention.

    python scripts/learnable_bias_cost.py
"""
from __future__ import annotations

import argparse
import time

import torch

import ringflex
from bench import timed  # scripts/ is on sys.path
from ringflex import mods


def relative_bias(table, max_distance):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(-max_distance, max_distance) + max_distance]
    return score_mod


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--backends", nargs="+", default=["flex", "reference"])
    args = p.parse_args()
    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, args.heads, args.seq_len, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    workloads = [(f"relative bias, table {'learnable' if learnable else 'frozen'}",
                  relative_bias(torch.zeros(args.heads, 257, device=dev, requires_grad=learnable), 128), args.backends)
                 for learnable in (False, True)]
    workloads.append(("softcap 30", mods.softcap(30.0), ["cudnn", "flex"]))
    for label, score_mod, backends in workloads:
        for backend in backends:
            def call():
                ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mods.causal,
                                             backend=backend).backward(dout)
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            iters = 2 if backend == "reference" else 20
            print(f"{label}, causal, {args.seq_len} tokens, {backend}: {1e3 * timed(call, iters, 1, dev):.2f} ms "
                  f"fwd+bwd (first call {first:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
