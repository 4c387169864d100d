"""A ring call, forward and backward, captured in a CUDA graph replays to the eager call's
values (the cuDNN hops of a causal and a packed-documents mask): on one rank, and on two
over the copy engines (two ranks that share one GPU where there is only one; a window
there lends rows), where eager calls and replays follow each other, and on four, whose step
brings both neighbours' rows; torch's ``make_graphed_callables`` captures one too,
and a whole model wrapped in ``RingFlexAttention``; the capture check sees a capture."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import make_mods
from benchmarks.probes.capture_probe import capture_ring_call
from support.calls import agreed_calls
from support.harness import gpu_backend, on_a_gpu, run_world, weigh_cudnn_calls_as_free
import ringflex
from ringflex import mods
from ringflex.parallel import comm, peer

SEQ = 4096


def _mask(name: str, seq_len: int, dev):
    if name == "window":  # over two ranks, rank 1 lends rank 0 rows (``lending``)
        return mods.sliding_window(512)
    return mods.causal if name == "causal" else make_mods("documents", seq_len, dev, 0, 512, seed=1)[1]


def _assert_values(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-2)  # dq accumulates in any order


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "documents"])
def test_a_one_rank_call_replays_to_its_eager_values(name):
    dev = torch.device("cuda")
    graph, got, _, want = capture_ring_call(_mask(name, SEQ, dev), SEQ, 4, dev)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        _assert_values(got, want)


def _two_rank_replays(rank, world_size, name):
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    weigh_cudnn_calls_as_free()  # the window lends at these sizes as larger calls would
    dev = on_a_gpu(rank)
    torch.manual_seed(rank)
    graph, got, run, want = capture_ring_call(_mask(name, SEQ, dev), SEQ // world_size, 4, dev, dist.group.WORLD)
    assert peer.in_use(dist.group.WORLD, dev) == "copy-engine"
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        _assert_values(got, want)
    _assert_values(run(), want)  # eager after replays, then a replay after eager calls
    graph.replay()
    torch.cuda.synchronize()
    _assert_values(got, want)
    # An eager forward and at once a replay, while rank 0's host is late to end the forward's
    # pass: rank 1's replay waits for that end instead of taking a slot's flag, still on the
    # mark of its first use, for its own first chunk (and reading what the slot held).
    end_pass = peer.PeerTransport.end_pass
    if rank == 0:
        peer.PeerTransport.end_pass = lambda self: (time.sleep(0.5), end_pass(self))[1]
    with torch.no_grad():
        _assert_values(run(backward=False), want[:1])
    peer.PeerTransport.end_pass = end_pass
    graph.replay()
    torch.cuda.synchronize()
    _assert_values(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "documents", "window"])
def test_a_two_rank_call_over_the_copy_engines_replays_to_its_eager_values(name):
    run_world(2, _two_rank_replays, name, timeout=300, backend=gpu_backend(2))


def _four_rank_replays(rank, world_size):
    """A window over zigzag on four ranks: each rank reads both neighbours' rows, which arrive
    in one step (``RingCall.pieces``), each piece straight into the receive buffers the capture
    holds. Returns the steps' distances."""
    os.environ.update(RINGFLEX_TRANSPORT="copy-engine", RINGFLEX_LENDING="0")
    calls = agreed_calls()
    dev = on_a_gpu(rank)
    torch.manual_seed(rank)
    graph, got, run, want = capture_ring_call(mods.sliding_window(512), SEQ // world_size, 4, dev, dist.group.WORLD,
                                              layout="zigzag")
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        _assert_values(got, want)
    _assert_values(run(), want)
    return calls[-1].distances


@pytest.mark.gpu
def test_a_four_rank_call_whose_step_joins_both_neighbours_replays_to_its_eager_values():
    for distances in run_world(4, _four_rank_replays, timeout=300, backend=gpu_backend(4)):
        assert distances == [(0,), (1, 3)], distances


def _graphed_callable(rank, world_size):
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    dev = on_a_gpu(rank)
    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 4, SEQ // world_size, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def attn(q, k, v):
        return ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal)

    graphed = torch.cuda.make_graphed_callables(attn, (q, k, v))  # before any eager backward on these leaves
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves)
    want = [out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))]
    for _ in range(2):
        out = graphed(q, k, v)
        got = [out.detach(), *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))]
        torch.cuda.synchronize()
        _assert_values(got, want)


@pytest.mark.gpu
def test_torch_make_graphed_callables_captures_a_two_rank_call():
    run_world(2, _graphed_callable, timeout=300, backend=gpu_backend(2))


class _CausalLayer(torch.nn.Module):
    """A plain causal self-attention layer, as written for one GPU (SDPA with is_causal)."""

    def __init__(self, dim: int = 512, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def _graphed_module(rank, world_size):
    """Two wrapped layers captured whole: the weights' gradients match an eager step's."""
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    dev = on_a_gpu(rank)
    torch.manual_seed(0)  # the same weights on every rank
    model = ringflex.RingFlexAttention(torch.nn.Sequential(_CausalLayer(), _CausalLayer())).to(dev, torch.bfloat16)
    eager = copy.deepcopy(model)
    x = ringflex.shard(torch.randn(1, SEQ, 512, device=dev, dtype=torch.bfloat16), 1)
    graphed = torch.cuda.make_graphed_callables(model, (x.clone(),))
    want, got = eager(x), graphed(x)
    want.sum().backward()
    got.sum().backward()
    torch.cuda.synchronize()
    _assert_values([got.detach()], [want.detach()])
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-2, rtol=5e-2)  # bf16 sums in any order


@pytest.mark.gpu
def test_a_wrapped_model_over_two_ranks_captures_whole():
    run_world(2, _graphed_module, timeout=300, backend=gpu_backend(2))


@pytest.mark.gpu
def test_the_capture_check_sees_a_capture():
    x = torch.zeros(1, device="cuda")
    assert not comm.capturing(x)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert comm.capturing(x)
        x.add_(1)
    assert not comm.capturing(x)


@pytest.mark.gpu
def test_a_call_captured_before_it_ran_eagerly_says_so():
    """A first call plans the ring and builds cuDNN graphs, which a capture cannot hold (it
    failed there with a host-to-device copy, or invalidated the capture): refused clearly,
    whether nothing ran with this mask and these shapes, or only another head dim did."""
    dev = torch.device("cuda")
    mask = mods.sliding_window(300)  # a mask object no call planned before

    def inputs(head_dim):
        return [torch.randn(1, 2, 1536, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)]

    def captured(head_dim):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ringflex.ring_flex_attention(*inputs(head_dim), mask_mod=mask, backend="cudnn")

    with pytest.raises(ValueError, match="no call with this mask, these shapes and this backend ran before"):
        captured(64)
    ringflex.ring_flex_attention(*inputs(64), mask_mod=mask, backend="cudnn")
    with pytest.raises(RuntimeError, match="a cuDNN graph for this call's shapes is not built yet"):
        captured(128)
    torch.cuda.synchronize()
