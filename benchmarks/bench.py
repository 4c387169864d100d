"""Ring benchmark: ringflex vs the best single-GPU kernel vs PyTorch's context_parallel.

    torchrun --nproc_per_node=2 -m benchmarks.bench --seq-lens 16384 32768 65536 \
        --masks none causal window documents prefix_lm causal_softcap --json out/bench.json --plot out/eff.png

For every total sequence length and mask it times forward and forward+backward of
(a) the best single-GPU kernel on the whole sequence (torch SDPA on cuDNN where it applies,
torch flex_attention compiled, and ringflex's own kernel on one GPU), (b) PyTorch
context_parallel (no mask and causal), (c) ringflex on the ring, in each layout of
``--layouts`` (one row each), and with ``--graph`` also captured in CUDA graphs by torch's
``make_graphed_callables`` (a row "<layout>+graph": each forward and backward one graph
launch, no host time); and reports ringflex's efficiency t_single / (world_size * t_ring)
and its peak memory per rank. The implementations are timed in turn, in rounds
(``--rounds``), and each reports its median round.
On CPU (gloo, reference kernel) it runs the same code at toy sizes as a smoke test.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import MASKS, device_and_dtype, make_mods, report, timed, timers_group

from tools.ranks import launch, max_over_ranks
import ringflex
from ringflex import config
from ringflex.parallel import peer, reshard
from ringflex.plan.layout import DEFAULT as DEFAULT_LAYOUT, Sharding


def fwd_and_fwdbwd(attn, q, k, v, iters, warmup, *, device):
    """(forward seconds, forward+backward seconds) of ``attn(q, k, v)``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            attn(q, k, v)

    def forward_backward():
        attn(q, k, v).backward(grad)

    return (timed(forward, iters, warmup, device, _CPU_GROUP),
            timed(forward_backward, iters, warmup, device, _CPU_GROUP))


SINGLES = ("sdpa-cudnn", "flex", "ringflex-1gpu")


def single_gpu_candidates(mask, score_mod, mask_mod, seq_len, device, names=SINGLES):
    """name -> attention over the whole sequence on one device, for the kernels of ``names``
    that apply."""
    out = {}
    if "ringflex-1gpu" in names:
        out["ringflex-1gpu"] = lambda q, k, v: ringflex.ring_flex_attention(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, group=_SELF_GROUP, layout="contiguous")
    if device.type != "cuda":
        return out
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if "sdpa-cudnn" in names and mask in ("none", "causal"):
        def sdpa(q, k, v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal")
        out["sdpa-cudnn"] = sdpa
    if "flex" not in names:
        return out
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # One compiled function per workload; grad mode and masks would exhaust a shared one's
    # recompile budget and silently fall back to the unfused (memory-hungry) path.
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    compiled = torch.compile(flex_attention, dynamic=False)
    # Compiled, create_block_mask works block by block; eager, it materialises seq_len^2 booleans.
    block_mask = None if mask_mod is None else torch.compile(create_block_mask)(
        mask_mod, None, None, seq_len, seq_len, device=device)
    out["flex"] = lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return out


def context_parallel_attention(mask, world_size, device):
    """PyTorch's context_parallel around cuDNN SDPA, or None where it does not apply."""
    if device.type != "cuda" or mask not in ("none", "causal"):
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel
    mesh = init_device_mesh("cuda", (world_size,))
    # Load balancing crashes on non-causal attention in torch 2.11: off there, on for causal.
    _cp_options.enable_load_balance = mask == "causal"

    def run(q_full, k_full, v_full, iters, warmup):
        buffers = [t.clone() for t in (q_full, k_full, v_full)]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            def attn(q, k, v):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal")
            return fwd_and_fwdbwd(attn, *buffers, iters, warmup, device=device)
    return run


def flex_context_parallel(score_mod, mask_mod, shape, world_size, device, head_tail: bool):
    """PyTorch's flex_attention context parallel, the path torchtitan takes: K/V all-gathered,
    each rank's queries against the whole sequence under a context-parallel block mask,
    optionally with its head-tail load balancer; None where it does not apply (its sequence
    must be a multiple of world_size * 128)."""
    batch, heads, seq_len, _ = shape
    if device.type != "cuda" or seq_len % (world_size * 128):
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (_context_parallel_shard, _ContextParallel,
                                                                  _HeadTailLoadBalancer)
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention
    mesh = init_device_mesh("cuda", (world_size,))
    balancer = _HeadTailLoadBalancer(seq_len, world_size, device) if head_tail else None
    block_mask = _create_cp_block_mask(mask_mod or (lambda b, h, q_idx, kv_idx: q_idx >= 0), batch, heads, seq_len,
                                       seq_len, mesh, load_balancer=balancer)
    compiled = torch.compile(flex_attention, dynamic=False)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    attention = parallelize_module(Attention(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))

    def run(q_full, k_full, v_full, iters, warmup):
        local = _context_parallel_shard(mesh, [q_full, k_full, v_full], [2, 2, 2], load_balancer=balancer)
        return fwd_and_fwdbwd(attention, *local, iters, warmup, device=device)
    return run


_SELF_GROUP = _CPU_GROUP = None  # set by run(): a one-rank group, and a gloo group of every rank


def bench_one(args, seq_len, mask, device, dtype, rank, world_size, log):
    """The rows of one length and mask, one per layout: every implementation (the ring once
    per layout) timed in turn, ``args.rounds`` times, medians, so that a drift of the GPUs'
    clocks over a row favours none of them; the single-GPU and context_parallel samples are
    shared by the layouts' rows."""
    score_mod, mask_mod = make_mods(mask, seq_len, device, args.window, args.doc_len)
    torch.manual_seed(0)
    shape = (args.batch, args.heads, seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))

    def ring(layout, moved_from=None):
        """The ring in ``layout``; with ``moved_from`` (the Sharding of the caller's shards) each
        call moves q, k, v there and the output back, as a call that re-shards does."""
        def attn(q, k, v):
            if moved_from is not None:
                q, k, v = reshard.move((q, k, v), 2, moved_from, layout, None, "the benchmark's move")
            out = ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                               layout=layout, backend=args.backend)
            return out if moved_from is None else reshard.move((out,), 2, layout, moved_from, None, "the output")[0]
        return attn

    # row label -> its layout: a name, a Sharding, or None (the caller chose none: ``shard``'s and the call's default)
    chosen = {label: None if label == "default" else label for label in args.layouts}
    if "by-mask" in chosen or "moved" in chosen:
        start = time.perf_counter()
        by_mask = ringflex.shard_by_mask(mask_mod, seq_len, world_size, batch=args.batch, heads=args.heads)
        log(f"  by-mask: {by_mask.name}, chosen in {1e3 * (time.perf_counter() - start):.1f} ms of host time")
        chosen.update({label: by_mask for label in ("by-mask", "moved") if label in chosen})
    # "moved": the caller's shards in the default layout, each call moved to shard_by_mask's sharding
    shards = {label: [ringflex.shard(t, 2, layout=None if label == "moved" else chosen[label]) for t in (q, k, v)]
              for label in args.layouts}
    moved_from = Sharding.of_layout(DEFAULT_LAYOUT, seq_len, world_size)
    timers = {}  # name -> (iters, warmup) -> (forward s, forward+backward s)
    if seq_len <= args.single_max:
        for name, attn in single_gpu_candidates(mask, score_mod, mask_mod, seq_len, device, args.singles).items():
            timers[name] = functools.partial(fwd_and_fwdbwd, attn, q, k, v, device=device)
    cp = context_parallel_attention(mask, world_size, device) if not args.no_cp else None
    if cp is not None:
        timers["context_parallel"] = functools.partial(cp, q, k, v)
    if not args.no_flex_cp and mask != "none":
        for name, head_tail in (("flex_cp", False), ("flex_cp_headtail", True)):
            peer = flex_context_parallel(score_mod, mask_mod, shape, world_size, device, head_tail)
            if peer is not None:
                timers[name] = functools.partial(peer, q, k, v)
    variants = {label: (chosen[label], local) for label, local in shards.items()}  # row label -> (layout, shards)
    attn_of = {}  # row label -> the attention it times
    if args.graph:
        variants.update({f"{label}+graph": (chosen[label], local) for label, local in shards.items()})
    for label, (layout, local) in variants.items():
        attn = ring(layout, moved_from if label.startswith("moved") else None)
        if label.endswith("+graph"):
            attn = torch.cuda.make_graphed_callables(attn, tuple(t.detach().requires_grad_() for t in local))
        timers[f"ringflex/{label}"] = functools.partial(fwd_and_fwdbwd, attn, *local, device=device)
        attn_of[label] = attn

    results = timed_in_rounds(timers, args, device, lambda name: name.startswith("ringflex/"))
    for name, result in results.items():
        log(f"  {name}: {result}")
    rows = []
    for label, (layout, local) in variants.items():
        row = {"seq_len": seq_len, "mask": mask, "layout": label, "world_size": world_size,
               "sharding": layout if isinstance(layout, str) else repr(layout),
               **{n: r for n, r in results.items() if not n.startswith("ringflex/")},
               "ringflex": dict(results[f"ringflex/{label}"])}
        if device.type == "cuda" and not label.endswith("+graph"):
            row["ringflex"]["peak_mem_gib"] = max_over_ranks([ring_peak_memory(attn_of[label], local) / 2**30],
                                                                   device, _CPU_GROUP)[0]
        singles = {n: row[n] for n in SINGLES if "fwd" in row.get(n, {})}
        if singles:
            for phase in ("fwd", "fwd_bwd"):
                best = min(singles, key=lambda n: singles[n][phase])
                row[f"best_single_{phase}"] = best
                row["ringflex"][f"efficiency_{phase}"] = singles[best][phase] / (world_size * row["ringflex"][phase])
        for peer in ("context_parallel", "flex_cp", "flex_cp_headtail"):
            if "fwd" in row.get(peer, {}):
                row["ringflex"][f"speedup_vs_{peer}_fwd_bwd"] = row[peer]["fwd_bwd"] / row["ringflex"]["fwd_bwd"]
        log(f"  ringflex ({label}): {row['ringflex']}")
        rows.append(row)
    return rows


def timed_in_rounds(timers, args, device, required) -> dict:
    """name -> {"fwd", "fwd_bwd"} seconds (medians over ``args.rounds`` rounds, each timing every
    timer in turn, so that a drift of the GPUs' clocks favours none; the slowest rank's), or
    {"error"} for a timer that raised and is not ``required`` (a kernel that does not apply is
    reported, not fatal)."""
    results, samples = {}, {name: [] for name in timers}
    for _ in range(args.rounds):
        for name, timer in timers.items():
            if "error" in results.get(name, {}):
                continue
            try:
                samples[name].append(timer(args.iters, args.warmup))
            except Exception as e:  # noqa: BLE001
                if required(name):
                    raise
                results[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for name, times in samples.items():
        if "error" not in results.get(name, {}):
            fwd, both = (statistics.median(t[i] for t in times) for i in (0, 1))
            results[name] = dict(zip(("fwd", "fwd_bwd"), max_over_ranks([fwd, both], device, _CPU_GROUP)))
    return results


def ring_peak_memory(ring, local) -> int:
    """Bytes a rank holds at most during a ring fwd+bwd: its inputs, what the call adds and the
    ring's receive buffers in symmetric memory, which torch's allocator does not count (the
    mailboxes are not counted)."""
    q, k, v = (t.detach().requires_grad_() for t in local)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ring(q, k, v).backward(torch.randn_like(q))
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before + sum(t.numel() * t.element_size() for t in local)
            + peer.receive_bytes(q.device))


def table(rows) -> str:
    ms = lambda r, n: f"{r[n]['fwd_bwd'] * 1e3:9.2f}" if "fwd" in r.get(n, {}) else f"{'-':>9}"
    peers = ("context_parallel", "flex_cp", "flex_cp_headtail")
    head = (f"{'tokens':>8} {'mask':>15} {'layout':>10} | {'single':>9} | {'cp':>9} {'flex cp':>9} {'+h/t':>9} | "
            f"{'ring fwd':>9} {'fwd+bwd':>9} | {'eff fwd':>7} {'eff f+b':>7} | {'vs best peer':>12} | {'mem GiB':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        best = r.get("best_single_fwd_bwd")
        single = f"{r[best]['fwd_bwd'] * 1e3:9.2f}" if best else f"{'-':>9}"
        rf = r["ringflex"]
        eff = lambda p: f"{rf[f'efficiency_{p}']:7.3f}" if f"efficiency_{p}" in rf else f"{'-':>7}"
        speedups = [rf[f"speedup_vs_{p}_fwd_bwd"] for p in peers if f"speedup_vs_{p}_fwd_bwd" in rf]
        vs = f"{min(speedups):12.2f}" if speedups else f"{'-':>12}"
        mem = f"{rf['peak_mem_gib']:7.2f}" if "peak_mem_gib" in rf else f"{'-':>7}"
        lines.append(f"{r['seq_len']:>8} {r['mask']:>15} {r['layout']:>10} | {single} | "
                     f"{' '.join(ms(r, p) for p in peers)} | {rf['fwd'] * 1e3:9.2f} {rf['fwd_bwd'] * 1e3:9.2f} | "
                     f"{eff('fwd')} {eff('fwd_bwd')} | {vs} | {mem}")
    return "\n".join(lines) + ("\n(fwd+bwd times in ms unless named fwd; single = the best single-GPU kernel on the "
                               "whole sequence; cp = torch context_parallel (SDPA), flex cp = torch's flex_attention "
                               "context parallel, +h/t with its head-tail balancer; vs best peer = the fastest peer's "
                               "time / ringflex's; mem GiB = a rank's peak memory in a ring call, its receive buffers included)")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    layouts = dict.fromkeys(r["layout"] for r in rows)
    for mask, layout in dict.fromkeys((r["mask"], r["layout"]) for r in rows):
        pts = [(r["seq_len"], r["ringflex"]["efficiency_fwd_bwd"]) for r in rows
               if (r["mask"], r["layout"]) == (mask, layout) and "efficiency_fwd_bwd" in r["ringflex"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mask if len(layouts) == 1 else f"{mask} ({layout})")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total sequence length (tokens)")
    ax.set_ylabel("fwd+bwd efficiency  t_single / (W t_ring)")
    ax.set_title(f"ringflex on {rows[0]['world_size']} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="ringflex ring benchmark (run with torchrun)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--doc-len", type=int, default=4096, help="mean document length of the documents mask")
    p.add_argument("--layouts", nargs="+", default=["zigzag"],
                   choices=(*ringflex.LAYOUTS, "by-mask", "default", "moved"),
                   help="time the ring in each of these layouts (one row each); by-mask: ringflex.shard_by_mask's; "
                        "default: no layout given to shard or the call; moved: shards in the default layout, each "
                        "call moved to shard_by_mask's sharding and the output back (what a call that re-shards "
                        "does, whether or not the default decides to)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--graph", action="store_true",
                   help="also time each layout captured in CUDA graphs (make_graphed_callables; GPUs only). "
                        "Once a pass was captured, eager passes end after the neighbour's end (peer.end_pass): "
                        "compare eager rows with a run without --graph too")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed calls before each round of an implementation (the memory cache is emptied between "
                        "implementations, and a call that grows it again would be timed)")
    p.add_argument("--rounds", type=int, default=3, help="each implementation timed this often, in turn; medians")
    p.add_argument("--single-max", type=int, default=131072, help="skip single-GPU baselines above this length")
    p.add_argument("--singles", nargs="+", default=list(SINGLES), choices=SINGLES,
                   help="the single-GPU kernels to time (flex compiles for minutes per length)")
    p.add_argument("--no-cp", action="store_true", help="skip PyTorch context_parallel")
    p.add_argument("--no-flex-cp", action="store_true", help="skip PyTorch's flex_attention context parallel")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write the efficiency plot here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.graph and args.device != "cuda":
        p.error("--graph captures CUDA graphs: it needs --device cuda")
    return args


def set_up_groups(device: torch.device) -> None:
    """The groups the timers and the single-GPU baselines read: a gloo group of every rank
    (``timers_group``) and a one-rank group per rank (ringflex's single-GPU baseline)."""
    global _SELF_GROUP, _CPU_GROUP
    _CPU_GROUP = timers_group(device)
    for r in range(dist.get_world_size()):
        g = dist.new_group([r], backend="gloo" if device.type == "cpu" else None)
        if r == dist.get_rank():
            _SELF_GROUP = g


def run(args):
    """Runs the benchmark on an initialised process group; returns the rows."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device, dtype = device_and_dtype(args.device)
    set_up_groups(device)
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    rows = []
    for seq_len in args.seq_lens:
        for mask in args.masks:
            done = len(rows) // (len(args.layouts) * (1 + args.graph))  # rows per length and mask
            log(f"[{done + 1}/{len(args.seq_lens) * len(args.masks)}] {seq_len} tokens, mask {mask}")
            rows += bench_one(args, seq_len, mask, device, dtype, rank, world_size, log)
    transport, lends = peer.in_use(dist.group.WORLD, device), config.LENDING.value()
    report(args, rows, table(rows) + f"\nring transfers: {transport}; RINGFLEX_LENDING={lends}",
           transport=transport, lending=lends)
    if rank == 0 and args.plot:
        plot(rows, args.plot)
    return rows


def main():
    launch(run, parse_args())


if __name__ == "__main__":
    main()
