"""Runs a function on a real ring: W spawned processes joined by a gloo (or, on GPUs, NCCL) process group."""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


_STACKS_BEFORE_S = 1.5  # a rank still running this long before the deadline writes its stacks


def _stacks_file(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks.{rank}"


def _worker(rank, world_size, store_path, environ, backend, fn, args, results, deadline):
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as a spawned child would see it
    torch.set_num_threads(1)
    # Where a rank hangs, its threads' Python stacks (written shortly before the parent's
    # deadline) go into the TimeoutError: which wait it hangs in, on every rank.
    stacks = open(_stacks_file(store_path, rank), "w")
    faulthandler.dump_traceback_later(max(0.1, deadline - _STACKS_BEFORE_S - time.time()), file=stacks)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        # Every rank's connections are up before any rank may finish and close its own (gloo's
        # set-up fails on a rank whose peer exits meanwhile: a rank whose function returns at once).
        dist.barrier()
        # Pickled here, by value: a queue would pass tensors as file descriptors served by this
        # process, which may have exited by the time the parent reads them.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, the parent decides
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world_size: int, fn, *args, timeout: float = 240.0, allow_errors: bool = False,
              backend: str = "gloo"):
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results.
    ``backend="nccl"``: rank r runs on GPU r.

    A rank that raises fails the call (unless ``allow_errors``: then the traceback text is
    that rank's result); ranks still running after ``timeout`` seconds are killed and the
    call raises TimeoutError, so a hang fails a test instead of blocking it; its message holds
    the Python stacks of those ranks' threads, as they were just before the deadline.
    """
    # Children fork from a server that has imported torch once: starting a rank costs
    # milliseconds instead of a fresh interpreter's seconds.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ringflex"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store, dict(os.environ), backend, fn, args, results,
                                                   time.time() + timeout), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out, deadline = {}, time.monotonic() + timeout
        try:
            while len(out) < world_size:
                try:
                    rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue_lib.Empty:
                    running = sorted(set(range(world_size)) - set(out))
                    raise TimeoutError(f"ranks {running} did not finish within {timeout} s"
                                       + "".join(_stacks(store, r) for r in running)) from None
                if status == "error" and not allow_errors:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = pickle.loads(value) if status == "ok" else value
        finally:
            hanging = len(out) < world_size  # a timeout or a rank's error: the others need not be waited for
            for p in procs:
                p.join(timeout=0.5 if hanging else 5)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world_size)]


def _stacks(store_path: str, rank: int) -> str:
    try:
        with open(_stacks_file(store_path, rank)) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return f"\n--- rank {rank}, shortly before the deadline:\n{text or '(no stacks written)'}"


def gpu_backend(world_size: int) -> str:
    """The backend of a world of GPU ranks: NCCL where each rank has a GPU of its own, else
    gloo (NCCL refuses ranks that share a GPU; ``on_a_gpu``)."""
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


def weigh_cudnn_calls_as_free() -> None:
    """Lending weighs a cuDNN call as no work beyond its pairs (``HopKernel.call_pairs``): at a
    check's small sizes a call's own cost would outweigh every loan, and the check is of the
    lent rows' numbers, so its calls lend as large ones would (the default's threshold,
    ``lending.MIN_CALLS`` calls' worth, is then 0 too). In this process only."""
    from ringflex.kernels.cudnn import CudnnKernel
    CudnnKernel.call_pairs = lambda self, batch, heads, head_dim: 0


def price_moves_by_their_rows() -> None:
    """Re-sharding weighs a move by the rows it carries alone, without its exchanges' fixed
    host work (``plan.cost.MOVE_HOST_PAIRS``): at a test's few tokens a rank that work
    outweighs what a move saves, and these tests are of the moved call's numbers, so their
    calls move as longer ones would. In this process only."""
    from ringflex.plan import sharding
    sharding.MOVE_HOST_PAIRS = 0


def on_a_gpu(rank: int) -> torch.device:
    """Sets and returns rank r's GPU: GPU r, or with fewer GPUs than ranks one they share (in
    a gloo world, ``gpu_backend``; the copy-engine transport then maps mailboxes by CUDA IPC)."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
