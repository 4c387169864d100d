"""What a learnable score_mod tensor costs on one GPU: a T5-style relative bias
``table[h, clamp(q_idx - kv_idx, -128, 128) + 128]`` (a lookup by both positions, which cuDNN
cannot run: the reference kernel either way), frozen and then learnable, fwd+bwd.

    python scripts/learnable_bias_cost.py
"""
from __future__ import annotations

import argparse

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
    args = p.parse_args()
    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, args.heads, args.seq_len, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    for learnable in (False, True):
        score_mod = relative_bias(torch.zeros(args.heads, 257, device=dev, requires_grad=learnable), 128)

        def call():
            ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mods.causal).backward(dout)

        print(f"relative bias, causal, {args.seq_len} tokens, table {'learnable' if learnable else 'frozen'}: "
              f"{1e3 * timed(call, 3, 1, dev):.1f} ms fwd+bwd", flush=True)


if __name__ == "__main__":
    main()
