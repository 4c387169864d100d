"""A cost model of one fwd+bwd step of attention on a heads x ring mesh, for choosing a mesh
past one host: hop compute against the bytes each link carries.

    python -m benchmarks.mesh_model                      # the table of docs/guide.md
    python -m benchmarks.mesh_model --check benchmarks/results/4xh100_2026-11-27_head_groups_8k_nccl_alltoall.json

Per GPU, with N = a x r GPUs, S tokens, H heads of dim D (bf16):
- compute: the whole sequence's attention split N ways, ``PAIR_S * S**2 * H * share`` / N
  (``share``: the fraction of pairs the mask shows; the ring's layouts balance it);
- the ring: r steps, each costing ``STEP_S`` beyond its compute (launches, merges, the
  host's share), and a K/V block (and dK/dV in backward) per step over the ring's slowest
  link, hidden behind the step's compute where it is shorter;
- the heads all-to-all: (a - 1)/a of q, k, v and the output (and their gradients) once, over
  NVLink when a <= GPUS_PER_NODE; not hidden (the ring waits for it).
The constants are fitted to the 4x H100 run of 2026-11-27 at 8k tokens per GPU after backward's
dK/dV shares (the NCCL all-to-all rows of the head-groups results; ``--check`` prints the fit).
"""
from __future__ import annotations

import argparse
import json

PAIR_S = 111.8e-3 / (32768 ** 2 * 32)  # fwd+bwd seconds per (query, key, head) pair at D=128: one H100, no mask
STEP_S = 0.55e-3  # a ring step's cost beyond its compute, fwd+bwd (4x H100, none and causal, with dK/dV shares)
NVLINK_ALL_TO_ALL = 235e9  # bytes/s a GPU moves in an all-to-all inside a node (the 2 x 2 and 4 x 1 meshes)
NVLINK_P2P = 300e9  # bytes/s of a ring transfer between GPUs of one node (copy engines)
INFINIBAND = 50e9  # bytes/s per GPU between nodes (400 Gb/s NDR, one NIC per GPU)
GPUS_PER_NODE = 8


def step_time(a: int, r: int, seq_len: int, heads: int, head_dim: int = 128, share: float = 1.0,
              gpus_per_node: int = GPUS_PER_NODE) -> float:
    """Predicted fwd+bwd seconds of one attention call on an a x r heads x ring mesh (heads
    ranks inside a node, the ring's ranks in node order)."""
    n = a * r
    compute = PAIR_S * seq_len ** 2 * heads * share / n
    if r == 1:
        ring = STEP_S
    else:
        block = 2 * (seq_len // r) * (heads // a) * head_dim * 2  # K and V of a ring rank, bf16
        crosses_nodes = n > gpus_per_node
        link = INFINIBAND if crosses_nodes else NVLINK_P2P
        transfer = 3 * block / link  # K/V forward, K/V and dK/dV back in backward
        ring = r * max(compute / r + STEP_S, transfer) - compute
    tensor = (seq_len // n) * heads * head_dim * 2
    all_to_all = 0.0 if a == 1 else 8 * tensor * (a - 1) / a / (NVLINK_ALL_TO_ALL if a <= gpus_per_node else INFINIBAND)
    return compute + ring + all_to_all


def efficiency(a: int, r: int, seq_len: int, heads: int, share: float = 1.0) -> float:
    return PAIR_S * seq_len ** 2 * heads * share / (a * r * step_time(a, r, seq_len, heads, share=share))


def table(tokens_per_gpu, nodes, heads: int = 32, share: float = 0.5) -> str:
    lines = [f"causal (share {share}), H={heads}, D=128: predicted fwd+bwd efficiency per mesh a x r",
             f"{'nodes':>5} {'GPUs':>5} {'tokens/GPU':>10} | " + " ".join(f"{f'{a} x N/{a}':>9}" for a in (1, 2, 4, 8))
             + " | best"]
    for n in nodes:
        gpus = n * GPUS_PER_NODE
        for per_gpu in tokens_per_gpu:
            s = per_gpu * gpus
            effs = {a: efficiency(a, gpus // a, s, heads, share) for a in (1, 2, 4, 8) if heads % a == 0}
            best = max(effs, key=effs.get)
            lines.append(f"{n:>5} {gpus:>5} {per_gpu:>10} | " + " ".join(f"{effs[a]:9.3f}" for a in effs)
                         + f" | {best} x {gpus // best}")
    return "\n".join(lines)


def check(path: str) -> str:
    """The model against measured rows of ``bench_mesh`` (same GPUs, one node)."""
    shares = {"none": 1.0, "causal": 0.5}
    out = [f"{'mask':>8} {'mesh':>5} | {'measured ms':>11} {'model ms':>9}"]
    for row in json.load(open(path))["rows"]:
        if row["mask"] not in shares:
            continue
        for name, result in row.items():
            if name.startswith("mesh ") or name == "ring":
                a, r = (1, row["world_size"]) if name == "ring" else map(int, name[5:].split("x"))
                model = step_time(a, r, row["seq_len"], 32, share=shares[row["mask"]])
                label = "ring" if name == "ring" else f"{a}x{r}"
                out.append(f"{row['mask']:>8} {label:>5} | {result['fwd_bwd'] * 1e3:11.2f} {model * 1e3:9.2f}")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", metavar="JSON", help="compare with a bench_mesh result file instead")
    args = p.parse_args()
    print(check(args.check) if args.check else table([8192, 32768], [1, 2, 4, 8, 16]))


if __name__ == "__main__":
    main()
