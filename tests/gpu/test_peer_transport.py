"""The copy-engine transport (``ringflex.parallel.peer``) on two GPUs: every byte arrives, in
both directions, for transfers smaller and larger than its mailbox, several in flight; and a
ring over it computes bit for bit what the same ring computes over NCCL."""
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import run_world  # noqa: E402
from ringflex import ring_flex_attention
from ringflex.parallel import peer
from ringflex.parallel.comm import RingComm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")

_SIZES = [1000, peer.SLOT_BYTES // 2, peer.SLOT_BYTES, 3 * peer.SLOT_BYTES + 12_345, 9 * peer.SLOT_BYTES]


def _payload(rank: int, index: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 * rank + index)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)


def _exchanges(rank, world_size):
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    comm = RingComm(dist.group.WORLD)
    assert peer.transport(comm.group, torch.device("cuda", rank)) is not None
    wrong = []
    for reverse in (False, True, False):
        source = (rank + (1 if reverse else -1)) % world_size
        sends = [_payload(rank, i, n) for i, n in enumerate(_SIZES)]
        recvs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in _SIZES]
        first = comm.exchange(sends[:2], recvs[:2], reverse)  # two transfers in flight at once
        second = comm.exchange(sends[2:], recvs[2:], reverse)
        first.wait()
        second.wait()
        for i, n in enumerate(_SIZES):
            if not torch.equal(recvs[i], _payload(source, i, n)):
                wrong.append((reverse, n))
    torch.cuda.synchronize()
    return wrong


def test_every_byte_arrives_in_both_directions():
    assert run_world(2, _exchanges, backend="nccl") == [[], []]


def _ring(rank, world_size):
    torch.manual_seed(0)
    shape = (1, 4, 2048, 64)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.float32) for _ in range(4))
    local = [t.chunk(world_size, dim=2)[rank].clone().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    results = {}
    for transport in ("nccl", "copy-engine"):
        os.environ["RINGFLEX_TRANSPORT"] = transport
        group = dist.new_group([0, 1])
        lq, lk, lv, ld = (t.detach().clone().requires_grad_(t.requires_grad) for t in local)
        out = ring_flex_attention(lq, lk, lv, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                  group=group, layout="contiguous", backend="reference")
        out.backward(ld)
        results[transport] = [t.cpu() for t in (out, lq.grad, lk.grad, lv.grad)]
        assert (peer.transport(group, q.device) is None) == (transport == "nccl")
    return all(torch.equal(a, b) for a, b in zip(results["nccl"], results["copy-engine"]))


def test_ring_over_copy_engines_matches_nccl_bit_for_bit():
    assert run_world(2, _ring, backend="nccl") == [True, True]
