"""What a loss that reads the LSE costs, and attention sinks: fwd+bwd of ``ring_flex_attention``
on one GPU, the loss reading the output alone, the output and the LSE (a second backward call
per hop), and the output with sinks (none).

    python scripts/lse_cost.py --seq-len 16384 --masks none causal documents
"""
from __future__ import annotations

import argparse

import torch

import ringflex
from bench import make_mods, timed  # scripts/ is on sys.path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--masks", nargs="+", default=["none", "causal", "documents"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    dev = torch.device("cuda")
    for mask in args.masks:
        score_mod, mask_mod = make_mods(mask, args.seq_len, dev, 4096, 4096)
        q, k, v = (torch.randn(1, args.heads, args.seq_len, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout, dlse = torch.randn_like(q), torch.randn(q.shape[:3], device=dev)

        sinks = torch.zeros(args.heads, device=dev, requires_grad=True)

        def call(case: str):
            out, lse = ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True,
                                                    sinks=sinks if case == "sinks" else None)
            reads_lse = case == "the output and the LSE"
            torch.autograd.backward([out, lse] if reads_lse else [out], [dout, dlse] if reads_lse else [dout])

        times = {case: [] for case in ("the output", "the output and the LSE", "sinks")}
        for _ in range(args.rounds):
            for case in times:
                times[case].append(1e3 * timed(lambda: call(case), 10, 3, dev))
        print(f"{mask}: fwd+bwd ms, " + ", ".join(f"{case} {' / '.join(f'{t:.2f}' for t in ms)}"
                                                  for case, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
