"""The copy-engine transport (``ringflex.parallel.peer``): every byte arrives, in every
channel, for transfers smaller and larger than its mailbox, several in flight, and into
receive buffers in place, over passes that each end as ``end_pass`` leaves them; a failing rank releases the others' waits
(these on two ranks that share one GPU where there is only one); an arrival does not wait
for the rank's own send; and a ring over it computes bit for bit what the same ring
computes over NCCL (these two need two GPUs)."""
import os
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from support.harness import gpu_backend, on_a_gpu, run_world
from ringflex import ring_flex_attention
from ringflex.kernels.reference import ReferenceKernel
from ringflex.parallel import peer
from ringflex.parallel.comm import RingComm

pytestmark = pytest.mark.gpu
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

_SIZES = [1000, peer.SLOT_BYTES // 2, peer.SLOT_BYTES, 3 * peer.SLOT_BYTES + 12_345, 9 * peer.SLOT_BYTES]


def _payload(rank: int, index: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 * rank + index)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)


def _exchanges(rank, world_size):
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    comm = RingComm(dist.group.WORLD)
    assert peer.transport(comm.group, on_a_gpu(rank)) is not None
    wrong = []
    # a pass per direction, as forward and backward make; backward's shares go further
    for shifts in ([1], [-1], [1], [-1, *range(-2, -world_size, -1)]):
        pending = []
        for shift in shifts:
            source = (rank - shift) % world_size
            sends = [_payload(rank, i, n) for i, n in enumerate(_SIZES)]
            recvs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in _SIZES]
            # two transfers in flight at once
            pending.append((shift, source, recvs, comm.exchange(sends[:2], recvs[:2], shift),
                            comm.exchange(sends[2:], recvs[2:], shift)))
        for shift, source, recvs, first, second in pending:
            first.wait()
            second.wait()
            for i, n in enumerate(_SIZES):
                if not torch.equal(recvs[i], _payload(source, i, n)):
                    wrong.append((shift, n))
        comm.end_pass(torch.device("cuda"))
    torch.cuda.synchronize()
    return wrong


def _rows_exchanges(rank, world_size):
    """Rows of [B, H, L, D] blocks sent as views (read in place, 2-D copies whose chunks cut
    through rows), received contiguous: bit for bit what a contiguous copy would carry."""
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    comm = RingComm(dist.group.WORLD)
    # (batches, heads, rows of the block, rows sent from, rows sent): one slot; several, cut
    # mid-row; a row (a head's rows) larger than a slot; two batches
    cases = [(1, 8, 4096, 1000, 2048), (1, 64, 4096, 5, 3000), (1, 2, 200_000, 7, 140_000), (2, 4, 512, 100, 300)]
    wrong = []
    for shift in (1, -1):
        for i, (b, h, length, start, n) in enumerate(cases):
            g = torch.Generator(device="cuda").manual_seed(100 * rank + i)
            blocks = [torch.randn(b, h, length, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
            g = torch.Generator(device="cuda").manual_seed(100 * ((rank - shift) % world_size) + i)
            theirs = [torch.randn(b, h, length, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
            recv = [torch.empty(b, h, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            comm.exchange([t.narrow(2, start, n) for t in blocks], recv, shift).wait()
            if not all(torch.equal(got, t.narrow(2, start, n)) for got, t in zip(recv, theirs)):
                wrong.append((shift, i))
        comm.end_pass(torch.device("cuda"))
    torch.cuda.synchronize()
    return wrong


def _in_place_exchanges(rank, world_size):
    """Blocks received in place (``RingComm.receive_buffer``: senders copy straight into the
    receiver's buffer): rows of blocks read in place, into the leading rows of buffers reused
    over passes (by smaller blocks, and made anew for a larger one), where the last rank sends
    nothing (its receiver's view is empty) and a mailbox transfer (a dK/dV share of a block over
    ``shares.IN_PLACE_BYTES``) shares the channel; bit for bit as sent. Where ranks share a
    GPU, the buffers are mapped by CUDA IPC."""
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    comm = RingComm(dist.group.WORLD)
    device = on_a_gpu(rank)
    if not comm.receives_in_place(device):
        return ["not in place"]
    b, h = 1, 8
    wrong = []
    # passes in turn: every buffer reused, by a smaller block (its leading bytes), then a larger (a new buffer)
    for round_, (length, rows) in enumerate([(4096, (100, 2048)), (4096, (7, 3000)), (2048, (0, 2048)),
                                             (8192, (5, 6000))]):
        for shift in (1, -1, *range(2, world_size)):
            source = (rank - shift) % world_size
            g = torch.Generator(device="cuda").manual_seed(round_)
            blocks = {r: [torch.randn(b, h, length, 128, device="cuda", generator=g).to(torch.bfloat16)
                          for _ in range(2)] for r in range(world_size)}
            start, n = rows
            sent_n, got_n = (0 if r == world_size - 1 else n for r in (rank, source))
            buffers = [comm.receive_buffer((round_ % 2, i), t.shape, t.dtype, device)
                       for i, t in enumerate(blocks[rank])]
            recv = [buf.view(-1)[:b * h * got_n * 128].view(b, h, got_n, 128) for buf in buffers]
            arrival = comm.exchange([t.narrow(2, start, sent_n) for t in blocks[rank]], recv, shift)
            share = torch.full((1000,), rank, dtype=torch.uint8, device="cuda")
            share_got = torch.empty(1000, dtype=torch.uint8, device="cuda")
            share_arrival = comm.exchange([share], [share_got], -shift)
            arrival.wait()
            share_arrival.wait()
            if not all(torch.equal(got, t.narrow(2, start, got_n)) for got, t in zip(recv, blocks[source])):
                wrong.append((round_, shift))
            if not torch.equal(share_got, torch.full_like(share, (rank + shift) % world_size)):
                wrong.append((round_, shift, "share"))
            torch.cuda.synchronize()  # the next round fills the buffers again
        comm.end_pass(device)
    torch.cuda.synchronize()
    return wrong


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("exchanges", [_exchanges, _rows_exchanges, _in_place_exchanges],
                         ids=["bytes", "rows", "in_place"])
def test_every_byte_arrives_in_every_channel(world_size, exchanges):
    """Contiguous payloads, rows of a block read in place, and blocks received in place: as a
    copy of them would."""
    assert run_world(world_size, exchanges, backend=gpu_backend(world_size)) == [[]] * world_size


def _arrival_before_send(rank, world_size):
    """Rank 0 sends rank 1 more than its mailbox holds while rank 1's receive is held back
    (its stream sleeps first); rank 1 sends rank 0 a little from a stream that does not sleep.
    Work rank 0 queues after its arrival runs at once: the send is still waiting for rank 1."""
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    transport = peer.transport(dist.group.WORLD, torch.device("cuda", rank))
    big, small = 9 * peer.SLOT_BYTES, 1000
    if rank == 0:
        got = torch.empty(small, dtype=torch.uint8, device="cuda")
        arrival = transport.exchange([_payload(0, 0, big)], [got])
        arrival.wait()
        marker = torch.cuda.current_stream().record_event()
        deadline = time.monotonic() + 5
        while not marker.query() and time.monotonic() < deadline:
            time.sleep(1e-3)
        ordered = (marker.query(), arrival.sent.query())
        transport.join_sends()
        torch.cuda.synchronize()
        return ordered, torch.equal(got, _payload(1, 0, small))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        transport.exchange([_payload(1, 0, small)], [])
    torch.cuda._sleep(int(2e10))  # about 10 s of GPU clock cycles before the receive below starts
    got = torch.empty(big, dtype=torch.uint8, device="cuda")
    transport.exchange([], [got]).wait()
    torch.cuda.synchronize()
    return None, torch.equal(got, _payload(0, 0, big))


@needs_two_gpus
def test_an_arrival_does_not_wait_for_the_own_send():
    (ordered, small_ok), (_, big_ok) = run_world(2, _arrival_before_send, backend="nccl", timeout=120)
    assert ordered == (True, False)  # the work after the arrival ran; the send was still waiting
    assert small_ok and big_ok


def _ring(rank, world_size):
    """Two ring calls' forwards, then their backward (two layers of a model): over the copy
    engines the second forward fills the receive buffers that the first forward ended on, so
    the first one's backward must start on a block saved apart. Bit for bit what NCCL gives."""
    torch.manual_seed(0)
    shape = (1, 4, 2048, 64)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.float32) for _ in range(4))
    local = [t.chunk(world_size, dim=2)[rank].clone().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    results = {}
    for transport in ("nccl", "copy-engine"):
        os.environ["RINGFLEX_TRANSPORT"] = transport
        group = dist.new_group([0, 1])
        lq, lk, lv, ld = (t.detach().clone().requires_grad_(t.requires_grad) for t in local)
        outs = [ring_flex_attention(a, b, c, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                    group=group, layout="contiguous", backend="reference")
                for a, b, c in ((lq, lk, lv), (lk, lv, lq))]
        torch.autograd.backward(outs, [ld, ld])
        results[transport] = [t.cpu() for t in (*outs, lq.grad, lk.grad, lv.grad)]
        assert (peer.transport(group, q.device) is None) == (transport == "nccl")
    return all(torch.equal(a, b) for a, b in zip(results["nccl"], results["copy-engine"]))


@needs_two_gpus
def test_ring_over_copy_engines_matches_nccl_bit_for_bit():
    assert run_world(2, _ring, backend="nccl") == [True, True]


_L = 256  # local tokens


@contextmanager
def _raising_on_rank_1(phase: str):
    """Rank 1's reference kernel raises in ``phase`` ("forward" or "backward") at its hop
    against rank 0's block (contiguous layout): at forward step 1, or at backward step 0,
    before its first dK/dV share leaves."""
    method = getattr(ReferenceKernel, phase)

    def failing(self, *args, **kwargs):
        if dist.get_rank() == 1 and args[7 if phase == "backward" else 4].start < _L:  # the K/V segment
            raise RuntimeError("injected fault")
        return method(self, *args, **kwargs)
    setattr(ReferenceKernel, phase, failing)
    try:
        yield
    finally:
        setattr(ReferenceKernel, phase, method)


def _call(group):
    q, k, v = (torch.randn(1, 2, _L, 64, device="cuda", requires_grad=True) for _ in range(3))
    try:
        out = ring_flex_attention(q, k, v, layout="contiguous", group=group, backend="reference")
        out.sum().backward()
    except Exception as e:  # noqa: BLE001 (the test inspects the text)
        return f"{type(e).__name__}: {e}"
    return None


def _faults(rank, world_size):
    os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
    on_a_gpu(rank)
    results = {}
    for phase in ("forward", "backward"):
        group = dist.new_group([0, 1])
        _call(group)  # the transport is built and used
        with _raising_on_rank_1(phase):
            results[phase] = _call(group)
        results[phase + ", called again"] = _call(group)
        torch.cuda.synchronize()  # no stream of this GPU is left waiting for a flag
    return results


def test_a_failing_rank_releases_the_copy_engine_waits():
    per_rank = run_world(2, _faults, timeout=180, backend=gpu_backend(2))
    for phase in ("forward", "backward"):
        assert per_rank[1][phase] == "RuntimeError: injected fault"
        assert per_rank[1][phase + ", called again"].startswith(
            "RingFailure: ringflex: the ring on this process group failed earlier"), per_rank[1]
        # rank 0's call in flight ran on (with garbage from the released copies, or raising
        # where it polled); its next call raises
        again = per_rank[0][phase + ", called again"]
        assert again.startswith("RingFailure: ringflex: ") and f"rank 1 raised in the ring's {phase}" in again, again
