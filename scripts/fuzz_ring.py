"""Random ring calls on GPUs against the definition (run with torchrun).

    torchrun --nproc_per_node=2 scripts/fuzz_ring.py --seeds 0 500 --seconds 300   # ranks may share a GPU
    torchrun --nproc_per_node=1 scripts/fuzz_ring.py --no-gathers                 # the cuDNN kernel alone

Each seed is a call of ``tests/random_calls.py`` (layout, lengths, heads, mixed masks and
score_mods, sinks, an LSE the loss reads), run in bf16 on the backend given and compared
with the same call in fp64 on the CPU. Rank 0 prints every call beyond the tolerance, with
its seed, and a summary; the script exits 1 if any call failed. A call that raises inside the
ring (which breaks it: ``RingFailure``) is reported, and the next one runs on a new process group.
"""
import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ranks  # noqa: E402
from harness import weigh_cudnn_calls_as_free  # noqa: E402
from random_calls import random_call, ring_errors  # noqa: E402
from ringflex import lending  # noqa: E402
from ringflex.parallel.fault import CallRejected  # noqa: E402

SIZES = (4, 64, 512)  # most layout chunks per rank, by seed: tiny blocks, a few tiles, many


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 200], metavar=("FIRST", "COUNT"))
    p.add_argument("--seconds", type=float, default=300, help="stop starting new calls after this long")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo and the reference kernel")
    p.add_argument("--no-gathers", action="store_true", help="no mod indexes a tensor by q_idx and kv_idx "
                   "(those run on flex_attention, whose compiles take most of the time)")
    p.add_argument("--tolerance", type=float, default=3e-2, help="max error relative to the largest value (>= 0.1)")
    args = p.parse_args()
    device = ranks.init(args.device)
    weigh_cudnn_calls_as_free()  # small blocks lend as large ones would
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flags_on = "cpu" if dist.get_backend() == "gloo" else device
    group, quantum = dist.new_group(backend=dist.get_backend()), lending.QUANTUM
    warnings.simplefilter("ignore")  # fallbacks say so; the errors are what is checked
    start, ran, failed = time.time(), 0, []
    first, count = args.seeds
    for seed in range(first, first + count):
        late = torch.tensor([time.time() - start > args.seconds], device=flags_on)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)  # every rank stops at the same call
        if late.item():
            break
        size = dict(max_chunks=SIZES[seed % len(SIZES)], gathers=not args.no_gathers)
        call = random_call(seed, world_size, device, torch.bfloat16, head_dims=(64, 128), **size)
        truth = random_call(seed, world_size, **size, head_dims=(64, 128))
        lending.QUANTUM = 1 if seed % 2 else quantum  # half the calls lend any row that evens the ranks
        broken = False
        try:
            errors = ring_errors(call, truth, args.backend, group, floor=0.1)
            problem = {name: e for name, e in errors.items() if not e <= args.tolerance}
        except Exception as e:  # noqa: BLE001 (reported, and the next call goes on)
            broken = not isinstance(e, CallRejected)  # raised before any transfer: the group still serves
            problem = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if rank == 0:
                traceback.print_exc(limit=-3)
        flags = torch.tensor([int(bool(problem)), int(broken)], device=flags_on)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item():
            group = dist.new_group(backend=dist.get_backend())
        ran += 1
        if flags[0].item():
            failed.append(seed)
            if rank == 0:
                shown = {k: v if isinstance(v, str) else f"{v:.2e}" for k, v in problem.items()}
                print(f"seed {seed}: {call.describe()}: {shown or 'failed on another rank'}", flush=True)
    if rank == 0:
        seeds = f" (seeds {failed})" if failed else ""
        print(f"{ran} random calls over {world_size} rank(s), backend {args.backend}, "
              f"{time.time() - start:.0f} s: {len(failed)} beyond {args.tolerance}{seeds}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
