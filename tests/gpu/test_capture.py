"""A one-rank ring call, forward and backward, captured in a CUDA graph replays to the eager
call's values (the cuDNN hops of a causal and a packed-documents mask); the check that
refuses capture over several ranks sees the capture."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import make_mods  # noqa: E402
from capture_probe import capture_ring_call  # noqa: E402
from ringflex import mods
from ringflex.parallel import comm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SEQ = 4096


@needs_cuda
@pytest.mark.parametrize("name", ["causal", "documents"])
def test_a_one_rank_call_replays_to_its_eager_values(name):
    dev = torch.device("cuda")
    mask_mod = mods.causal if name == "causal" else make_mods("documents", SEQ, dev, 0, 512, seed=1)[1]
    graph, got, _, want = capture_ring_call(mask_mod, SEQ, 4, dev)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-2)  # dq accumulates in any order


@needs_cuda
def test_the_capture_check_sees_a_capture():
    x = torch.zeros(1, device="cuda")
    assert not comm.capturing(x)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert comm.capturing(x)
        x.add_(1)
    assert not comm.capturing(x)
