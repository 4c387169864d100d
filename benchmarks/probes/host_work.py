"""What a ring call has its host do, counted on the CPU: per rank and fwd+bwd, the transfers, the
cuDNN calls, the fused kernels' launches (by kernel, and those over two row ranges) and
ringflex's own Python function calls (not those a rank makes while it waits for the others).
Counts, not times: the same on any machine, so they show
without a GPU what a layout or a change adds to the host's work, which bounds short calls.

    python -m benchmarks.probes.host_work --world-size 4 --cases window:zigzag window:contiguous

The ranks are gloo processes; the cuDNN kernel runs with its frontend emulated
(``tests/support/emulated_cudnn.py``) and the fused kernels in Triton's interpreter
(``tests/support/interpreted.py``), so the calls take the GPU's paths where these decide
(joined steps, ragged batches, merges and sums by launch). Transfers go through gloo, not the
copy engines. Needs Triton (torch's CUDA builds ship it; on a CPU build, pip install triton).
Masks are those of ``benchmarks.common.make_mods`` at ``--tokens-per-rank`` tokens a rank.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import sys

import torch


# The interpreted kernels run on the GPU there, not on its host: their Python is not counted.
GPU_CODE = os.path.join("kernels", "fused_kernels.py")


def counted(rank: int, world_size: int, cases, tokens: int, heads: int, head_dim: int) -> dict:
    """{case: {what: count}} of this rank's second call of each case (the first builds what calls keep)."""
    from benchmarks.common import make_mods
    from tests.support.emulated_cudnn import on_every_ring_call
    from tests.support.interpreted import fused_on_the_cpu
    import ringflex
    from ringflex.parallel import board, fault
    from ringflex.parallel.comm import RingComm

    cudnn = on_every_ring_call()  # CPU tensors on the cuDNN kernel's paths
    # What a rank calls while it waits for the others (polling) follows the waiting, not the work.
    waits = {fault.wait.__code__, fault.wait_collective.__code__, board.Gathering.wait.__code__}
    launches, seen = fused_on_the_cpu(), collections.Counter()
    for name, cls, method in (("transfers", RingComm, "exchange"), ("cuDNN calls", cudnn.graphs.Graph, "execute")):
        def wrapped(*args, _real=getattr(cls, method), _name=name, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)
        setattr(cls, method, wrapped)
    found = {}
    for case in cases:
        mask, layout = case.split(":")
        seq_len = tokens * world_size
        _, mask_mod = make_mods(mask, seq_len, "cpu", window=tokens // 4, doc_len=tokens // 2)
        g = torch.Generator().manual_seed(0)
        q, k, v = (ringflex.shard(torch.randn(1, heads, seq_len, head_dim, generator=g, dtype=torch.bfloat16), 2,
                                  layout=layout).requires_grad_() for _ in range(3))
        for _ in range(2):
            launches.clear()
            seen.clear()
            python_calls, waiting = collections.Counter(), [0]

            def profile(frame, event, arg):
                name = frame.f_code.co_filename
                ours = f"{os.sep}ringflex{os.sep}" in name and not name.endswith(GPU_CODE)
                if event == "call" and ours and not waiting[0]:
                    python_calls["ringflex's Python calls"] += 1
                if frame.f_code in waits and event in ("call", "return"):
                    waiting[0] += 1 if event == "call" else -1
            sys.setprofile(profile)
            out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask_mod, layout=layout)
            out.sum().backward()
            sys.setprofile(None)
        found[case] = {**seen, **collections.Counter(launches), **python_calls}
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--cases", nargs="+", default=["window:zigzag", "window:contiguous", "documents:zigzag",
                                                        "documents:contiguous"])
    parser.add_argument("--tokens-per-rank", type=int, default=512)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    args = parser.parse_args()
    if importlib.util.find_spec("triton") is None:
        sys.exit("host_work needs Triton, whose interpreter runs the fused kernels here: pip install triton")
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported, in every rank
    sys.path[:0] = [os.path.join(os.getcwd(), "tests")]  # the test support's own imports
    from tests.support.harness import run_world
    per_rank = run_world(args.world_size, counted, args.cases, args.tokens_per_rank, args.heads, args.head_dim,
                         timeout=1800)
    for case in args.cases:
        print(f"{case}, {args.world_size} ranks, {args.tokens_per_rank} tokens a rank, fwd+bwd:")
        names = sorted({name for found in per_rank for name in found[case]})
        for name in names:
            print(f"  {name:35s}" + "".join(f"{found[case].get(name, 0):>8}" for found in per_rank))


if __name__ == "__main__":
    main()
