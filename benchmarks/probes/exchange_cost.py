"""Host time of one copy-engine exchange and of the calls it is made of (run with torchrun;
ranks may share a GPU, benchmarks/common.py).

    torchrun --nproc_per_node=2 -m benchmarks.probes.exchange_cost

An exchange here sends a K and a V of 64 MiB each (8192 tokens, 32 heads of 128, bf16: two
mailbox chunks each) and receives the same, then ends its pass, as a forward step of the
ring at 8k tokens per GPU does; and a dK/dV share of 2048 rows (16 MiB each of dK and dV:
a chunk each), as a rank's share of its neighbour's block for a local mask, through the
mailbox and received in place (into the leading rows of whole-block buffers, as the ring
receives it). Each line is the
host time per call over calls issued back to back. ``--profile N``: rank 0's hottest
functions (cProfile, by own time) over N share exchanges received in place (the ring's way),
each waited for on the GPU, so that no call waits for room in a full stream queue.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

from tools.ranks import init
from ringflex.parallel import peer
from ringflex.parallel.comm import RingComm
from ringflex.parallel.compute import leading_rows
from ringflex.parallel.groups import gather_objects

try:
    from ringflex.parallel.streams import current_stream, on_stream
except ImportError:  # a library from before them (``gpu_session.sh baseexchange1`` runs two in turn)
    current_stream = on_stream = None


def per_call(fn, calls: int) -> float:
    """Microseconds of host time per call of ``fn``."""
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    os.environ.setdefault("RINGFLEX_TRANSPORT", "copy-engine")
    device = init()
    transport = peer.transport(dist.group.WORLD, device)
    k, v = (torch.randn(1, 32, 8192, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    got_k, got_v = torch.empty_like(k), torch.empty_like(v)
    share = [t[:, :, :2048] for t in (k, v)]
    got_share = [torch.empty_like(t) for t in share]
    stream = torch.cuda.current_stream().cuda_stream
    flag = transport.base[transport.rank] + peer._FLAGS_BYTES - 4  # a flag no slot uses
    source, destination = k.reshape(-1).view(torch.uint8), got_k.reshape(-1).view(torch.uint8)
    side = transport.streams[0][1]

    def exchange():
        transport.exchange([k, v], [got_k, got_v]).wait()
        transport.end_pass()

    def share_exchange():
        transport.exchange(share, got_share, shift=-1).wait()
        transport.end_pass()

    ring = RingComm(dist.group.WORLD)
    in_place = [leading_rows(ring.receive_buffer(("share", 1, i), t.shape, t.dtype, device), 2048)
                for i, t in enumerate((k, v))]

    def share_in_place():
        transport.exchange(share, in_place, shift=-1).wait()
        transport.end_pass()

    event = torch.cuda.current_stream().record_event()

    def stream_context():
        with torch.cuda.stream(side):
            pass

    def ringflex_stream_context():
        with on_stream(side):
            pass

    costs = {
        "exchange of K and V, with the end of its pass": per_call(exchange, 50),
        "exchange of a dK/dV share, with the end of its pass": per_call(share_exchange, 100),
        "the same share received in place": per_call(share_in_place, 100),
        "  a flag written (cuStreamWriteValue32)": per_call(lambda: transport.driver.write(stream, flag, 0), 500),
        "  a chunk copied (cuMemcpyAsync)": per_call(
            lambda: transport.driver.copy(stream, got_k.data_ptr(), k.data_ptr(), peer.SLOT_BYTES), 200),
        "  for comparison: torch copy_ of a chunk's slice": per_call(
            lambda: destination[:peer.SLOT_BYTES].copy_(source[:peer.SLOT_BYTES]), 200),
        "  a stream context entered: torch.cuda.stream": per_call(stream_context, 500),
        "  the current stream: torch.cuda.current_stream": per_call(lambda: torch.cuda.current_stream(device), 500),
        "  an event recorded": per_call(lambda: torch.cuda.current_stream().record_event(), 500),
        "  a stream waiting for an event": per_call(lambda: side.wait_event(event), 500),
    }
    if on_stream is not None:
        costs["  a stream context entered: ringflex's on_stream"] = per_call(ringflex_stream_context, 500)
        costs["  the current stream: ringflex's current_stream"] = per_call(lambda: current_stream(device), 500)
    if args.profile:
        profile = cProfile.Profile()
        torch.cuda.synchronize()
        profile.enable()
        for _ in range(args.profile):
            share_in_place()
            torch.cuda.synchronize()
        profile.disable()
        torch.cuda.synchronize()
        if dist.get_rank() == 0:
            print(f"rank 0, {args.profile} share exchanges received in place, by own time:", flush=True)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    rows = gather_objects(None, costs)
    if dist.get_rank() == 0:
        for rank, row in enumerate(rows):
            print("\n".join(f"rank {rank} {name:50s} {us:7.1f} us" for name, us in row.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
