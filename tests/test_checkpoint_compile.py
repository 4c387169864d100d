"""A model around ring_flex_attention on a ring of 2: activation checkpointing (both kinds) gives
the same gradients as without it, and torch.compile compiles the model around the ring (a
clean graph break at ring_flex_attention) with the eager results."""
import pytest
import torch
import torch.utils.checkpoint as cp

import ringflex
from support.harness import run_world
from ringflex import mods
from ringflex.training import reduce_gradients

WORLD, S, DIM, HEADS = 2, 16, 16, 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x):  # x: [B, S_local, DIM]
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, DIM // HEADS)).permute(2, 0, 3, 1, 4)
        a = ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal, score_mod=mods.softcap(4.0))
        return x + self.out(a.transpose(1, 2).flatten(2))


class Model(torch.nn.Module):
    def __init__(self, checkpoint=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.checkpoint = checkpoint  # None, or use_reentrant (True / False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.checkpoint is None else cp.checkpoint(block, x, use_reentrant=self.checkpoint)
        return x


def _gradients(model, x):
    x = x.detach().requires_grad_()
    out = model(x)
    (out * out).sum().backward()
    grads = [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def _checkpointed(rank, world_size):
    torch.manual_seed(0)
    model = Model()
    x = ringflex.shard(torch.randn(2, S, DIM), 1)
    plain = _gradients(model, x)
    same = {}
    for reentrant in (False, True):
        model.checkpoint = reentrant
        same[reentrant] = all(torch.equal(a, b) for a, b in zip(plain, _gradients(model, x)))
    return same


def test_activation_checkpointing_gives_the_same_gradients():
    for same in run_world(WORLD, _checkpointed, timeout=120):
        assert same == {False: True, True: True}


class SdpaBlock(torch.nn.Module):
    """A block whose attention is SDPA, routed by the wrapper; counts its forwards."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, dtype=torch.float64)
        self.forwards = 0

    def forward(self, x, debug=False):
        self.forwards += 1
        x = x * 2 if debug else x
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, DIM // HEADS)).permute(2, 0, 3, 1, 4)
        return x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def _micro_batches_with_their_masks(rank, world_size):
    """Two micro-batches, each with its own documents set on the wrapper, forwarded before one
    backward: the gradients with the wrapper's checkpointing, and without."""
    grads, forwards = [], []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        block = SdpaBlock()
        wrapped = ringflex.RingFlexAttention(block, checkpoint=checkpoint, backend="reference")
        losses = []
        for lengths in ([5, 11], [9, 7]):
            wrapped.mask_mod = mods.document(mods.document_ids(lengths))
            x = ringflex.shard(torch.randn(1, S, DIM, dtype=torch.float64), 1)
            losses.append((wrapped(x) ** 2).sum())
        sum(losses).backward()
        grads.append(block.qkv.weight.grad)
        forwards.append(block.forwards)
    return (grads[0] - grads[1]).abs().max().item(), forwards


def test_the_wrappers_checkpointing_recomputes_with_the_mask_of_the_forward():
    """A checkpoint inside the wrapper recomputes with the mask_mod set when backward runs
    (0.45 off in an audit); the wrapper's own keeps each forward's."""
    for error, forwards in run_world(WORLD, _micro_batches_with_their_masks, timeout=120):
        assert error < 1e-12 and forwards == [2, 4]


def _micro_batches_with_their_shardings(rank, world_size):
    """Two micro-batches, each with its documents and the layout its tokens are sharded in set on
    the wrapper (the sharding ``PackedSequences`` chooses for the first, zigzag for the second),
    forwarded before one backward: each configuration's gradients against one process's."""
    packed = ringflex.PackedSequences([5, 11])
    batches = [(packed.lengths, packed.layout), ((9, 7), "zigzag")]
    xs = [torch.randn(1, S, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    torch.manual_seed(0)
    single = SdpaBlock()
    alone = [torch.distributed.new_group([r]) for r in range(world_size)][rank]  # a ring of this rank alone
    for x, (lengths, _) in zip(xs, batches):
        with ringflex.RingFlexMode(group=alone, mask_mod=mods.document(mods.document_ids(lengths)),
                                   backend="reference"):
            (single(x) ** 2).sum().backward()
    errors = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        block = SdpaBlock()
        wrapped = ringflex.RingFlexAttention(block, checkpoint=checkpoint, backend="reference")
        losses = []
        for x, (lengths, layout) in zip(xs, batches):
            wrapped.mask_mod, wrapped.layout = mods.document(mods.document_ids(lengths)), layout
            losses.append((wrapped(ringflex.shard(x, 1, layout=layout)) ** 2).sum())
        sum(losses).backward()
        reduce_gradients(block.parameters())  # each rank's share: its tokens'
        errors.append(((block.qkv.weight.grad - single.qkv.weight.grad).abs().max()
                       / single.qkv.weight.grad.abs().max()).item())
    return errors, packed.layout != "zigzag"


def test_the_wrapper_runs_each_micro_batch_in_the_layout_set_for_it():
    """``RingFlexAttention.layout`` set per step (a packed batch's sharding, then zigzag): forward,
    and the checkpointed recompute, run each micro-batch in its own, matching one process."""
    for errors, layouts_differ in run_world(WORLD, _micro_batches_with_their_shardings, timeout=120):
        assert layouts_differ and max(errors) < 1e-12, errors


def test_the_wrappers_layout_is_checked_when_set():
    wrapped = ringflex.RingFlexAttention(SdpaBlock())
    with pytest.raises(ValueError, match="layout must be one of"):
        wrapped.layout = "diagonal"
    wrapped.layout = "contiguous"
    assert wrapped.layout == "contiguous" and wrapped.mode.layout == "contiguous"


def _nested(rank, world_size):
    """Blocks wrapped (checkpointed or not, a ``debug`` keyword for the block) inside a model
    wrapped with the documents' mask: the gradients against one process with that mask."""
    documents = mods.document(mods.document_ids([5, 11]))
    x = torch.randn(1, S, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    single = _Chain([SdpaBlock(), SdpaBlock()])
    alone = [torch.distributed.new_group([r]) for r in range(world_size)][rank]  # a ring of this rank alone
    with ringflex.RingFlexMode(group=alone, mask_mod=documents, backend="reference"):
        (single(x, debug=True) ** 2).sum().backward()
    errors = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        blocks = [SdpaBlock(), SdpaBlock()]
        inner = [ringflex.RingFlexAttention(b, checkpoint=checkpoint, backend="reference") for b in blocks]
        model = ringflex.RingFlexAttention(_Chain(inner), mask_mod=documents, backend="reference")
        (model(ringflex.shard(x, 1), debug=True) ** 2).sum().backward()
        reduce_gradients(model.parameters())  # each rank's share: its tokens'
        errors.append(max(((b.qkv.weight.grad - s.qkv.weight.grad).abs().max() / s.qkv.weight.grad.abs().max()).item()
                          for b, s in zip(blocks, single.blocks)))
    return errors


class _Chain(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x, debug=False):  # ``debug``: a keyword torch's checkpoint takes for itself
        for block in self.blocks:
            x = block(x, debug=debug)
        return x


def _nested_on_another_ring(rank, world_size):
    """A block wrapped on a ring of its rank alone, inside a model wrapped on the whole group
    with a documents mask: the block's calls are its own ring's, without that mask."""
    alone = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    x = torch.randn(1, S, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    block = ringflex.RingFlexAttention(SdpaBlock(), group=alone, backend="reference")
    model = ringflex.RingFlexAttention(_Chain([block]), mask_mod=mods.document(mods.document_ids([5, 11])),
                                       backend="reference")
    return (model(x) - block(x)).abs().max().item()


def test_a_wrapper_on_another_ring_adds_no_mask():
    for error in run_world(WORLD, _nested_on_another_ring, timeout=120):
        assert error == 0


def test_nested_wrappers_add_their_masks():
    """A wrapped block inside a wrapped model: the outer wrapper's mask applies to the block's
    calls too (it was dropped: gradients 10 off), also in the recompute of checkpoint=True, and
    the block's own keywords reach it (checkpoint took ``debug`` for itself)."""
    for errors in run_world(WORLD, _nested, timeout=120):
        assert max(errors) < 1e-12, errors


def _compiled(rank, world_size):
    torch.manual_seed(0)
    model = Model()
    x = ringflex.shard(torch.randn(2, S, DIM), 1)
    eager = _gradients(model, x)
    compiled = _gradients(torch.compile(model), x)
    error = max((a - b).abs().max().item() for a, b in zip(eager, compiled))
    try:
        torch.compile(model, fullgraph=True)(x)
        strict = None
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        strict = str(e)
    return error, strict


def test_torch_compile_breaks_the_graph_cleanly_at_the_ring():
    for error, strict in run_world(WORLD, _compiled, timeout=240):
        assert error < 1e-5
        assert strict is not None and "ring_flex_attention runs collectives" in strict


class AttentionBlock(torch.nn.Module):
    """Attention as written for one GPU: SDPA with is_causal, or flex_attention with a block
    mask and a score_mod."""

    def __init__(self, flex: bool = False):
        super().__init__()
        self.qkv, self.flex = torch.nn.Linear(DIM, 3 * DIM), flex

    def forward(self, x):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, DIM // HEADS)).permute(2, 0, 3, 1, 4)
        if self.flex:
            block_mask = create_block_mask(mods.causal, None, None, q.shape[2], k.shape[2], device="cpu")
            out = flex_attention(q, k, v, block_mask=block_mask, score_mod=mods.softcap(4.0))
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).flatten(2)


def _compiled_wrapper(rank, world_size):
    torch.manual_seed(0)
    wrapped = ringflex.RingFlexAttention(AttentionBlock(flex=True))
    x = ringflex.shard(torch.randn(2, S, DIM), 1)
    eager = _gradients(wrapped, x)
    compiled = _gradients(torch.compile(wrapped), x)
    error = max((a - b).abs().max().item() for a, b in zip(eager, compiled))
    # a model compiled whole, whose attention module is wrapped
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), wrapped, torch.nn.Linear(DIM, DIM))
    eager, compiled = _gradients(model, x), _gradients(torch.compile(model), x)
    error = max([error] + [(a - b).abs().max().item() for a, b in zip(eager, compiled)])
    mode = ringflex.RingFlexMode()

    def entered_inside(x):
        with mode:
            return wrapped.module(x)
    try:
        with torch.no_grad():  # torch's flex_attention refuses gradients on a CPU before its check
            torch.compile(entered_inside)(x)
        inside = None
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        inside = str(e)
    return error, inside


def test_a_compiled_wrapper_compiles_the_model_inside_the_mode():
    """``torch.compile(RingFlexAttention(model))``, and a model compiled whole around a wrapped
    attention module: the wrapper enters its mode before dynamo traces what it wraps, so
    flex_attention is routed as in eager mode (dynamo defers the mode's replacement of
    flex_attention when it traces the entry itself). A mode entered inside compiled code is
    refused with a message that says so."""
    for error, inside in run_world(WORLD, _compiled_wrapper, timeout=400):
        assert error < 1e-5
        assert inside is not None and "entered inside torch.compile" in inside


class LoopedModel(torch.nn.Module):
    """Layers in a loop after an embedding and positions from ``x.device``: the shape of model
    that torch's dynamo mis-traces when compiled whole around a graph break under a mode."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, DIM)
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(DIM, DIM), AttentionBlock())
                                           for _ in range(2)])

    def forward(self, tokens, first):
        x = self.embed(tokens)
        x = x + (torch.arange(x.shape[1], device=x.device) + first).unsqueeze(-1) / S  # first: global position
        for layer in self.layers:
            x = x + layer(x)
        return x


def _layers_compiled(rank, world_size):
    torch.manual_seed(0)
    model = LoopedModel()
    tokens = torch.randint(0, 32, (2, S * world_size), generator=torch.Generator().manual_seed(1))
    want = model(tokens, 0)
    wrapped = ringflex.RingFlexAttention(model, layout="contiguous")
    for layer in model.layers:
        layer.compile()
    got = wrapped(ringflex.shard(tokens, 1, layout="contiguous"), rank * S)
    return (got - ringflex.shard(want, 1, layout="contiguous")).abs().max().item()


def test_a_wrapped_model_whose_layers_are_compiled_gives_one_process_values():
    """Compiling each layer (as torchtitan does) around the ring's graph break: the pattern
    docs/reliability.md gives where compiling the whole model hits torch's mis-trace."""
    for error in run_world(WORLD, _layers_compiled, timeout=400):
        assert error < 1e-5


def _layers_compiled_with_a_mask(rank, world_size):
    """A wrapper's mask_mod (packed documents) around layers compiled one by one: the eager
    wrapper's output, and no plan made after the first call."""
    from ringflex.plan import blocks
    torch.manual_seed(0)
    model = torch.nn.Sequential(AttentionBlock(), AttentionBlock())
    documents = mods.document(mods.document_ids([5, 9, 2 * S * world_size - 14]))
    wrapped = ringflex.RingFlexAttention(model, mask_mod=documents)
    x = ringflex.shard(torch.randn(2, 2 * S * world_size, DIM), 1)
    want = wrapped(x)
    for layer in model:
        layer.compile()
    plans, plan_hops = [], blocks.plan_hops
    blocks.plan_hops = lambda *args: plans.append(1) or plan_hops(*args)
    got = [wrapped(x) for _ in range(2)]
    blocks.plan_hops = plan_hops
    return max((g - want).abs().max().item() for g in got), len(plans)


def test_a_wrapper_mask_around_compiled_layers_is_planned_once():
    """The mode combines the call's mask with the wrapper's outside dynamo: traced, the
    combination failed inside dynamo (``___get_torch_function_mode_stack_at``)."""
    for error, plans in run_world(WORLD, _layers_compiled_with_a_mask, timeout=400):
        assert error < 1e-5 and plans == 0, (error, plans)
