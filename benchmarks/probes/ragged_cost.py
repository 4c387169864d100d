"""A ragged batch against a call per document (GPU only): what each costs per block.

For packed documents of several lengths in one block (8192 rows, B=1, H=32, D=128, bf16),
and one document over all of it, it measures, forward and backward, the GPU time of the
kernels (torch.profiler, per call) and the host time per call, once with the block's
documents as one ragged batch and once with a call per document.

    python -m benchmarks.probes.ragged_cost
"""
from __future__ import annotations

import torch

from benchmarks.common import hop_timed, kernel_times
from ringflex import mods
from ringflex.kernels import cudnn as cudnn_kernel
from ringflex.kernels.base import Mods
from ringflex.plan.layout import Segment

ROWS = 8192
LAYOUTS = ([ROWS], [4096, 4096], [2048] * 4, [1024] * 8, [512] * 16, [512, 1536, 768, 2048, 1024, 256, 2048])


def costs(q, k, v, dout, m: Mods, batched: bool):
    """(fwd GPU ms, fwd host us, bwd GPU ms, bwd host us) of the block."""
    cudnn_kernel.clear_cache()
    kernel, seg, scale = cudnn_kernel.CudnnKernel(), Segment(0, 1, ROWS), q.shape[-1] ** -0.5
    if not batched:
        kernel._calls = lambda program, runs, *tensors: tuple(runs)
    out, lse, _ = kernel.forward(q, k, v, seg, seg, m, scale, True)
    forward = lambda: kernel.forward(q, k, v, seg, seg, m, scale, True)  # noqa: E731
    backward = lambda: kernel.backward(q, k, v, out, lse, dout, seg, seg, m, scale, True)  # noqa: E731
    backward()
    torch.cuda.synchronize()
    return [x for fn in (forward, backward) for x in (sum(kernel_times(fn).values()) / 1e3, hop_timed(fn)[1])]


def main():
    q, k, v, dout = (torch.randn(1, 32, ROWS, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for lengths in LAYOUTS:
        m = Mods(None, mods.document(mods.document_ids(lengths, device="cuda")))
        line = []
        for batched in (False, True):
            fwd_gpu, fwd_host, bwd_gpu, bwd_host = costs(q, k, v, dout, m, batched)
            line.append(f"{'ragged' if batched else 'per document'}: fwd {fwd_gpu:.3f} ms GPU, {fwd_host:.0f} us host; "
                        f"bwd {bwd_gpu:.3f} ms GPU, {bwd_host:.0f} us host")
        print(f"{len(lengths)} documents, longest {max(lengths)}: " + " | ".join(line))


if __name__ == "__main__":
    main()
