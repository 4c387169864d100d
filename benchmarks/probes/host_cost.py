"""Host time of the pieces a ring call is made of, one process on one GPU (no ring, so no
second rank's GPU work or host shares the measurement).

    python3 benchmarks/probes/host_cost.py            # the ringflex on PYTHONPATH
    PYTHONPATH=/path/to/other/tree python3 benchmarks/probes/host_cost.py   # another version, to compare

(It imports nothing from benchmarks/, so it runs as a script: ``python -m`` would put the
current tree's ringflex ahead of ``PYTHONPATH``.)

Prints, for each piece, the min and median over 7 rounds of the host time per call (GPU work
queued, not waited for): torch's CUDA calls that a ring call makes dozens of, one bare Triton
launch, and ringflex's own pieces: the cuDNN hop kernel's forward and backward (an unmasked
block; a block of packed documents, one ragged batch), the sum of the own block's dK/dV from
two shares and its own hops' (``RowSum``, as a zigzag rank ends backward), the fused copy of a
block's rows, the argument check's record exchange (on one gloo rank) and the kernel choice;
and the cuDNN frontend's own execute and torch's SDPA on cuDNN beside the hop forward, to
tell the kernel's own cost from ringflex's around it. Host time varies by up to 2x between
runs on a shared host: compare versions in alternating runs. ``--profile WORD ...`` prints a cProfile of the
pieces whose names hold a WORD, say ``--profile documents``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist

from ringflex import mods
from ringflex.kernels import select_kernel
from ringflex.kernels.base import Mods
from ringflex.kernels import fused_merge
from ringflex.kernels.merge import RowSum
from ringflex.kernels import cudnn
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.mod import captured
from ringflex.parallel import agreement
from ringflex.plan.layout import Segment


PROFILED = []  # --profile: the pieces whose names hold one of these get a cProfile too


def timed(name: str, fn, calls: int = 300, rounds: int = 7) -> None:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    if any(word in name for word in PROFILED):
        profiled(name, fn, calls)
    spent = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        spent.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    spent.sort()
    print(f"{name:48s} min {spent[0] * 1e6:7.1f} us   median {spent[rounds // 2] * 1e6:7.1f} us", flush=True)


def profiled(name: str, fn, calls: int) -> None:
    """The functions under which ``calls`` calls of ``fn`` spend the most host time, their own and in all."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    print(f"cProfile of {calls} calls: {name}\n{out.getvalue()}", flush=True)


def sdpa_on_cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def bare_triton_launch():
    import triton

    @triton.jit
    def nothing(x, n):
        pass
    return lambda t: nothing[(1,)](t, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024, help="rows of the block (B=1, H=32, D=128, bf16)")
    p.add_argument("--profile", nargs="+", default=[], metavar="WORD",
                   help="also a cProfile of the pieces whose names hold WORD (it inflates their host time)")
    args = p.parse_args()
    PROFILED.extend(args.profile)
    device = torch.device("cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    n = args.rows
    q, k, v = (torch.randn(1, 32, n, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    side = torch.cuda.Stream()

    timed("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(device))
    timed("current_stream().record_event()", lambda: torch.cuda.current_stream().record_event())
    timed("stream.wait_stream(current)", lambda: side.wait_stream(torch.cuda.current_stream()))
    timed("torch.empty (64 MiB)", lambda: torch.empty((1, 32, 8192, 128), dtype=torch.bfloat16, device=device))
    timed("tensor.narrow", lambda: q.narrow(2, 10, 100))
    timed("torch.tensor of 430 ints", lambda: torch.tensor(list(range(430)), dtype=torch.int64))
    launch = bare_triton_launch()
    timed("a bare Triton launch", lambda: launch(q))

    kernel, plain = CudnnKernel(), Mods(None, None)
    out, lse, _ = kernel.forward(q, k, v, None, None, plain, 0.088, False)
    dout = torch.randn_like(out)
    timed("cuDNN hop forward, no mask", lambda: kernel.forward(q, k, v, None, None, plain, 0.088, False))
    timed("cuDNN hop backward, no mask", lambda: kernel.backward(q, k, v, out, lse, dout, None, None, plain, 0.088, False))
    with captured.one_walk():  # as inside a ring call's pass, where the mods' walks and traces are kept
        timed("cuDNN hop forward, no mask, within a pass", lambda: kernel.forward(q, k, v, None, None, plain, 0.088,
                                                                                 False))
    kernel.forward(q, k, v, None, None, plain, 0.088, False)
    built = next(reversed(cudnn.graphs._GRAPHS.values()))  # the graph that forward ran
    buffers = [dict(q=q, k=k, v=v, out=out, lse=lse.unsqueeze(-1))[name] for name in built.names]
    workspace = torch.empty(max(1, built.workspace), dtype=torch.uint8, device=device)
    handle = cudnn.frontend.handle(device)
    timed("  of it: the cuDNN frontend's execute alone", lambda: built.graph.execute(
        buffers, workspace, handle=handle, tensor_uids=built.uids))
    timed("torch's SDPA forward on cuDNN, no mask (for comparison)", lambda: sdpa_on_cudnn(q, k, v))
    lengths = [3 * n // 10, n // 2, n - 3 * n // 10 - n // 2]
    docs, seg = Mods(None, mods.document(mods.document_ids(lengths, device=device))), Segment(0, 1, n)
    out, lse, _ = kernel.forward(q, k, v, seg, seg, docs, 0.088, True)
    timed("cuDNN hop forward, 3 documents (one batch)", lambda: kernel.forward(q, k, v, seg, seg, docs, 0.088, True))
    timed("cuDNN hop backward, 3 documents (one batch)",
          lambda: kernel.backward(q, k, v, out, lse, dout, seg, seg, docs, 0.088, True))
    # A hop the ring cuts to a document that straddles two ranks: every query row in it, its
    # keys the second half of the block before (one batch, whose dK/dV the rest of the block fills).
    cut = Mods(None, mods.document(mods.document_ids([n // 2, n], device=device)))
    q_cut, q_seg = q[:, :, : n // 2], Segment(n, 1, n // 2)
    out, lse, _ = kernel.forward(q_cut, k, v, q_seg, seg, cut, 0.088, True)
    dout_cut = torch.randn_like(out)
    timed("cuDNN hop forward, a cut document", lambda: kernel.forward(q_cut, k, v, q_seg, seg, cut, 0.088, True))
    timed("cuDNN hop backward, a cut document",
          lambda: kernel.backward(q_cut, k, v, out, lse, dout_cut, q_seg, seg, cut, 0.088, True))
    half = q.narrow(2, 0, n // 2)
    share_rows = [(0, n // 4), (3 * n // 4, n)]
    shares = [(r, q[:, :, : r[1] - r[0]].clone(), v[:, :, : r[1] - r[0]].clone()) for r in share_rows]
    own = q.clone(), v.clone()

    def own_block_gradient():  # backward's end on a zigzag rank whose both neighbours read its block's edges
        total = RowSum([k.shape, v.shape], k.dtype, torch.float32, device, share_rows + [(0, n)])
        for r, dk, dv in shares:
            total.add(r, dk, dv, reused=True)
        total.add((0, n), *own)
        return total.result()
    timed("the own block's dK/dV sum: two shares, own hops", own_block_gradient)
    timed("fused copy of a block's rows", lambda: fused_merge.add(torch.empty(half.shape, dtype=half.dtype,
                                                                                device=device), [half]))
    timed("the agreement's exchange (one gloo rank)",
          lambda: agreement.exchange(dist.group.WORLD, list(range(30)), None, "the argument check"))
    timed("kernel choice (select_kernel)", lambda: select_kernel("auto", q, k, v, docs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
