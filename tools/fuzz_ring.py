"""Random ring calls on GPUs against the definition (run with torchrun).

    torchrun --nproc_per_node=2 -m tools.fuzz_ring --seeds 0 500 --seconds 300   # ranks may share a GPU
    torchrun --nproc_per_node=1 -m tools.fuzz_ring --no-gathers                 # the cuDNN kernel alone
    torchrun --nproc_per_node=1 -m tools.fuzz_ring --no-gathers --tiles         # blocks planned from tiles
    torchrun --nproc_per_node=4 -m tools.fuzz_ring --local-masks                # windows, documents over zigzag

(from the repository root). Each seed is a call of ``tests/support/random_calls.py`` (layout, lengths, heads, mixed masks and
score_mods, sinks, an LSE the loss reads), run in bf16 on the backend given and compared
with the same call (the same bf16 values) in fp64 on the CPU. A call beyond the tolerance
runs again on the reference kernel (fp32 arithmetic on the same bf16 values) and, whole, on the
same kernel in each rank's process alone: it fails only where the first error is also beyond
twice each of those, as bf16 alone makes some gradients of a sharp softmax ill-conditioned
(and flash kernels, flex_attention's among them, round P and dS to bf16 as well). Every rank
prints what it found of every call that fails, with its seed; rank 0 the calls so far every
minute (a run cut short still says how far it got) and a summary at the end; the script
exits 1 if any call failed. A call that raises inside the ring (which breaks it:
``RingFailure``) is reported, and the next one runs on a new process group; one that breaks
the rank's CUDA context (an illegal address or instruction) ends the run at once, with its seed.
"""
import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from ringflex.parallel.fault import CallRejected
from ringflex.plan import extents, lending
from tests.support.harness import weigh_cudnn_calls_as_free
from tests.support.random_calls import local_mask_call, random_call, ring_errors
from tools import ranks

SIZES = (4, 64, 512)  # most layout chunks per rank, by seed: tiny blocks, a few tiles, many
REPORT_EVERY_S = 60


def bf16_call(seed: int, world_size: int, device, make: Callable):
    """The call ``make`` (``random_call`` of some sizes, or ``local_mask_call``) gives for
    ``seed``, in bf16 on ``device``."""
    return make(seed, world_size, device, torch.bfloat16)


def truth(seed: int, world_size: int, make: Callable):
    """The call of ``seed`` in fp64 on the CPU, of the same bf16 values (made anew for each
    use: gradients accumulate in its tensors)."""
    return make(seed, world_size, values_of=torch.bfloat16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 200], metavar=("FIRST", "COUNT"))
    p.add_argument("--seconds", type=float, default=300, help="stop starting new calls after this long")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo and the reference kernel")
    p.add_argument("--no-gathers", action="store_true", help="no mod indexes a tensor by q_idx and kv_idx "
                   "(those run on flex_attention, whose compiles take most of the time)")
    p.add_argument("--tiles", action="store_true", help="plan every block from tiles of keys, as blocks of more "
                   "than 2**26 pairs are (ringflex/extents.py): their exact plans at the sizes of these calls")
    p.add_argument("--local-masks", action="store_true", help="windows and packed documents over zigzag alone, "
                   "whose ranks read both neighbours: on 3 ranks and more a step brings both at once, and the "
                   "cuDNN kernel runs its hops as one call")
    p.add_argument("--tolerance", type=float, default=3e-2, help="max error relative to the largest value (>= 0.1)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), metavar="CHUNKS",
                   help="the most layout chunks per rank, taken in turn by seed (on a CPU, a call of 512 chunks a "
                        "rank over 4 ranks takes minutes to plan: 4 64 leaves those out)")
    return p.parse_args(argv)


def fuzz(args, device):
    """Runs the calls of ``args`` on the default group's ranks (devices ``device``); returns
    (calls run, seeds that failed)."""
    weigh_cudnn_calls_as_free()  # small blocks lend as large ones would
    if args.tiles:
        extents._DENSE_AREA = 0
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flags_on = "cpu" if dist.get_backend() == "gloo" else device
    group, quantum = dist.new_group(backend=dist.get_backend()), lending.QUANTUM
    alone, _ = dist.new_subgroups(1)
    warnings.simplefilter("ignore")  # fallbacks say so; the errors are what is checked
    start, ran, failed = time.time(), 0, []
    reported = start
    first, count = args.seeds
    for seed in range(first, first + count):
        late = torch.tensor([time.time() - start > args.seconds], device=flags_on)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)  # every rank stops at the same call
        if late.item():
            break
        make = local_mask_call if args.local_masks else functools.partial(
            random_call, max_chunks=args.sizes[seed % len(args.sizes)], gathers=not args.no_gathers,
            head_dims=(64, 128))
        lending.QUANTUM = 1 if seed % 2 else quantum  # half the calls lend any row that evens the ranks
        def errors_on(backend, over=group):  # over ``alone``: the whole call in this rank's process alone
            calls = bf16_call(seed, world_size, device, make), truth(seed, world_size, make)
            if over is alone:
                calls = [dataclasses.replace(c, layout="contiguous") for c in calls]
            return ring_errors(*calls, backend, over, floor=0.1)

        errors, problem, broken = None, {}, False
        try:
            errors = errors_on(args.backend)
        except Exception as e:  # noqa: BLE001 (reported, and the next call goes on)
            broken = not isinstance(e, CallRejected)  # raised before any transfer: the group still serves
            problem = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc(limit=-3)
            if isinstance(e, torch.AcceleratorError):  # the process's CUDA context is broken for good
                # and the other ranks may be blocked on this GPU's transfers: end the run (torchrun then
                # stops every rank), saying which call did it
                print(f"seed {seed}, rank {rank}: {truth(seed, world_size, make).describe()}: {problem['error']}; "
                      f"{ran} calls ran before it", flush=True)
                os._exit(1)
        beyond = errors is not None and any(not e <= args.tolerance for e in errors.values())
        flags = torch.tensor([int(beyond), int(errors is None), int(broken)], device=flags_on)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item() and not flags[1].item():
            # A sharp softmax makes some gradients ill-conditioned in bf16 (the backward reads the
            # rounded output, and flash kernels round P and dS to bf16 before their products): an
            # error is the ring's only if the reference kernel, computing in fp32 from the same
            # bf16 values, and the same kernel on one process both come out well closer.
            reference, one = errors_on("reference"), errors_on(args.backend, alone)
            problem = {name: f"{e:.2e} (reference kernel {reference[name]:.2e}, one process {one[name]:.2e})"
                       for name, e in errors.items()
                       if not e <= max(args.tolerance, 2 * reference[name], 2 * one[name])}
        flags = torch.tensor([int(bool(problem)), int(broken)], device=flags_on)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item():
            group = dist.new_group(backend=dist.get_backend())
        ran += 1
        if flags[0].item():
            failed.append(seed)
            if problem or rank == 0:  # every rank names what it found
                print(f"seed {seed}, rank {rank}: {truth(seed, world_size, make).describe()}: "
                      f"{problem or 'failed on another rank'}", flush=True)
        if rank == 0 and time.time() - reported > REPORT_EVERY_S:
            reported = time.time()
            print(f"{ran} calls so far ({len(failed)} failed), through seed {seed}, {reported - start:.0f} s", flush=True)
    lending.QUANTUM = quantum
    return ran, failed


def main():
    args = parse_args()
    device = ranks.init(args.device)
    start = time.time()
    ran, failed = fuzz(args, device)
    if dist.get_rank() == 0:
        seeds = f" (seeds {failed})" if failed else ""
        print(f"{ran} random calls over {dist.get_world_size()} rank(s), backend {args.backend}, "
              f"{time.time() - start:.0f} s: {len(failed)} failed{seeds}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
