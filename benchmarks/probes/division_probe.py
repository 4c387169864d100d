"""cuDNN's integer division at exact multiples: dilated and chunked masks (with and without a
softcap) at 1M-token offsets, on the cuDNN kernel against the reference kernel (one GPU).

    python3 -m benchmarks.probes.division_probe

Prints every (mask, divisor, block) whose output or LSE differs, then the worst error.
cuDNN divides by multiplying with a rounded reciprocal, which lands one low at some exact
multiples; the kernel's lowering corrects the quotient (docs/cudnn.md, "Integer division")."""
import torch
from ringflex import mods
from ringflex.kernels.base import Mods
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.kernels.reference import ReferenceKernel
from ringflex.plan.layout import Segment
torch.manual_seed(0)
worst = 0.0
for d in (3, 7, 41, 47, 55, 61, 97, 1000, 4093):
    for name, mask in (("dilated", lambda b, h, q, kv, d=d: ((q - kv) % d == 0) & (q >= kv)),
                       ("chunked", lambda b, h, q, kv, d=d: q // d == kv // d),
                       ("softcap dilated", None)):
        score = mods.softcap(20.0) if name == "softcap dilated" else None
        mask = mask or (lambda b, h, q, kv, d=d: ((q - kv) % d == 0) | (q == kv))
        for qs, ks in ((Segment(2**20, 1, 512), Segment(2**20 - 4 * d, 1, 512)), (Segment(2**20 + 5, 1, 256), Segment(2**20 + 5, 1, 256))):
            q, k, v, dout = (torch.randn(1, 2, s.length, 64, device="cuda", dtype=torch.bfloat16) for s in (qs, ks, ks, qs))
            m = Mods(score, mask)
            ro, rl, _ = ReferenceKernel().forward(q, k, v, qs, ks, m, 0.125, True)
            co, cl, _ = CudnnKernel(split_depth=0).forward(q, k, v, qs, ks, m, 0.125, True)
            same_empty = torch.equal(rl.isneginf(), cl.isneginf())
            lse_err = (rl - cl).abs()[rl.isfinite()].max().item() if rl.isfinite().any() else 0.0
            err = (ro.float() - co.float()).abs().max().item()
            worst = max(worst, err if same_empty else float("inf"), lse_err)
            if not same_empty or lse_err > 0.02 or err > 0.05:
                print(f"MISMATCH {name} d={d} q={qs} kv={ks}: out {err:.3g} lse {lse_err:.3g} empty rows same {same_empty}")
print(f"worst out/lse error {worst:.3g}")
