"""Host time of one copy-engine exchange and of the calls it is made of (run with torchrun;
ranks may share a GPU, benchmarks/common.py).

    torchrun --nproc_per_node=2 -m benchmarks.probes.exchange_cost

An exchange here sends a K and a V of 64 MiB each (8192 tokens, 32 heads of 128, bf16: two
mailbox chunks each) and receives the same, then ends its pass, as a forward step of the
ring at 8k tokens per GPU does; each line is the host time per call over calls issued back
to back.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tools.ranks import init
from ringflex.parallel import peer
from ringflex.parallel.groups import gather_objects


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
    os.environ.setdefault("RINGFLEX_TRANSPORT", "copy-engine")
    device = init()
    transport = peer.transport(dist.group.WORLD, device)
    k, v = (torch.randn(1, 32, 8192, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    got_k, got_v = torch.empty_like(k), torch.empty_like(v)
    stream = torch.cuda.current_stream().cuda_stream
    flag = transport.base[transport.rank] + peer._FLAGS_BYTES - 4  # a flag no slot uses
    source, destination = k.reshape(-1).view(torch.uint8), got_k.reshape(-1).view(torch.uint8)
    side = transport.streams[0][1]

    def exchange():
        transport.exchange([k, v], [got_k, got_v]).wait()
        transport.end_pass()

    def stream_context():
        with torch.cuda.stream(side):
            pass

    costs = {
        "exchange of K and V, with the end of its pass": per_call(exchange, 50),
        "  a flag written (cuStreamWriteValue32)": per_call(lambda: transport.driver.write(stream, flag, 0), 500),
        "  a chunk copied (cuMemcpyAsync)": per_call(
            lambda: transport.driver.copy(stream, got_k.data_ptr(), k.data_ptr(), peer.SLOT_BYTES), 200),
        "  for comparison: torch copy_ of a chunk's slice": per_call(
            lambda: destination[:peer.SLOT_BYTES].copy_(source[:peer.SLOT_BYTES]), 200),
        "  for comparison: a stream context entered": per_call(stream_context, 500),
        "  an event recorded": per_call(lambda: torch.cuda.current_stream().record_event(), 500),
    }
    rows = gather_objects(None, costs)
    if dist.get_rank() == 0:
        for rank, row in enumerate(rows):
            print("\n".join(f"rank {rank} {name:50s} {us:7.1f} us" for name, us in row.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
