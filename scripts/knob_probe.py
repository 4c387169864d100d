"""Every engine configuration cuDNN accepts for the sliding-window backward, timed (GPU only).

The heuristic offers two plans for the window's backward (``plan_probe.py``). This builds
every value of its engine's knobs (KERNEL_CFG, STAGES) that the engine accepts, and the
deterministic variant, and times each: whether any configuration beats the default.
B=1, H=32, D=128, S=8192, bf16, window 1024 (the per-hop benchmark's shape).

    python scripts/knob_probe.py
"""
import statistics, itertools
import torch
import cudnn

handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
BF, F = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
b, h, s, d = 1, 32, 8192, 128
t = {n: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for n in ("q", "k", "v", "dout")}
t["out"] = torch.empty_like(t["q"]); t["lse"] = torch.empty(b, h, s, 1, device="cuda", dtype=torch.float32)
for n in ("dq", "dk", "dv"): t[n] = torch.empty_like(t["q"])
def dt(x): return F if x.dtype == torch.float32 else BF

def graph(backward, band, **extra):
    g = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F, compute_data_type=F, handle=handle)
    names = ("q", "k", "v", "out", "dout", "lse") if backward else ("q", "k", "v")
    io = {n: g.tensor(name=n, dim=list(t[n].shape), stride=list(t[n].stride()), data_type=dt(t[n])) for n in names}
    if backward:
        outs = g.sdpa_backward(q=io["q"], k=io["k"], v=io["v"], o=io["out"], dO=io["dout"], stats=io["lse"], attn_scale=d ** -0.5, **band, **extra)
        onames = ("dq", "dk", "dv")
    else:
        outs = g.sdpa(q=io["q"], k=io["k"], v=io["v"], generate_stats=True, attn_scale=d ** -0.5, **band)
        onames = ("out", "lse")
    for n, o in zip(onames, outs):
        o.set_output(True).set_dim(list(t[n].shape)).set_stride(list(t[n].stride())).set_data_type(dt(t[n])); io[n] = o
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A])
    return g, {io[n]: t[n] for n in io}

def run_all(label, g, pack, first):
    ok = []
    for i in range(first, g.get_execution_plan_count()):
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
            g.execute_plan_at_index(pack, ws, i, handle); torch.cuda.synchronize()
            ok.append((i, ws))
        except Exception as e:
            print(f"  {label} plan {i} {g.get_engine_and_knobs_at_index(i)}: not run: {str(e)[:100]}")
    times = {i: [] for i, _ in ok}
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        for i, ws in ok:
            e0.record()
            for _ in range(10): g.execute_plan_at_index(pack, ws, i, handle)
            e1.record(); e1.synchronize(); times[i].append(e0.elapsed_time(e1) / 10)
    for i, _ in ok:
        print(f"  {label} plan {i}: {statistics.median(times[i]):.3f} ms {g.get_engine_and_knobs_at_index(i)}")

window = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0, diagonal_band_left_bound=1024)
fwd, fpack = graph(False, window); fwd.check_support(); fwd.build_plans()
fwd.execute(fpack, torch.empty(max(1, fwd.get_workspace_size()), dtype=torch.uint8, device="cuda"), handle=handle); torch.cuda.synchronize()
g, pack = graph(True, window)
eng, knobs = g.get_engine_and_knobs_at_index(0)
print("heuristic plan 0:", eng, knobs)
try:
    ks = g.get_knobs_for_engine(eng)
    for k in ks:
        print("  knob", k, {a: getattr(k, a) for a in dir(k) if not a.startswith("_") and not callable(getattr(k, a))})
except Exception as e:
    ks = []; print("get_knobs_for_engine failed:", e)
n0 = g.get_execution_plan_count()
tried = set()
for k in ks:
    kt = getattr(k, "type", None)
    lo, hi, st = (getattr(k, a, None) for a in ("min_value", "max_value", "stride"))
    if kt is None or lo is None:
        continue
    for v in range(lo, hi + 1, max(1, st or 1)):
        cfg = dict(knobs); cfg[kt] = v
        key = tuple(sorted((str(a), b) for a, b in cfg.items()))
        if key in tried or len(tried) > 80: continue
        tried.add(key)
        try: g.create_execution_plan(eng, cfg)
        except Exception as e: print("  create failed", cfg, str(e)[:80])
print("candidates:", g.get_execution_plan_count() - n0)
g.check_support()
run_all("window bwd", g, pack, 0)
try:
    g2, pack2 = graph(True, window, use_deterministic_algorithm=True); g2.check_support()
    run_all("window bwd deterministic", g2, pack2, 0)
except Exception as e:
    print("deterministic:", str(e)[:200])
