"""Can cuDNN's SDPA backward hand dQ over in fp32 (skipping its conversion pass), and what does
each of its kernels cost? (GPU only; window 1024 and causal, B=1 H=32 D=128 S=8192 bf16.)

It cannot: a dQ tensor declared FLOAT is accepted, but the conversion kernel still runs and
writes bf16 into it (the "fp32" values read back are garbage). The profile lists the
backward's kernels with their GPU time per call.

    python scripts/dq_dtype_probe.py
"""
import statistics
import torch
from torch.profiler import ProfilerActivity, profile
import cudnn

handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
BF, F = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
b, h, s, d = 1, 32, 8192, 128
t = {n: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for n in ("q", "k", "v", "dout")}
t["out"] = torch.empty_like(t["q"]); t["lse"] = torch.empty(b, h, s, 1, device="cuda", dtype=torch.float32)

def dt(x): return F if x.dtype == torch.float32 else BF

def build(backward, band, dq_dtype):
    g = cudnn.pygraph(io_data_type=BF, intermediate_data_type=F, compute_data_type=F, handle=handle)
    names = ("q", "k", "v", "out", "dout", "lse") if backward else ("q", "k", "v")
    io = {n: g.tensor(name=n, dim=list(t[n].shape), stride=list(t[n].stride()), data_type=dt(t[n])) for n in names}
    if backward:
        outs = g.sdpa_backward(q=io["q"], k=io["k"], v=io["v"], o=io["out"], dO=io["dout"], stats=io["lse"], attn_scale=d ** -0.5, **band)
        refs = {"dq": torch.empty(b, h, s, d, device="cuda", dtype=dq_dtype), "dk": torch.empty_like(t["q"]), "dv": torch.empty_like(t["q"])}
    else:
        outs = g.sdpa(q=io["q"], k=io["k"], v=io["v"], generate_stats=True, attn_scale=d ** -0.5, **band)
        refs = {"out": t["out"], "lse": t["lse"]}
    for (n, ref), o in zip(refs.items(), outs):
        o.set_output(True).set_dim(list(ref.shape)).set_stride(list(ref.stride())).set_data_type(dt(ref))
        io[n] = o
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    allt = dict(t, **refs)
    pack = {io[n]: allt[n] for n in io}
    ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")
    return (lambda: g.execute(pack, ws, handle=handle)), refs

for label, band in (("window", dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0, diagonal_band_left_bound=1024)), ("causal", dict(use_causal_mask=True))):
    fwd, _ = build(False, band, None); fwd(); torch.cuda.synchronize()
    calls = {}
    for dq_dtype in (torch.bfloat16, torch.float32):
        try:
            calls[dq_dtype] = build(True, band, dq_dtype)
        except Exception as e:
            print(label, dq_dtype, "not supported:", type(e).__name__, str(e)[:300]); continue
    if len(calls) == 2:
        for c, _ in calls.values(): c()
        torch.cuda.synchronize()
        a, bq = calls[torch.bfloat16][1]["dq"].float(), calls[torch.float32][1]["dq"]
        print(label, "dq fp32 vs bf16 max diff", (a - bq).abs().max().item(), "max", a.abs().max().item())
    times = {k: [] for k in calls}
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(7):
        for k, (c, _) in calls.items():
            e0.record()
            for _ in range(10): c()
            e1.record(); e1.synchronize(); times[k].append(e0.elapsed_time(e1) / 10)
    for k, (c, _) in calls.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): c()
            torch.cuda.synchronize()
        ks = {e.key[:70]: round(e.self_device_time_total / 5, 1) for e in prof.key_averages() if e.self_device_time_total > 0}
        print(label, k, f"{statistics.median(times[k]):.3f} ms", ks)
