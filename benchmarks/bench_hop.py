"""Per-hop kernel timings on one GPU, forward and backward, for the mods of the test matrix.

Compares ringflex's cuDNN hop (the whole sequence as one hop, offsets 0), torch
flex_attention (compiled, with a block mask) and torch's cuDNN SDPA (no mask, causal).
Each time is the median over interleaved rounds of 20 back-to-back calls (every
implementation in turn in each round), so drift of the GPU's clock favours none of them.

    python -m benchmarks.bench_hop                      # B=1 H=32 D=128 bf16 S=8192, every mod
    python -m benchmarks.bench_hop --depths 0 1 2 3     # also the split-depth sweep
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import add_shape_arguments, autograd_calls, interleaved, ringflex_calls, sdpa_calls
from ringflex import mods
from ringflex.kernels import cudnn as cudnn_kernel


def matrix(seq: int, heads: int, device):
    """Name -> (score_mod, mask_mod, kv_heads divisor)."""
    doc = mods.document_ids(_doc_lengths(seq), device=device)
    slopes = mods.alibi_slopes(heads).to(device)
    cap = mods.softcap(30.0)
    return {
        "no_mask": (None, None, 1),
        "causal": (None, mods.causal, 1),
        "sliding_window_1024": (None, mods.sliding_window(1024), 1),
        "prefix_lm_2048": (None, mods.prefix_lm(seq // 4), 1),
        "documents": (None, mods.document(doc), 1),
        "alibi_causal": (mods.alibi(slopes), mods.causal, 1),
        "softcap": (cap, None, 1),
        "causal_softcap": (cap, mods.causal, 1),
        "image_2d_r8": (None, mods.image_neighbourhood(seq // 128, 128, 8), 1),
        "gqa_causal_4x": (None, mods.causal, 4),
    }


def _doc_lengths(seq: int):
    pattern = [512, 1536, 768, 2048, 1024, 256, 2048]
    lengths, left, i = [], seq, 0
    while left > 0:
        lengths.append(min(left, pattern[i % len(pattern)]))
        left -= lengths[-1]
        i += 1
    return lengths


def flex_calls(q, k, v, dout, score_mod, mask_mod):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # a fresh compile per mod, not a recompile-limited one
    flex = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)
    gqa = q.shape[1] != k.shape[1]
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    return autograd_calls(lambda: flex(*inputs, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa),
                          inputs, dout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.add_argument("--mods", nargs="*", help="subset of the matrix (default: all)")
    p.add_argument("--depths", type=int, nargs="*", default=[], help="split depths to sweep (mods with a mask and a score_mod)")
    p.add_argument("--no-flex", action="store_true", help="skip torch flex_attention")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of 20 calls each; medians are reported")
    args = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    table = matrix(args.seq, args.heads, device)
    names = args.mods or list(table)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, B={args.batch} H={args.heads} "
          f"D={args.dim} S={args.seq} bf16, default split depth {cudnn_kernel.SPLIT_DEPTH}; times in ms (median)")
    print("| mod | ringflex fwd | ringflex bwd | flex fwd | flex bwd | torch cuDNN fwd | torch cuDNN bwd "
          "| ringflex host us fwd / bwd | first call s |")
    print("|---|---|---|---|---|---|---|---|---|")
    sweep = []
    for name in names:
        score_mod, mask_mod, group = table[name]
        shape = (args.batch, args.heads, args.seq, args.dim)
        kv_shape = (args.batch, args.heads // group, args.seq, args.dim)
        q = torch.randn(shape, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(kv_shape, device=device, dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn(shape, device=device, dtype=torch.bfloat16)
        rf_fwd, rf_bwd, first = ringflex_calls(q, k, v, dout, score_mod, mask_mod, cudnn_kernel.SPLIT_DEPTH)
        calls = {"ringflex fwd": rf_fwd, "ringflex bwd": rf_bwd}
        if not args.no_flex:
            calls["flex fwd"], calls["flex bwd"] = flex_calls(q, k, v, dout, score_mod, mask_mod)
        if score_mod is None and mask_mod in (None, mods.causal):
            calls["sdpa fwd"], calls["sdpa bwd"] = sdpa_calls(q, k, v, dout, mask_mod is not None)
        t = interleaved(calls, args.rounds)
        cell = lambda key: f"{t[key][0]:.2f}" if key in t else "-"  # noqa: E731
        print(f"| {name} | {cell('ringflex fwd')} | {cell('ringflex bwd')} | {cell('flex fwd')} | {cell('flex bwd')} "
              f"| {cell('sdpa fwd')} | {cell('sdpa bwd')} | {t['ringflex fwd'][1]:.0f} / {t['ringflex bwd'][1]:.0f} "
              f"| {first:.1f} |", flush=True)
        for depth in args.depths:  # the split serves masked blocks with a score_mod
            if mask_mod is not None and score_mod is not None:
                fwd, bwd, first = ringflex_calls(q, k, v, dout, score_mod, mask_mod, depth)
                d = interleaved({"fwd": fwd, "bwd": bwd}, args.rounds)
                sweep.append((name, depth, d["fwd"][0], d["bwd"][0], first))
    if sweep:
        print("\n| mod | split depth | fwd | bwd | first call s |")
        print("|---|---|---|---|---|")
        for name, depth, fwd, bwd, first in sweep:
            print(f"| {name} | {depth} | {fwd:.2f} | {bwd:.2f} | {first:.1f} |")


if __name__ == "__main__":
    main()
