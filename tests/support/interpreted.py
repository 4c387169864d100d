"""Ring calls whose merges and sums run the fused merge's Triton kernels on the CPU, in
Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before Triton is imported):
every merge, sum, pair of sums and copy of rows that a ring call on a GPU hands those kernels,
here on CPU tensors, with the cuDNN kernel emulated (``emulated_cudnn``)."""
import functools

import torch

from support.random_calls import local_mask_call, random_call, ring_errors


def fused_on_the_cpu() -> list:
    """Makes this process's ring hand CPU tensors to the fused kernels, each launch through
    Triton's JIT (which interprets it; ``kernels.launch``'s direct launches need a compiled
    kernel); returns the launches made, by kernel name (and "over two ranges" where the launch
    took a second range of rows)."""
    from ringflex.kernels import fused_merge
    fused_merge._in_rows_of_one_gpu = fused_merge._in_rows_of_elements
    launches = []
    for launcher in fused_merge._kernels():
        jit = launcher.kernel
        second = launcher.names.index("length2")

        def launch(grid, arguments, constants, jit=jit, second=second):
            launches.append(jit.fn.__name__ + (" over two ranges" if arguments[second] else ""))
            jit[grid](*arguments, **constants)
        launcher.launch = launch
    return launches


def interpreted_failures(rank, world_size, count):
    """``count`` local-mask calls and ``count`` random calls on the emulated cuDNN kernel (fp32)
    against the definition, their merges and sums in the interpreted kernels; and how many
    launches of each kernel they made on this rank."""
    from support.emulated_cudnn import on_every_ring_call
    from ringflex.kernels.base import Mods
    cudnn = on_every_ring_call()
    launches, failures = fused_on_the_cpu(), []
    for seed in range(100 * world_size, 100 * world_size + count):
        for make in (local_mask_call, functools.partial(random_call, gathers=False)):
            call = make(seed, world_size, dtype=torch.float32)
            runs_on_flex = call.learnable is not None or cudnn.lowering_error(Mods(call.score_mod, call.mask_mod))
            if make is not local_mask_call and runs_on_flex:
                continue  # ringflex runs those on flex_attention
            errors = ring_errors(call, make(seed, world_size))
            if max(errors.values()) > 2e-4:
                failures.append(f"rank {rank} seed {seed} ({call.describe()}): {errors}")
    return failures, {name: launches.count(name) for name in set(launches)}
