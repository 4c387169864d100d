"""A ragged batch against a call per document: GPU time (kernels, under the profiler) and host
time per block, forward and backward, for documents of several lengths (H=32, D=128, 8192
rows, B=1; GPU only). Whether the ragged kernel costs more per pair as documents grow.

    python scripts/ragged_cost.py
"""
import statistics, sys
import torch
sys.path.insert(0, "scripts")
from bench_hop import timed
from sdpa_ab import kernels
from ringflex import mods
from ringflex.kernels import cudnn as C
from ringflex.kernels.base import Mods
from ringflex.plan import Segment
real = C.CudnnKernel._calls
S = 8192
q, k, v, dout = (torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
seg = Segment(0, 1, S)
for lengths in ([4096, 4096], [2048] * 4, [1024] * 8, [512] * 16, [512, 1536, 768, 2048, 1024, 256, 2048]):
    m = Mods(None, mods.document(mods.document_ids(lengths, device="cuda")))
    res = {}
    for batched in (False, True):
        C.CudnnKernel._calls = staticmethod(real) if batched else staticmethod(lambda program, runs, *t: tuple(runs))
        kern = C.CudnnKernel()
        out, lse = kern.forward(q, k, v, seg, seg, m, 0.088, True)
        f = lambda: kern.forward(q, k, v, seg, seg, m, 0.088, True)
        b = lambda: kern.backward(q, k, v, out, lse, dout, seg, seg, m, 0.088, True)
        f(); b(); torch.cuda.synchronize()
        res[batched] = [sum(kernels(f).values()) / 1e3, timed(f)[1], sum(kernels(b).values()) / 1e3, timed(b)[1]]
    fmt = lambda r: f"fwd GPU {r[0]:.3f} ms host {r[1]:.0f} us, bwd GPU {r[2]:.3f} ms host {r[3]:.0f} us"
    print(f"{len(lengths)} docs max {max(lengths)}: per document {fmt(res[False])} | ragged {fmt(res[True])}")
