"""Host time of a ring call by phase (run with torchrun): where a host-bound call spends it.

Wraps ringflex's functions with timers (inclusive wall time, nested phases indented) and
prints, for every rank, the host time per fwd+bwd of each phase over calls issued back to
back, beside the call's host time and its back-to-back time with the GPU drained. Cheaper
than cProfile (``profile_ring.py --host-profile``), which inflates every Python call.

    torchrun --nproc_per_node=2 -m benchmarks.probes.host_phases --seq-len 16384
    torchrun --nproc_per_node=4 -m benchmarks.probes.host_phases --seq-len 32768 --mesh 4x1 --forward-only

``--ab-agreement ROUNDS`` times rounds of calls with the argument check's records on the
shared-memory board and over gloo in turn, in one process (host time moves between processes);
``--ab-launch ROUNDS`` the fused merge's kernels launched directly and through Triton's JIT;
``--ab-sends ROUNDS`` the own block's sends in turn after the inputs, side by side, and after the queued compute;
``--ab-joined ROUNDS`` a step's hops of disjoint rows and keys in one kernel call, and a call each.

``--mesh AxR`` times calls over a heads x ring mesh of every rank (its argument check and
all-to-alls are phases too); ``--forward-only`` times forward calls alone, which no backward
lets the host run ahead of.

Each rank also lists its threads that were busy during the timed calls: their CPU time per
call and the CPU (and physical core) each ran on last, and the round trip of the agreement's
exchange alone (the control group's all_gather of one record, timed apart): the same call's
host time moves between processes, and either could be why.

The mask ``new_documents`` is packed documents with new lengths at every call, as in training
on packed batches: each call then plans anew. ``--one-at-a-time`` issues each call on a
drained GPU after a barrier and prints the median and least host time of one call: where two
ranks share a GPU, calls issued back to back fill its queues and the host waits in them.
Where ranks share a GPU their launches also wait for each other in the driver (a cuDNN execute
takes 0.2 ms there against 15 us alone): ``--alone RANK`` (with ``--one-at-a-time``) has every
other rank sleep ``--alone-ms`` once it agreed on each timed call, so RANK's own host work after
the agreement, forward and backward, runs while no other process launches, and prints RANK's
lines alone.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import make_mods

from tools.ranks import init
import ringflex
from torch.distributed.device_mesh import init_device_mesh

from ringflex import api, checks, heads
from ringflex.kernels import cudnn, fused_merge, merge
from ringflex.mod import captured, trace
from ringflex.parallel import agreement, alltoall, board, comm, compute, kv, peer, ring, shares
from ringflex.parallel.groups import gather_objects
from ringflex.plan import blocks, lending

SPENT, CALLS = collections.defaultdict(int), collections.defaultdict(int)
FORWARD, BACKWARD = "the call's forward (all of it)", "the call's backward (all of it)"  # timed around the call
# (owner, function, label); a label's indent says which phase it runs inside
PHASES = [
    (heads, "_agree", "heads x ring: the mesh's argument check"),
    (alltoall, "_all_to_all", "heads x ring: the all-to-alls"),
    (checks, "local_error", "own argument checks"),
    (api, "_plan", "plan on this rank"), (api._CALL_PLANS, "lookup", "  this rank's plan of the call, looked up"),
    (api._PLANS, "get", "    plan cache lookups (a call not seen before)"),
    (blocks, "plan_hops", "      planning (a mask not seen before)"), (trace, "_trace", "        tracing the mask"),
    (cudnn.blocks, "exact_runs", "        the kernel's exact plans (outside the kernel too)"),
    (lending, "offer", "    lending: this rank's offer (a call not seen before)"),
    (agreement, "start", "start of the agreement (the cross-rank exchange)"),
    (agreement.Agreement, "wait", "waiting for the other ranks' records"),
    (kv.KVStream, "__init__", "K/V stream set-up"), (kv.KVStream, "start", "transfers issued"),
    (peer.PeerTransport, "exchange", "copy-engine exchanges (K/V, dK/dV shares)"),
    (cudnn.CudnnKernel, "forward", "kernel forward"), (cudnn.CudnnKernel, "backward", "kernel backward"),
    (cudnn.CudnnKernel, "forward_hops", "kernel forward, hops joined"),
    (cudnn.CudnnKernel, "backward_hops", "kernel backward, hops joined"),
    (cudnn.graphs.Graph, "execute", "  cuDNN execute"), (cudnn.graphs, "_build", "  cuDNN graph builds"),
    (merge.RowMerge, "add", "output merges"), (merge.RowSum, "add", "gradient sums"),
    (ring, "ring_forward", "ring forward (all of it)"), (ring, "ring_backward", "ring backward (all of it)"),
    (ring.RingCall, "agree", "  the agreed plan (steps, rows read, loans)"),
    (merge.RowMerge, "__init__", "  output merges set up"), (merge.RowSum, "__init__", "  gradient sums set up"),
    (shares, "exchange", "  dK/dV shares exchanged"),
    (fused_merge, "add", "Triton launches: sums and copies"), (fused_merge, "merge", "Triton launches: merges"),
    (cudnn.graphs, "graph", "cuDNN graph lookups"),
    (torch.cuda, "is_current_stream_capturing", "CUDA-graph capture queries (every caller)"),
    (captured, "parts", "walks of a mod's parts (every caller)"),
    (blocks, "fingerprint", "hashes of a mod: plan caches"), (agreement, "fingerprint", "hashes of a mod: the agreement"),
    (ring, "lend_forward", "  lending: queries sent, borrowed rows computed (forward)"),
    (ring, "lend_backward", "  lending: lent rows' inputs sent (backward)"),
    (ring, "borrowed_backward", "  lending: borrowed rows computed (backward)"),
]


def _spend(label: str, start: int) -> None:
    SPENT[label] += time.perf_counter_ns() - start
    CALLS[label] += 1


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _spend(label, start)
    setattr(owner, name, wrapper)


def _threads() -> dict:
    """This process's threads (Linux): thread id -> (name, the CPU it ran on last, CPU seconds)."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # from the state on: field 3 of proc(5)
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        found[tid] = (name, int(fields[36]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return found


def _core(cpu: int) -> str:
    """The physical core of a logical CPU, as package:core."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{topology}/physical_package_id") as f, open(f"{topology}/core_id") as g:
            return f"{f.read().strip()}:{g.read().strip()}"
    except OSError:
        return "?"


def _busy_threads(before: dict, after: dict, calls: int, wall: float) -> str:
    """The threads that took at least a tenth of the timed wall time, with their CPU time per call."""
    busy = []
    for tid, (name, cpu, seconds) in after.items():
        spent = seconds - before.get(tid, (name, cpu, 0.0))[2]
        if spent >= 0.1 * wall:
            busy.append(f"{name} {spent / calls * 1e3:.2f} ms/call on cpu {cpu} (core {_core(cpu)})")
    return "; ".join(busy) or "none"


def _exchange_us(group, times: int = 200) -> str:
    """The round trip of the agreement's all_gather of one record over the control group."""
    control = agreement.control_group(group.get_group("ring") if hasattr(group, "get_group") else dist.group.WORLD)
    record = torch.zeros(80, dtype=torch.int64)
    gathered = [torch.empty_like(record) for _ in range(dist.get_world_size(control))]
    spent = []
    for _ in range(times):
        start = time.perf_counter_ns()
        dist.all_gather(gathered, record, group=control)
        spent.append((time.perf_counter_ns() - start) / 1e3)
    spent.sort()
    return f"median {spent[times // 2]:.0f} us, 90th percentile {spent[times * 9 // 10]:.0f} us ({times} in a row)"


def _alternate(forward_backward, rounds: int, calls: int, what: str, settings: dict) -> None:
    """Ms per call, back to back (the GPUs' work done), under each of ``settings`` (name -> a
    function that applies it), in turn, in one process (host time moves between processes);
    the first is restored after."""
    spent = collections.defaultdict(list)
    for _ in range(rounds):
        for name, apply in settings.items():
            apply()
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                forward_backward()
            torch.cuda.synchronize()
            spent[name].append((time.perf_counter() - start) / calls * 1e3)
    next(iter(settings.values()))()
    line = f"rank {dist.get_rank()}, {what}: " + "; ".join(
        f"{name} " + " ".join(f"{ms:.2f}" for ms in times) + f" (median {statistics.median(times):.2f})"
        for name, times in spent.items()) + " ms per call, back to back"
    gathered = gather_objects(None, line)
    if dist.get_rank() == 0:
        print("\n".join(gathered), flush=True)


def _agreement_settings() -> dict:
    """The argument check's records on the shared-memory board, or over gloo."""
    on_board = board.of
    return {"board": lambda: setattr(board, "of", on_board), "gloo": lambda: setattr(board, "of", lambda group: None)}


def _send_settings() -> dict:
    """The own K/V block's sends one after another after the inputs (as the ring sends), side
    by side after the inputs (each ``sent`` hidden from the ring), or after the compute queued
    before them (``send_after`` dropped)."""
    exchange = comm.RingComm.exchange

    def side_by_side(self, send, recv, shift=1, send_after=None):
        pending = exchange(self, send, recv, shift, send_after)
        pending.sent = None
        return pending

    def after_compute(self, send, recv, shift=1, send_after=None):
        return side_by_side(self, send, recv, shift)
    return {"in turn": lambda: setattr(comm.RingComm, "exchange", exchange),
            "side by side": lambda: setattr(comm.RingComm, "exchange", side_by_side),
            "after compute": lambda: setattr(comm.RingComm, "exchange", after_compute)}


def _joined_settings() -> dict:
    """A step's hops of disjoint rows and keys in one kernel call where the kernel takes them
    (``compute.step_forward``: a rank's own diagonal blocks over zigzag), or a call each."""
    joinable = compute._joinable
    return {"joined": lambda: setattr(compute, "_joinable", joinable),
            "a call each": lambda: setattr(compute, "_joinable", lambda call, hops: False)}


def _launch_settings() -> dict:
    """The fused merge's kernels launched directly (``kernels.launch``), or through Triton's JIT."""
    launchers = fused_merge._kernels()
    knobs = [launcher.knobs for launcher in launchers]

    def direct():
        for launcher, k in zip(launchers, knobs):
            launcher.knobs = k

    def jit():
        for launcher in launchers:
            launcher.knobs = None  # as where Triton has no knobs: every launch through the JIT
    return {"direct": direct, "jit": jit}


def _sleep_after_agreeing(ms: float):
    """``RingCall.agree`` followed by a sleep of ``ms`` on this rank (``--alone``); returns the
    method as it was, to restore."""
    agree = ring.RingCall.agree

    @functools.wraps(agree)
    def then_sleep(self, *args, **kwargs):
        agree(self, *args, **kwargs)
        time.sleep(ms / 1e3)
    ring.RingCall.agree = then_sleep
    return agree


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--cases", nargs="+", default=["documents:contiguous", "documents:zigzag", "causal:zigzag",
                                                   "window:contiguous", "new_documents:contiguous"], help="mask:layout pairs")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (new_documents: each with new documents)")
    p.add_argument("--one-at-a-time", action="store_true", help="each call on a drained GPU, after a barrier")
    p.add_argument("--no-timers", action="store_true", help="the call's host time alone, without the phases' timers")
    p.add_argument("--alone", type=int, metavar="RANK",
                   help="with --one-at-a-time: the other ranks sleep once they agreed, so RANK's host runs alone")
    p.add_argument("--alone-ms", type=float, default=50.0, help="how long the other ranks sleep (--alone)")
    p.add_argument("--mesh", help="calls over a heads x ring mesh 'axr' of every rank (a * r ranks)")
    p.add_argument("--forward-only", action="store_true", help="forward calls alone, no backward")
    p.add_argument("--ab-agreement", type=int, metavar="ROUNDS",
                   help="rounds of --calls calls, the records over the shared-memory board and over gloo in turn")
    p.add_argument("--ab-sends", type=int, metavar="ROUNDS",
                   help="rounds of --calls calls, the own block's sends in turn, side by side and after the compute")
    p.add_argument("--ab-joined", type=int, metavar="ROUNDS",
                   help="rounds of --calls calls, a step's disjoint hops in one kernel call and a call each in turn")
    p.add_argument("--ab-launch", type=int, metavar="ROUNDS",
                   help="rounds of --calls calls, the fused merge launched directly and through Triton's JIT in turn")
    args = p.parse_args()
    device = init()
    group = None
    if args.mesh:
        group = init_device_mesh(device.type, tuple(map(int, args.mesh.split("x"))), mesh_dim_names=("heads", "ring"))
    if args.alone is not None and not args.one_at_a_time:
        p.error("--alone needs --one-at-a-time: the other ranks' sleeps would add up over calls back to back")
    for owner, name, label in [] if args.no_timers else PHASES:
        _timed(owner, name, label)
    asleep = args.alone is not None and dist.get_rank() != args.alone
    for case in args.cases:
        mask, layout = case.split(":")
        fresh = mask == "new_documents"
        masks = [make_mods("documents" if fresh else mask, args.seq_len, device, 4096, 4096, seed=i)
                 for i in range(args.warmup + args.calls if fresh else 1)]
        calls = iter(masks)  # one per call (new documents); else the same every call
        q, k, v = (ringflex.shard(torch.randn(1, 32, args.seq_len, 128, device=device, dtype=torch.bfloat16), 2,
                                  group=group, layout=layout).requires_grad_() for _ in range(3))
        grad = torch.randn_like(q)

        def forward_backward():
            score_mod, mask_mod = next(calls) if fresh else masks[0]
            start = time.perf_counter_ns()
            with torch.no_grad() if args.forward_only else contextlib.nullcontext():
                out = ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, group=group,
                                                   layout=layout)
            _spend(FORWARD, start)
            if not args.forward_only:
                start = time.perf_counter_ns()
                out.backward(grad)
                _spend(BACKWARD, start)

        for _ in range(args.warmup):
            forward_backward()
        torch.cuda.synchronize()
        dist.barrier()
        if args.ab_agreement:
            _alternate(forward_backward, args.ab_agreement, args.calls, f"{mask} over {layout}", _agreement_settings())
        if args.ab_sends:
            _alternate(forward_backward, args.ab_sends, args.calls, f"{mask} over {layout}", _send_settings())
        if args.ab_joined:
            _alternate(forward_backward, args.ab_joined, args.calls, f"{mask} over {layout}", _joined_settings())
        if args.ab_launch:
            _alternate(forward_backward, args.ab_launch, args.calls, f"{mask} over {layout}", _launch_settings())
            continue
        SPENT.clear()
        CALLS.clear()
        agreeing = _sleep_after_agreeing(args.alone_ms) if asleep else None
        threads, started = _threads(), time.perf_counter()
        if args.one_at_a_time:
            alone = []
            for _ in range(args.calls):
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                forward_backward()
                alone.append(time.perf_counter() - start)
            timing = (f"host {statistics.median(alone) * 1e3:.2f} ms per call issued alone (median; least "
                      f"{min(alone) * 1e3:.2f} ms)")
        else:
            start = time.perf_counter()
            for _ in range(args.calls):
                forward_backward()
            host = (time.perf_counter() - start) / args.calls
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.calls
            timing = f"host {host * 1e3:.2f} ms per call, back to back {wall * 1e3:.2f} ms"
        what = ("forward" if args.forward_only else "fwd+bwd") + (f", mesh {args.mesh}" if args.mesh else "")
        lines = [f"rank {dist.get_rank()}, {mask} over {layout}, {args.seq_len} tokens, {what}: {timing}",
                 f"  threads busy: {_busy_threads(threads, _threads(), args.calls, time.perf_counter() - started)}"]
        lines += [f"  {label:40s} {SPENT[label] / args.calls / 1e3:7.0f} us  ({CALLS[label] / args.calls:.0f} calls)"
                  for label in (FORWARD, BACKWARD, *(label for _, _, label in PHASES)) if CALLS[label]]
        lines.append(f"  agreement's exchange alone: {_exchange_us(group)}")
        if agreeing is not None:
            ring.RingCall.agree = agreeing
        gathered = gather_objects(None, "\n".join(lines))
        if args.alone is not None:
            gathered = [f"(rank {args.alone} alone after the agreement: the other ranks slept {args.alone_ms:g} ms)",
                        gathered[args.alone]]
        if dist.get_rank() == 0:
            print("\n".join(gathered), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
