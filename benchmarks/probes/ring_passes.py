"""The tensor operations a ring call runs outside its attention kernels, and where in ringflex.

    torchrun --nproc_per_node=2 -m benchmarks.probes.ring_passes --seq-len 16384 --masks causal none --layout zigzag

On a GPU every pass over a buffer outside the hop kernels (a merge, a sum of partial
gradients, a copy, a zero fill) is time the kernels wait for. This runs one fwd+bwd per
mask after warm-up calls and prints, per rank, each operation it made outside the kernels
with its tensors' shapes and dtypes and the two innermost ringflex frames that issued it,
and the bytes they read and write in all (from each operation's tensors' sizes).
Views, allocations and scalar reads are left out; so is the gradient accumulation into
``.grad`` (the inputs' gradients are reset before the call). With ``--device cpu`` (gloo,
reference kernel) it lists the same ring on the CPU.
"""
from __future__ import annotations

import argparse
import traceback
from typing import List

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import make_mods

from tools.ranks import init
import ringflex
from ringflex.kernels.cudnn import CudnnKernel
from ringflex.kernels.flex import FlexKernel
from ringflex.kernels.reference import ReferenceKernel
from ringflex.kernels import fused_merge

_NOT_PASSES = {"view", "_unsafe_view", "slice", "narrow", "detach", "t", "as_strided", "alias", "expand",
               "unsqueeze", "squeeze", "permute", "transpose", "select", "empty", "empty_strided", "empty_like",
               "new_empty", "new_empty_strided", "record_stream", "is_same_size", "lift_fresh", "promote_types",
               "_local_scalar_dense", "allgather_", "allreduce_", "barrier", "send", "recv_"}
_OVERWRITES = {"copy_", "zero_", "fill_"}  # their first tensor is written, not read


class Passes(TorchDispatchMode):
    """Records the operations dispatched outside the hop kernels' ``forward`` and ``backward``."""

    def __init__(self):
        super().__init__()
        self.ops: List[str] = []
        self.bytes = 0  # read and written by them, counted as their tensors' sizes
        self.in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.in_kernel and name not in _NOT_PASSES:
            read = args[1:] if name in _OVERWRITES else args
            written = result if isinstance(result, (tuple, list)) else [result]
            self._record(name, [a for a in args if isinstance(a, torch.Tensor)],
                         [t for t in [*read, *written] if isinstance(t, torch.Tensor)])
        return result

    def _record(self, name: str, shown: List[torch.Tensor], moved: List[torch.Tensor]) -> None:
        frames = [f"{f.filename.rsplit('ringflex/', 1)[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack() if "/ringflex/" in f.filename][-2:]
        tensors = [f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in shown]
        self.ops.append(f"{name}({', '.join(tensors)}) at {' < '.join(reversed(frames)) or 'autograd'}")
        self.bytes += sum(t.numel() * t.element_size() for t in moved)

    def install(self):
        """Marks every hop kernel's forward and backward as inside a kernel, for this mode, and
        records the fused (Triton) merges and sums, which dispatch no torch operation."""
        for cls in (ReferenceKernel, CudnnKernel, FlexKernel):
            for method in ("forward", "backward"):
                setattr(cls, method, self._inside(getattr(cls, method)))
        for name in ("merge", "add"):
            setattr(fused_merge, name, self._fused(name, getattr(fused_merge, name)))

    def _fused(self, name: str, fn):
        def call(d, *args, **kwargs):
            if not self.in_kernel:
                tensors = [d, *_tensors([*args, *kwargs.values()])]
                self._record(f"fused {name}", tensors, tensors)
            return fn(d, *args, **kwargs)
        return call

    def _inside(self, fn):
        def call(*args, **kwargs):
            self.in_kernel += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_kernel -= 1
        return call


def _tensors(args) -> List[torch.Tensor]:
    """The tensors in ``args``, nested in lists and tuples (a sum's parts; a pair's second sum)."""
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += _tensors(a)
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--masks", nargs="+", default=["causal", "none"])
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    device = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    passes = Passes()
    passes.install()
    for mask in args.masks:
        score_mod, mask_mod = make_mods(mask, args.seq_len, device, 4096, 4096)
        torch.manual_seed(0)
        shape = (1, args.heads, args.seq_len, args.head_dim)
        q, k, v = (ringflex.shard(torch.randn(shape, device=device, dtype=dtype), dim=2, layout=args.layout)
                   .requires_grad_() for _ in range(3))
        grad = torch.randn_like(q)

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                         layout=args.layout).backward(grad)

        for _ in range(args.warmup):
            fwd_bwd()
        passes.ops.clear()
        passes.bytes = 0
        with passes:
            fwd_bwd()
        for r in range(world):  # one rank's list at a time
            dist.barrier()
            if r == rank:
                print(f"== {args.seq_len} tokens, {mask}, {args.layout}, rank {rank}: {len(passes.ops)} operations "
                      f"outside the kernels per fwd+bwd, {passes.bytes / 2**20:.1f} MiB read and written", flush=True)
                for op in passes.ops:
                    print("  ", op, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
