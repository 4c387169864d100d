"""What cuDNN offers for one attention shape, timed (GPU only): is there a faster configuration?

ringflex builds the plan cuDNN's heuristics rank first. For a sliding window and causal
attention, forward and backward (B=1, H=32, D=128, bf16; the per-hop benchmark's shape) this

- builds every plan of heuristic modes A, B and the fallback list and times each (``plans``);
- appends a plan for every value of each knob of the backward engine the window's default
  plan uses, and the deterministic backward, and times those (``knobs``);
- lists the kernels of the default backward with their GPU time per call, and checks whether
  a dQ declared fp32 comes back in fp32 (skipping cuDNN's conversion pass) (``kernels``).

Plans are timed as ``benchmarks/bench_hop.py`` times calls: interleaved rounds, medians, so clock drift
favours none of them.

    python -m benchmarks.probes.plan_probe --seq-len 8192 --window 1024
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import interleaved, kernel_times

_NAMES = {False: (("q", "k", "v"), ("out", "lse")), True: (("q", "k", "v", "out", "dout", "lse"), ("dq", "dk", "dv"))}


def inputs(args) -> dict:
    shape = (1, args.heads, args.seq_len, 128)
    t = {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16) for name in ("q", "k", "v", "dout")}
    t["out"], t["lse"] = torch.empty_like(t["q"]), torch.empty(*shape[:3], 1, device="cuda", dtype=torch.float32)
    t.update({name: torch.empty_like(t["q"]) for name in ("dq", "dk", "dv")})
    return t


def build(cudnn, handle, t: dict, backward: bool, band: dict, modes, **extra):
    """The graph (plans created, none built) and its variant pack."""
    dtype = {torch.float32: cudnn.data_type.FLOAT, torch.bfloat16: cudnn.data_type.BFLOAT16}
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    ins, outs = _NAMES[backward]
    io = {n: g.tensor(name=n, dim=list(t[n].shape), stride=list(t[n].stride()), data_type=dtype[t[n].dtype]) for n in ins}
    scale = t["q"].shape[-1] ** -0.5
    if backward:
        made = g.sdpa_backward(q=io["q"], k=io["k"], v=io["v"], o=io["out"], dO=io["dout"], stats=io["lse"],
                               attn_scale=scale, **band, **extra)
    else:
        made = g.sdpa(q=io["q"], k=io["k"], v=io["v"], generate_stats=True, attn_scale=scale, **band, **extra)
    for n, tensor in zip(outs, made):
        tensor.set_output(True).set_dim(list(t[n].shape)).set_stride(list(t[n].stride())).set_data_type(dtype[t[n].dtype])
        io[n] = tensor
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans(modes)
    return g, {io[n]: t[n] for n in io}


def run_forward(cudnn, handle, t: dict, band: dict) -> None:
    """out and lse of the forward, which the backward reads."""
    g, pack = build(cudnn, handle, t, False, band, [cudnn.heur_mode.A])
    g.check_support()
    g.build_plans()
    g.execute(pack, torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda"), handle=handle)
    torch.cuda.synchronize()


def time_plans(g, pack, handle, label: str, args, first: int = 0) -> None:
    """Builds and times every plan of ``g`` from index ``first``; reports those that do not run."""
    g.check_support()
    calls = {}
    for i in range(first, g.get_execution_plan_count()):
        try:
            g.build_plan_at_index(i)
            workspace = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
            g.execute_plan_at_index(pack, workspace, i, handle)
            torch.cuda.synchronize()
            calls[i] = lambda i=i, workspace=workspace: g.execute_plan_at_index(pack, workspace, i, handle)
        except Exception as e:  # noqa: BLE001 (a plan that does not build or run is reported)
            print(f"  {label} plan {i} {_describe(g, i)}: not run ({str(e)[:80]})")
    for i, (ms, _) in interleaved(calls, args.rounds).items():
        print(f"  {label} plan {i}: {ms:.3f} ms  {_describe(g, i)}")


def _describe(g, i: int) -> str:
    try:
        return str(g.get_engine_and_knobs_at_index(i))
    except Exception:  # noqa: BLE001 (a plan without an (engine, knobs) record: its name)
        return g.get_plan_name_at_index(i)


def plans(cudnn, handle, t, bands, args) -> None:
    modes = [cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK]
    for label, band in bands.items():
        run_forward(cudnn, handle, t, band)
        for backward in (False, True):
            g, pack = build(cudnn, handle, t, backward, band, modes)
            time_plans(g, pack, handle, f"{label} {'bwd' if backward else 'fwd'}", args)


def knobs(cudnn, handle, t, band, args) -> None:
    run_forward(cudnn, handle, t, band)
    g, pack = build(cudnn, handle, t, True, band, [cudnn.heur_mode.A])
    engine, default = g.get_engine_and_knobs_at_index(0)
    print(f"window bwd default plan: engine {engine}, knobs {default}")
    for knob in g.get_knobs_for_engine(engine):
        print(f"  knob {knob.type}: {knob.min_value}..{knob.max_value} step {knob.stride}")
        for value in range(knob.min_value, knob.max_value + 1, max(1, knob.stride)):
            if default.get(knob.type) == value:
                continue
            try:
                g.create_execution_plan(engine, {**default, knob.type: value})
            except Exception as e:  # noqa: BLE001 (a configuration the engine does not accept)
                print(f"    {knob.type} = {value}: not accepted ({str(e)[:60]})")
    time_plans(g, pack, handle, "window bwd", args)
    g, pack = build(cudnn, handle, t, True, band, [cudnn.heur_mode.A], use_deterministic_algorithm=True)
    time_plans(g, pack, handle, "window bwd deterministic", args)


def kernels(cudnn, handle, t, bands, args) -> None:
    for label, band in bands.items():
        run_forward(cudnn, handle, t, band)
        results = {}
        for dq_dtype in (torch.bfloat16, torch.float32):
            t["dq"] = torch.empty(t["q"].shape, device="cuda", dtype=dq_dtype)
            g, pack = build(cudnn, handle, t, True, band, [cudnn.heur_mode.A])
            g.check_support()
            g.build_plans()
            workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")
            g.execute(pack, workspace, handle=handle)
            torch.cuda.synchronize()
            results[dq_dtype] = t["dq"].float()
            if dq_dtype == torch.bfloat16:
                print(f"{label} bwd kernels, us per call: {kernel_times(lambda: g.execute(pack, workspace, handle=handle))}")
        error = (results[torch.float32] - results[torch.bfloat16]).abs().max().item()
        print(f"{label} bwd, dQ declared fp32: largest difference to the bf16 dQ {error:.3g} "
              f"(largest |dQ| {results[torch.bfloat16].abs().max().item():.3g})")
        t["dq"] = torch.empty_like(t["q"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of 20 calls each; medians")
    p.add_argument("--parts", nargs="+", default=["plans", "knobs", "kernels"], choices=["plans", "knobs", "kernels"])
    args = p.parse_args()
    import cudnn
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    window = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0,
                  diagonal_band_left_bound=args.window)
    bands = {f"window {args.window}": window, "causal": dict(use_causal_mask=True)}
    t = inputs(args)
    if "plans" in args.parts:
        plans(cudnn, handle, t, bands, args)
    if "knobs" in args.parts:
        knobs(cudnn, handle, t, window, args)
    if "kernels" in args.parts:
        kernels(cudnn, handle, t, bands, args)


if __name__ == "__main__":
    main()
