"""A one-rank ring call, forward and backward, captured in a CUDA graph replays to the eager
call's values (the cuDNN hops of a causal and a packed-documents mask); the check that
refuses capture over several ranks sees the capture."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import make_mods  # noqa: E402
import ringflex
from ringflex import mods
from ringflex.parallel import comm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SEQ = 4096


def _masks():
    return {"causal": mods.causal, "documents": make_mods("documents", SEQ, torch.device("cuda"), 0, 512, seed=1)[1]}


@needs_cuda
@pytest.mark.parametrize("name", ["causal", "documents"])
def test_a_one_rank_call_replays_to_its_eager_values(name):
    mask_mod = _masks()[name]
    side = torch.cuda.Stream()  # torch's recipe: leaves and warm-up calls on a side stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, k, v = (torch.randn(1, 4, SEQ, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)

        def run():
            q.grad = k.grad = v.grad = None
            out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask_mod)
            out.backward(dout)
            return [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
        for _ in range(2):
            want = run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    q.grad = k.grad = v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert comm.capturing(q)
        out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask_mod)
        out.backward(dout)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip([out, q.grad, k.grad, v.grad], want):
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-2)  # dq accumulates in any order
    assert not comm.capturing(q)
