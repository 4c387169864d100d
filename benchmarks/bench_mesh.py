"""Heads x ring benchmark: the 2-D mesh (``group=mesh``, ``ringflex.heads``) against the pure ring.

    torchrun --nproc_per_node=4 -m benchmarks.bench_mesh --tokens-per-rank 8192 32768 \
        --masks none causal documents --json benchmarks/results/<hardware>_<date>_mesh.json

For every number of tokens per GPU and mask it times forward and forward+backward of
(a) the best single-GPU kernel on the whole sequence (torch's cuDNN SDPA where it applies,
ringflex's own kernel on one GPU; ``bench.single_gpu_candidates``), (b) the pure ring over
every rank (``group=None``), (c) torch's context parallel peers (``context_parallel`` around
cuDNN SDPA for none and causal, flex_attention context parallel for masks: ``bench.py``'s),
and (d) the heads x ring mesh of every shape a x r with
a * r = the number of ranks (``--meshes`` picks some: 1x4, 2x2, 4x1 on 4 GPUs; 1xN is the
pure ring through the mesh's code, its argument check included). Efficiency, as in
``bench.py``: t_single / (N x t), N the number of ranks. Implementations are timed in turn,
``--rounds`` times, and each reports its median round; the time of a rank is the slowest rank's.

Which mesh wins depends on where the transfers go: an all-to-all moves every rank's q, k, v
and output once per pass inside the heads group (NVLink, within a node), while the ring moves
K/V blocks r - 1 times but hides them behind attention if a rank holds enough tokens.

On CPU (gloo, reference kernel) it runs at toy sizes as a smoke test:

    torchrun --nproc_per_node=4 -m benchmarks.bench_mesh --device cpu --tokens-per-rank 256 --heads 4 \
        --head-dim 16 --iters 1 --warmup 1 --rounds 1
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ringflex
from benchmarks import bench  # the single-GPU baselines and the fwd / fwd+bwd timer
from benchmarks.common import device_and_dtype, make_mods, report
from tools.ranks import launch, max_over_ranks

MASKS = ("none", "causal", "documents")


def mesh_shapes(world_size: int, heads: int, wanted=None):
    """"axr" -> (a, r) for every a dividing both the ranks and the heads (or those of ``wanted``)."""
    shapes = {f"{a}x{world_size // a}": (a, world_size // a)
              for a in range(1, world_size + 1) if world_size % a == 0 and heads % a == 0}
    if wanted:
        missing = [m for m in wanted if m not in shapes]
        if missing:
            raise SystemExit(f"meshes {missing} do not fit {world_size} ranks and {heads} heads; choose from "
                             f"{list(shapes)}")
        shapes = {m: shapes[m] for m in wanted}
    return shapes


def bench_one(args, tokens, mask, meshes, device, dtype, world_size, log):
    """The row of one size and mask: every implementation timed in turn, medians of rounds."""
    seq_len = tokens * world_size
    score_mod, mask_mod = make_mods(mask, seq_len, device, window=seq_len, doc_len=args.doc_len)
    torch.manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, seq_len, args.head_dim, device=device, dtype=dtype)
               for _ in range(3))

    def attention_on(group):
        def attn(q, k, v):
            return ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, group=group,
                                                layout=args.layout, backend=args.backend)
        return attn

    timers = {}  # name -> (iters, warmup) -> (forward s, forward+backward s)
    if seq_len <= args.single_max:
        for name, attn in bench.single_gpu_candidates(mask, score_mod, mask_mod, seq_len, device,
                                                      args.singles).items():
            timers[name] = functools.partial(bench.fwd_and_fwdbwd, attn, q, k, v, device=device)
    if not args.no_cp:
        peers = {"context_parallel": bench.context_parallel_attention(mask, world_size, device)}
        if mask != "none":
            peers["flex_cp"] = bench.flex_context_parallel(score_mod, mask_mod, tuple(q.shape), world_size, device,
                                                           head_tail=False)
        timers.update({name: functools.partial(peer, q, k, v) for name, peer in peers.items() if peer is not None})
    groups = {"ring": None, **{f"mesh {name}": mesh for name, mesh in meshes.items()}}
    for name, group in groups.items():
        local = [ringflex.shard(t, 2, group=group, layout=args.layout) for t in (q, k, v)]
        timers[name] = functools.partial(bench.fwd_and_fwdbwd, attention_on(group), *local, device=device)

    results = bench.timed_in_rounds(timers, args, device, lambda name: name in groups)
    singles = {n: results[n] for n in bench.SINGLES if "fwd" in results.get(n, {})}
    row = {"tokens_per_rank": tokens, "seq_len": seq_len, "mask": mask, "world_size": world_size,
           "layout": args.layout, **{n: results[n] for n in results if n not in groups}}
    for phase in ("fwd", "fwd_bwd"):
        if singles:
            row[f"best_single_{phase}"] = min(singles, key=lambda n: singles[n][phase])
    for name in groups:
        result = dict(results[name])
        for phase in ("fwd", "fwd_bwd"):
            if singles:
                best = singles[row[f"best_single_{phase}"]][phase]
                result[f"efficiency_{phase}"] = best / (world_size * result[phase])
        for peer in PEERS:
            if "fwd_bwd" in results.get(peer, {}):
                result[f"speedup_vs_{peer}_fwd_bwd"] = results[peer]["fwd_bwd"] / result["fwd_bwd"]
        if device.type == "cuda":
            local = [ringflex.shard(t, 2, group=groups[name], layout=args.layout) for t in (q, k, v)]
            result["peak_mem_gib"] = max_over_ranks([bench.ring_peak_memory(attention_on(groups[name]), local) / 2**30],
                                                    device, bench._CPU_GROUP)[0]
        row[name] = result
        log(f"  {name}: {result}")
    return row, list(groups)


PEERS = ("context_parallel", "flex_cp")


def table(rows, names) -> str:
    head = f"{'tokens/GPU':>10} {'mask':>10} | {'single f+b':>10} | {'torch CP':>8} {'flex CP':>8} | " + " | ".join(
        f"{name:>12} {'eff':>5}" for name in names)
    lines = [head, "-" * len(head)]
    for r in rows:
        best = r.get("best_single_fwd_bwd")
        single = f"{r[best]['fwd_bwd'] * 1e3:10.2f}" if best else f"{'-':>10}"
        peers = " ".join(f"{r[p]['fwd_bwd'] * 1e3:8.2f}" if "fwd_bwd" in r.get(p, {}) else f"{'-':>8}"
                         for p in PEERS)
        cells = []
        for name in names:
            eff = r[name].get("efficiency_fwd_bwd")
            cells.append(f"{r[name]['fwd_bwd'] * 1e3:12.2f} " + (f"{eff:5.3f}" if eff is not None else f"{'-':>5}"))
        lines.append(f"{r['tokens_per_rank']:>10} {r['mask']:>10} | {single} | {peers} | " + " | ".join(cells))
    return "\n".join(lines) + ("\n(fwd+bwd ms; eff = t_single / (N t); single = best single-GPU kernel, whole sequence; "
                               "torch CP = context_parallel around cuDNN SDPA, flex CP = torch's flex_attention CP)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="ringflex heads x ring benchmark (run with torchrun)")
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    p.add_argument("--meshes", nargs="+", help="mesh shapes 'axr' to time (default: every one that fits)")
    p.add_argument("--layout", default="zigzag", choices=ringflex.LAYOUTS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--doc-len", type=int, default=4096, help="mean document length of the documents mask")
    p.add_argument("--backend", default="auto")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="each implementation timed this often, in turn; medians")
    p.add_argument("--single-max", type=int, default=262144, help="skip single-GPU baselines above this length")
    p.add_argument("--singles", nargs="+", default=["sdpa-cudnn", "ringflex-1gpu"], choices=bench.SINGLES,
                   help="the single-GPU kernels to time (flex compiles for minutes per length)")
    p.add_argument("--no-cp", action="store_true", help="skip torch's context parallel peers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows here (benchmarks/results/<hardware>_<date>_mesh.json)")
    return p.parse_args(argv)


def run(args):
    """Runs the benchmark on an initialised process group; returns the rows."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device, dtype = device_and_dtype(args.device)
    bench.set_up_groups(device)  # bench.py's timers and single-GPU baselines read them
    meshes = {name: init_device_mesh(device.type, shape, mesh_dim_names=("heads", "ring"))
              for name, shape in mesh_shapes(world_size, args.heads, args.meshes).items()}
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    rows, names = [], []
    for tokens in args.tokens_per_rank:
        for mask in args.masks:
            log(f"[{len(rows) + 1}/{len(args.tokens_per_rank) * len(args.masks)}] {tokens} tokens per rank, "
                f"mask {mask}")
            row, names = bench_one(args, tokens, mask, meshes, device, dtype, world_size, log)
            rows.append(row)
    report(args, rows, table(rows, names))
    return rows


def main():
    launch(run, parse_args())


if __name__ == "__main__":
    main()
