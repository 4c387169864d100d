"""The rest of a context-parallel training step: sharded inputs, labels, positions, loss, gradients.

Convention (the same as ``ringflex.unshard``): a value every rank holds alike -- the loss --
is counted once. Each rank back-propagates the loss into its own tokens; the ring carries
the gradients that cross ranks; each rank's parameter gradients then hold its tokens' share
and ``reduce_gradients`` sums them over the group.
"""
from __future__ import annotations

import copy
import sys
import time
from typing import Iterable, List, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .parallel import mesh as meshes
from .mod.fingerprint import digest
from .parallel import agreement
from .parallel.groups import rank_and_size
from .parallel.shard import shard
from .plan import layout as layouts


def _group_size(group) -> int:
    return meshes.world_size(group)


def shard_batch(batch, *, dim: int = 1, group=None, layout=None):
    """This rank's shard, along ``dim``, of every tensor of ``batch`` (a tensor, a mapping, a
    list or a (named) tuple); other values pass unchanged. Shard inputs, labels and position ids together
    so that every token keeps its label and its global position. ``layout``: as ``shard``'s."""
    if isinstance(batch, Tensor):
        return shard(batch, dim, group, layout)
    if isinstance(batch, Mapping):
        sharded = {key: shard_batch(value, dim=dim, group=group, layout=layout) for key, value in batch.items()}
        if isinstance(batch, dict):  # a copy keeps what the type holds besides its items (a defaultdict's factory)
            copied = copy.copy(batch)
            copied.update(sharded)
            return copied
        return type(batch)(sharded)
    if isinstance(batch, (list, tuple)):
        values = [shard_batch(value, dim=dim, group=group, layout=layout) for value in batch]
        return type(batch)(*values) if hasattr(batch, "_fields") else type(batch)(values)  # a namedtuple takes fields
    return batch


def position_ids(seq_len: int, *, group=None, layout=None, device=None) -> Tensor:
    """Global positions [seq_len // world_size] of this rank's tokens in ``layout`` (as
    ``shard``'s; None: the default): pass them to RoPE."""
    layout = layouts.or_default(layout)
    if meshes.describe(group) is not None:  # a heads x ring mesh: its own order (``ringflex.mesh``)
        return meshes.positions(layout, seq_len, group, device)
    rank, world_size = rank_and_size(group)
    return layouts.positions(layout, seq_len, world_size, rank, device)


def next_token_labels(tokens: Tensor, *, doc_ids: Optional[Tensor] = None, ignore_index: int = -100) -> Tensor:
    """Labels of next-token prediction for the FULL sequence ``tokens`` [..., S]: ``tokens``
    shifted left by one, ``ignore_index`` at the end and, given the per-token ``doc_ids`` [S]
    of a packed batch, at the last token of every document. Shift before sharding: a token's
    successor may live on another rank."""
    labels = torch.full_like(tokens, ignore_index)
    labels[..., :-1] = tokens[..., 1:]
    if doc_ids is not None:
        if doc_ids.shape[-1] != tokens.shape[-1]:
            raise ValueError(f"doc_ids must have one id per token ({tokens.shape[-1]}), got shape {tuple(doc_ids.shape)}")
        ends = torch.ones_like(doc_ids, dtype=torch.bool)
        ends[..., :-1] = doc_ids[..., 1:] != doc_ids[..., :-1]
        labels = labels.masked_fill(ends.to(labels.device), ignore_index)
    return labels


class _SumOverRanks(torch.autograd.Function):
    """Sum of ``x`` over the ranks; the result is a value every rank holds alike, so each rank's
    gradient passes straight to its own ``x`` (the loss is counted once, not once per rank)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_ranks(x: Tensor, group=None) -> Tensor:
    """All-reduced sum of ``x`` over ``group``, differentiable (see ``_SumOverRanks``)."""
    return _SumOverRanks.apply(x, meshes.flat(group)) if _group_size(group) > 1 else x


def sharded_cross_entropy(logits: Tensor, labels: Tensor, *, group=None, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy over the tokens of ALL ranks, the same value on every rank.

    logits [..., V] and labels [...] are this rank's tokens. Sum of the local token losses,
    summed over the ranks, divided by the global count of labelled tokens: exactly the loss
    of the unsharded batch, however unevenly the labelled tokens fall on the ranks. Bad
    arguments on one rank raise on every rank (the ranks agree first, over the CPU).
    """
    group = meshes.flat(group)  # a heads x ring mesh: every rank of it
    error, local = None, None
    try:
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"logits [..., vocab] and labels [...] must match, got shapes {tuple(logits.shape)} "
                             f"and {tuple(labels.shape)}")
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):  # a sum over many tokens needs fp32
            flat = flat.float()
        local = F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
    except (ValueError, IndexError, RuntimeError) as e:  # a label out of range, on the CPU
        if _group_size(group) == 1:
            raise
        error = f"sharded_cross_entropy: {type(e).__name__}: {e}"
    if _group_size(group) == 1:
        return local / (labels != ignore_index).sum().to(local.dtype)
    agreement.exchange(group, [], error, "sharded_cross_entropy", caller=None)  # the others' all-reduce would wait
    count = (labels != ignore_index).sum().to(local.dtype)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return sum_over_ranks(local, group) / count


def reduce_gradients(parameters: Iterable[torch.nn.Parameter], group=None) -> None:
    """Sums the parameters' gradients over ``group`` (one all-reduce per dtype and device).

    Call after ``loss.backward()`` when the loss came from ``sharded_cross_entropy``. A DDP or
    FSDP over the same ranks AVERAGES instead: scale the loss by the group size for it.
    A parameter that got no gradient on some ranks (a branch their tokens skipped) gets the
    sum of the others' (zero where it had none); one that got none anywhere keeps none. Every
    rank must pass the same parameters: checked first, so that a mismatch raises the same
    ValueError on every rank instead of hanging the all-reduce. Parameters FSDP2 shards over
    another dimension of the mesh (``fully_shard(model, mesh=mesh["dp"])``) sum their local
    shards: each rank of the ring holds the same shard of them.
    """
    if _group_size(group) == 1:
        return
    group = meshes.flat(group)  # a heads x ring mesh: every rank of it
    params = list(parameters)
    buckets = {}
    for p in _with_grad_on_any_rank(params, group, _sharded_over_ring(params, group)):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad.to_local() if isinstance(p.grad, _dtensor()) else p.grad
        buckets.setdefault((grad.dtype, grad.device), []).append(grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


_GLOO_PAUSE_S = 0.5  # long enough for gloo's last point-to-point transfers to end (``destroy_process_group``)


def destroy_process_group(group=None) -> None:
    """``torch.distributed.destroy_process_group``, for the end of a script, once every result
    is complete: on gloo every rank first waits for the others and pauses, since torch's gloo
    may abort a rank (SIGABRT, "terminate called without an active exception") that tears its
    group down right after point-to-point transfers, such as a CPU ring's (docs/reliability.md,
    "Not covered")."""
    if "gloo" in str(dist.get_backend(group)):
        dist.barrier(group)
        time.sleep(_GLOO_PAUSE_S)
    dist.destroy_process_group(group)


def _dtensor():
    """torch's DTensor class, or () where no module imported it (importing it is slow):
    then no parameter is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else ()


def _sharded_over_ring(params: List[torch.nn.Parameter], group) -> Optional[str]:
    """Why the ranks of ``group`` cannot sum these gradients, or None: FSDP shards some of
    them over ranks of the ring itself (a mesh that includes them), and reduces them itself."""
    ring = set(dist.get_process_group_ranks(group))
    for p in params:
        if isinstance(p, _dtensor()) and len(ring & set(p.device_mesh.mesh.flatten().tolist())) > 1:
            return ("reduce_gradients: FSDP shards these parameters over ranks of the ring's group (its mesh "
                    f"{p.device_mesh}), and its reduce-scatter averages their gradients over them already: do not "
                    "call reduce_gradients, multiply the loss by the ring's size instead")
    return None


def _with_grad_on_any_rank(params: List[torch.nn.Parameter], group, error: Optional[str] = None
                           ) -> List[torch.nn.Parameter]:
    """The parameters that have a gradient on at least one rank, once every rank is known to
    have passed as many, of the same shapes and dtypes (over the group's CPU side, as the
    ring's argument check), and none had an ``error``."""
    layout = digest(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())
    records = agreement.exchange(group, [len(params), layout], error, "reduce_gradients", caller=None)
    if any(r != records[0] for r in records):
        raise ValueError("reduce_gradients: the ranks passed different parameters ("
                         + ", ".join(f"rank {r}: {n} parameters, shapes and dtypes {code:016x}"
                                     for r, (n, code) in enumerate(records))
                         + "); pass the same model's parameters on every rank")
    has_grad = agreement.exchange(group, [p.grad is not None for p in params], None, "reduce_gradients", caller=None)
    return [p for p, *anywhere in zip(params, *has_grad) if any(anywhere)]
