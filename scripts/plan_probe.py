"""Times every execution plan cuDNN offers for one attention shape (GPU only).

ringflex builds the plan cuDNN's heuristics rank first. This script builds all of them
(heuristic modes A, B and the fallback list) for a sliding window and for causal attention,
forward and backward, and times each in interleaved rounds, to show whether picking a plan
by measurement (autotuning) would pay.

    python scripts/plan_probe.py --seq-len 8192 --window 1024
"""
from __future__ import annotations

import argparse
import statistics

import torch


def build(cudnn, handle, tensors, backward: bool, band: dict):
    F = cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=F, compute_data_type=F,
                      handle=handle)
    io = {name: g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()),
                         data_type=cudnn.data_type.FLOAT if t.dtype == torch.float32 else cudnn.data_type.BFLOAT16)
          for name, t in tensors.items() if name in (("q", "k", "v", "out", "dout", "lse") if backward else ("q", "k", "v"))}
    scale = tensors["q"].shape[-1] ** -0.5
    if backward:
        outs = g.sdpa_backward(q=io["q"], k=io["k"], v=io["v"], o=io["out"], dO=io["dout"], stats=io["lse"],
                               attn_scale=scale, **band)
        names = ("dq", "dk", "dv")
    else:
        outs = g.sdpa(q=io["q"], k=io["k"], v=io["v"], generate_stats=True, attn_scale=scale, **band)
        names = ("out", "lse")
    for name, t in zip(names, outs):
        ref = tensors[name]
        t.set_output(True).set_dim(list(ref.shape)).set_stride(list(ref.stride()))
        t.set_data_type(cudnn.data_type.FLOAT if ref.dtype == torch.float32 else cudnn.data_type.BFLOAT16)
        io[name] = t
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    return g, {io[name]: tensors[name] for name in io}


def probe(cudnn, handle, args, label: str, band: dict, backward: bool) -> None:
    b, h, s, d = 1, args.heads, args.seq_len, 128
    t = {name: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for name in ("q", "k", "v", "dout")}
    t["out"] = torch.empty_like(t["q"])
    t["lse"] = torch.empty(b, h, s, 1, device="cuda", dtype=torch.float32)
    for name in ("dq", "dk", "dv"):
        t[name] = torch.empty_like(t["q"])
    fwd, fwd_pack = build(cudnn, handle, t, False, band)
    ws = torch.empty(max(1, fwd.get_workspace_size()), dtype=torch.uint8, device="cuda")
    fwd.execute(fwd_pack, ws, handle=handle)  # out and lse for the backward
    graph, pack = build(cudnn, handle, t, True, band) if backward else (fwd, fwd_pack)
    plans = []
    for i in range(graph.get_execution_plan_count()):
        try:
            size = graph.get_workspace_size_plan_at_index(i)
            workspace = torch.empty(max(1, size), dtype=torch.uint8, device="cuda")
            graph.execute_plan_at_index(pack, workspace, i, handle)
            torch.cuda.synchronize()
            plans.append((i, graph.get_plan_name_at_index(i), workspace))
        except Exception as e:  # noqa: BLE001 (a plan that did not build or run: reported)
            print(f"  {label} plan {i}: not run ({type(e).__name__}: {str(e)[:80]})")
    times = {i: [] for i, _, _ in plans}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.rounds):
        for i, _, workspace in plans:
            start.record()
            for _ in range(args.calls):
                graph.execute_plan_at_index(pack, workspace, i, handle)
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) / args.calls)
    for i, name, _ in plans:
        print(f"  {label} plan {i}: {statistics.median(times[i]):.3f} ms  {name}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()
    import cudnn
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    window = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0,
                  diagonal_band_left_bound=args.window)
    for label, band in ((f"window {args.window}", window), ("causal", dict(use_causal_mask=True))):
        for backward in (False, True):
            probe(cudnn, handle, args, f"{label} {'bwd' if backward else 'fwd'}", band, backward)


if __name__ == "__main__":
    main()
