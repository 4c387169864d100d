"""Data parallel (FSDP2) x context parallel (ringflex) training on a 2-D device mesh.

The layout of torchtitan's training loop: a ``(dp, cp)`` DeviceMesh; parameters sharded by
FSDP2 (``fully_shard``, each block, then the root) over all ranks, the ``dp`` and ``cp``
dimensions flattened, as torchtitan's ``dp_shard_cp``; each data-parallel replica trains on its
own rows, and the ``cp`` ranks of a replica split each of its sequences -- the ring is
``group=mesh["cp"]``.

    torchrun --nproc_per_node=4 examples/fsdp_cp.py                    # CPU, gloo: 2 dp x 2 cp
    python examples/fsdp_cp.py                                         # one process: the reference
    torchrun --nproc_per_node=8 examples/fsdp_cp.py --device cuda --dtype bfloat16 --cp 4 \\
        --seq-len 65536 --batch 2 --dim 2048 --layers 8 --heads 16 --kv-heads 4 --vocab 32000   # (not yet run on GPUs)

The loss is the mean over the labelled tokens of all replicas (``sharded_cross_entropy`` over
the flattened mesh: the same value on every rank, each rank back-propagating it into its own
tokens); FSDP's reduce-scatter averages the gradients over all ranks, so the loss is multiplied
by the number of ranks first, and ``reduce_gradients`` is not called (it refuses parameters
sharded over the ring's ranks). One process trains the plain model on the same rows: the
printed losses match (to 1e-12 in float64 on the CPU). The model is the GPT of
``examples/train_example.py`` (RoPE, causal SDPA), unchanged.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringflex
from ringflex.progress import Progress
from ringflex.training import destroy_process_group, next_token_labels, shard_batch, sharded_cross_entropy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_example import GPT  # noqa: E402  (the model of the plain torchrun example)


def make_rows(step, args):
    """The global batch of ``step`` [batch, seq_len], the same on every rank: sequences whose
    second half repeats the first (attention can learn to copy)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    first = torch.randint(0, args.vocab, (args.batch, args.seq_len // 2), generator=g)
    tokens = torch.cat([first, first], dim=1)
    return {"tokens": tokens, "labels": next_token_labels(tokens),
            "positions": torch.arange(args.seq_len).expand(args.batch, -1)}


def setup(args):
    """(mesh or None, device): under torchrun a (dp, cp) mesh; one process, none."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if world_size == 1:
        return None, device
    cp = args.cp
    if world_size % cp or args.batch % (world_size // cp):
        sys.exit(f"--cp {cp} must divide the world size {world_size}, and the replicas ({world_size // cp}) --batch "
                 f"{args.batch}")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(args.device, (world_size // cp, cp), mesh_dim_names=("dp", "cp")), device


def train(args) -> list:
    mesh, device = setup(args)
    dtype = getattr(torch, args.dtype)
    mixed = dtype in (torch.bfloat16, torch.float16)  # FSDP's mixed precision over fp32 weights
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.kv_heads).to(
        device, torch.float32 if mixed else dtype)
    if mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        # torchtitan's dp_shard_cp: FSDP shards over every rank (DeviceMesh._flatten is how torchtitan names it)
        dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if mixed else \
            MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=dp_cp, mp_policy=policy)
        fully_shard(model, mesh=dp_cp, mp_policy=policy)
        replica, replicas = mesh.get_local_rank("dp"), mesh.size(0)
        forward = ringflex.RingFlexAttention(model, group=mesh["cp"], layout=args.layout, backend=args.backend)
    else:
        replica, replicas, forward = 0, 1, model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    progress = Progress(args.steps, label="step", interval=args.progress_every)
    losses, rows = [], args.batch // replicas
    start = None
    for step in range(1, args.steps + 1):
        if step == 2:  # tokens/s from the second step: the first one plans and warms up
            start = time.perf_counter()
        batch = {key: value[replica * rows:(replica + 1) * rows] for key, value in make_rows(step, args).items()}
        if mesh is not None:
            batch = shard_batch(batch, dim=1, group=mesh["cp"], layout=args.layout)
        batch = {key: value.to(device) for key, value in batch.items()}
        with torch.autocast(device.type, dtype=dtype, enabled=mixed and mesh is None):
            logits = forward(batch["tokens"], batch["positions"])
        if mesh is not None:
            loss = sharded_cross_entropy(logits, batch["labels"], group=dp_cp)
            (loss * dist.get_world_size()).backward()  # FSDP averages over the ranks: their sum is the gradient
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float() if mixed else logits.flatten(0, 1),
                                   batch["labels"].flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        fields = {"loss": losses[-1]}
        if start is not None and step > 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            fields["tok_s"] = (step - 1) * args.batch * args.seq_len / (time.perf_counter() - start)
        progress.update(step, **fields)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shape = f"{replicas} dp x {dist.get_world_size() // replicas} cp" if mesh is not None else "one process"
        print(f"done: {args.steps} steps ({shape}); losses " + " ".join(f"{x:.15e}" for x in losses), flush=True)
    if dist.is_initialized():
        destroy_process_group()
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda: a GPU per rank, NCCL)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"],
                   help="float64/float32: the model's dtype; bfloat16/float16: FSDP's mixed precision over fp32 "
                        "weights")
    p.add_argument("--cp", type=int, default=2, help="ranks per ring (the mesh's cp dimension); dp = ranks / cp")
    p.add_argument("--layout", default="zigzag", choices=ringflex.LAYOUTS,
                   help="how a sequence is split over a ring (zigzag balances causal work)")
    p.add_argument("--backend", default="auto", choices=["auto", "cudnn", "flex", "reference"],
                   help="the kernel of each hop: auto takes cudnn where it can run the call, else flex on a GPU, "
                        "else reference")
    p.add_argument("--steps", type=int, default=20,
                   help="optimizer steps")
    p.add_argument("--batch", type=int, default=4, help="rows per step over all replicas")
    p.add_argument("--seq-len", type=int, default=64,
                   help="tokens per sequence (the whole sequence: each rank of a ring holds seq-len / cp)")
    p.add_argument("--vocab", type=int, default=32,
                   help="vocabulary size")
    p.add_argument("--dim", type=int, default=32,
                   help="model width")
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers")
    p.add_argument("--heads", type=int, default=4,
                   help="query heads")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads (grouped-query attention)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the data (every rank alike)")
    p.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    if args.dim % args.heads or args.heads % args.kv_heads or (args.dim // args.heads) % 2 or args.seq_len % 2:
        p.error("--dim must split into --heads of even size, --heads be a multiple of --kv-heads, --seq-len even")
    return args


if __name__ == "__main__":
    train(parse_args())
