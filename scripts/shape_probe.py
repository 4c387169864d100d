"""Are one rank's cuDNN calls in a 2-GPU zigzag ring as fast per pair as the one single-GPU call?

For no mask and causal at 16k and 32k tokens it times, on one GPU, the single-GPU call over
the whole sequence and the calls one rank makes (no mask: two squares of half the length;
causal over zigzag: a causal square of half the length and a full block of a quarter by a
half), fwd+bwd, and prints the ceiling this puts on the ring's efficiency, transfers aside.

    python scripts/shape_probe.py
"""
import statistics, sys
import torch
sys.path.insert(0, "scripts")
from bench_hop import timed
from ringflex import mods
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.kernels.base import Mods
from ringflex.plan import Segment

H, D = 32, 128
kern = CudnnKernel()
def call(nq, nk, causal):
    q, dout = (torch.randn(1, H, nq, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, H, nk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    m = Mods(None, mods.causal if causal else None)
    segs = (Segment(0, 1, nq), Segment(0, 1, nk)) if causal else (None, None)
    out, lse = kern.forward(q, k, v, *segs, m, D ** -0.5, causal)
    return (lambda: kern.forward(q, k, v, *segs, m, D ** -0.5, causal),
            lambda: kern.backward(q, k, v, out, lse, dout, *segs, m, D ** -0.5, causal))

for n in (16384, 32768):
    h = n // 2
    shapes = {"single none": [(n, n, False)], "rank none": [(h, h, False), (h, h, False)],
              "single causal": [(n, n, True)], "rank causal": [(h, h, True), (h // 2, h, False)]}
    calls = {name: [call(*s) for s in ss] for name, ss in shapes.items()}
    t = {name: [] for name in shapes}
    for _ in range(5):
        for name, cs in calls.items():
            t[name].append(sum(timed(f)[0] for c in cs for f in c))
    med = {name: statistics.median(x) for name, x in t.items()}
    for kind in ("none", "causal"):
        print(f"{n} tokens {kind}: single fwd+bwd {med['single ' + kind]:.3f} ms, one rank's calls {med['rank ' + kind]:.3f} ms, "
              f"ceiling efficiency {med['single ' + kind] / (2 * med['rank ' + kind]):.3f}")
    del calls; torch.cuda.empty_cache()
