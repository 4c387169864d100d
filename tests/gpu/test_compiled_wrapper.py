"""``torch.compile(RingFlexAttention(model))`` on a GPU: the model compiles around the ring's
cuDNN hops and gives the eager wrapper's output and gradients (flex_attention with a block
mask and a softcap, SDPA with is_causal), on one rank and on two sharing the GPU."""

import pytest
import torch
import torch.nn.functional as F

from support.harness import gpu_backend, on_a_gpu, run_world
import ringflex
from ringflex import mods

HEADS, HEAD_DIM = 4, 64


class _Layer(torch.nn.Module):
    def __init__(self, flex: bool):
        super().__init__()
        self.qkv, self.flex = torch.nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM), flex

    def forward(self, x):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, HEAD_DIM)).permute(2, 0, 3, 1, 4)
        if self.flex:
            block_mask = create_block_mask(mods.causal, None, None, q.shape[2], k.shape[2], device=x.device)
            out = flex_attention(q, k, v, block_mask=block_mask, score_mod=mods.softcap(20.0))
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).flatten(2)


def _errors(rank, world_size, flex):
    dev = on_a_gpu(rank)
    torch.manual_seed(0)
    wrapped = ringflex.RingFlexAttention(_Layer(flex), backend="cudnn").to(dev, torch.bfloat16)
    x = ringflex.shard(torch.randn(1, 2048, HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16), 1)
    results = []
    for model in (wrapped, torch.compile(wrapped)):
        inputs = x.detach().requires_grad_()
        out = model(inputs)
        out.float().square().sum().backward()
        results.append([out.detach(), inputs.grad, wrapped.module.qkv.weight.grad])
        wrapped.zero_grad()
    return [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(*results)]


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("flex", [True, False], ids=["flex_attention", "sdpa"])
def test_a_compiled_wrapper_gives_the_eager_values(world_size, flex):
    for errors in run_world(world_size, _errors, flex, timeout=600, backend=gpu_backend(world_size)):
        assert max(errors) < 2e-2, errors  # relative to the largest value; bf16, cuDNN's dq sums in any order
