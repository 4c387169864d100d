"""How fast a ring's block moves between the GPUs of one host, every rank sending to the next
at once (the ring's pattern), by each way ringflex could move it:

- ``transport``: ringflex's exchange (``parallel.comm``: the copy engines through the mailbox,
  or the process group's P2P where ``RINGFLEX_TRANSPORT=nccl``);
- ``nccl``: the process group's batched send/recv alone;
- ``copy xN``: plain peer copies into the next rank's symmetric memory on N streams at once
  (one copy engine per stream), the bound of the copy engines without the mailbox's second copy.

    torchrun --nproc_per_node=4 -m benchmarks.probes.link_bandwidth --mib 32 128 256

Prints rank 0's GB/s (the slowest rank's time) per size and way.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from ringflex.parallel.comm import RingComm
from tools.ranks import init, max_over_ranks


def timed(fn, iters: int, device) -> float:
    """Seconds per call of ``fn`` (every rank starts together; the slowest rank's time)."""
    fn()
    torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(device)
    return max_over_ranks([(time.perf_counter() - start) / iters], device)[0]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, nargs="+", default=[32, 128, 256])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = init("cuda")
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = RingComm(group)
    import torch.distributed._symmetric_memory as symm_mem
    biggest = max(args.mib) << 20
    box = symm_mem.empty(biggest, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(box, group.group_name)
    nxt = handle.get_buffer((rank + 1) % world, (biggest,), torch.uint8)
    streams = [torch.cuda.Stream(device) for _ in range(max(args.streams))]
    nxt_rank, prv_rank = (rank + 1) % world, (rank - 1) % world
    for mib in args.mib:
        n = mib << 20
        send = torch.ones(n, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)

        def transport():
            comm.exchange([send], [recv]).wait()
            comm.join_sends(device)
            comm.end_pass(device)

        def nccl():
            ops = [dist.P2POp(dist.isend, send, nxt_rank), dist.P2POp(dist.irecv, recv, prv_rank)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        ways = {"transport": transport, "nccl": nccl}
        for count in args.streams:
            def copies(count=count):
                main_stream = torch.cuda.current_stream(device)
                part = n // count
                for i, s in enumerate(streams[:count]):
                    s.wait_stream(main_stream)
                    with torch.cuda.stream(s):
                        nxt[i * part:(i + 1) * part].copy_(send[i * part:(i + 1) * part], non_blocking=True)
                for s in streams[:count]:
                    main_stream.wait_stream(s)  # (a probe: no flags; what a box holds is never read)
            ways[f"copy x{count}"] = copies
        for name, fn in ways.items():
            seconds = timed(fn, args.iters, device)
            if rank == 0:
                print(f"{world} ranks, {mib:4d} MiB, {name:>10}: {seconds * 1e3:7.3f} ms, {n / seconds / 1e9:7.1f} GB/s",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
