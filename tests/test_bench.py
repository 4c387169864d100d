"""The ring benchmark runs end to end (CPU, gloo, reference kernel, toy sizes)."""

from support.harness import run_world


def _bench(rank, world_size):
    from benchmarks import bench
    rows = bench.run(bench.parse_args(["--device", "cpu", "--seq-lens", "64", "--heads", "2", "--head-dim", "8",
                                       "--iters", "1", "--warmup", "0", "--window", "16", "--doc-len", "16",
                                       "--layouts", "zigzag", "by-mask", "moved"]))
    return [(r["mask"], r["layout"], r["ringflex"]["efficiency_fwd_bwd"] > 0) for r in rows]


def test_bench_smoke():
    rows = run_world(2, _bench)[0]
    masks = ["none", "causal", "window", "documents", "prefix_lm", "causal_softcap"]
    layouts = ("zigzag", "by-mask", "moved")  # moved: zigzag shards, each call moved to by-mask's sharding
    assert [(mask, layout) for mask, layout, _ in rows] == [(m, l) for m in masks for l in layouts]
    assert all(ok for _, _, ok in rows)


def test_gpu_idle_from_a_trace():
    """profile_ring's idle time: gaps where no kernel but NCCL's (which spin while waiting)
    runs on any stream, overlaps merged; copies (copy engines, no SM) do not count as work."""
    from benchmarks.profile_ring import gpu_idle
    events = [dict(ph="X", cat="kernel", ts=ts, dur=dur, name=name) for ts, dur, name in (
        (0, 100, "attention"), (50, 150, "copy"),  # overlapping: busy until 200
        (150, 300, "ncclDevKernel_SendRecv"),        # a transfer: not compute
        (300, 10, "merge"),                          # 100 idle before it, after copy
        (360, 90, "attention"))]                     # 50 idle before it, after merge
    events.append(dict(ph="X", cat="cpu_op", ts=250, dur=1000, name="host"))  # not the GPU's
    events.append(dict(ph="X", cat="gpu_memcpy", ts=200, dur=100, name="Memcpy PtoP"))  # no SM
    idle = gpu_idle({"traceEvents": events}, calls=1)
    assert idle["idle_ms"] == 0.15
    assert idle["longest"] == [(0.1, "copy", "merge"), (0.05, "merge", "attention")]


def test_rank_timelines_put_the_ranks_traces_on_one_clock():
    """profile_ring --timelines: each rank's busiest stream in order, from the first kernel of
    any rank, named short; its ms per family; memsets and quieter streams left out."""
    from benchmarks.profile_ring import rank_timelines

    def trace(*kernels):
        return {"traceEvents": [dict(ph="X", cat=cat, ts=ts, dur=dur, name=name, args=dict(stream=stream))
                                for cat, ts, dur, name, stream in kernels]}
    rank0 = trace(("kernel", 1000, 500, "cudnn_generated_fort_native_sdpa_sm90", 7),
                  ("kernel", 1600, 100, "lse_merge", 7), ("kernel", 1000, 50, "elementwise", 9),
                  ("gpu_memset", 990, 1, "Memset (Device)", 7))
    rank1 = trace(("kernel", 3000, 200, "void cudnn::fusion::compute_dot_do_o", 7),
                  ("kernel", 3200, 2000, "cudnn_generated_fort_native_sdpa_sm90", 7),
                  ("kernel", 5200, 100, "sum_parts", 7), ("kernel", 5300, 50, "sum_pairs", 7))
    assert rank_timelines([rank0, rank1]).splitlines() == [
        "rank 0: A:0.000(0.500) M:0.600(0.100)", "rank 0 ms: A 0.500, M 0.100",
        "rank 1: D:2.000(0.200) A:2.200(2.000) S:4.200(0.100) S:4.300(0.050)",
        "rank 1 ms: A 2.000, D 0.200, S 0.150"]


def test_host_behind_gaps_from_a_trace():
    """profile_ring --with-stack: behind the longest idle gap, the host's Python functions by
    their own time between the launch of the kernel before the gap and that of the kernel after
    it, whether the runtime or the driver (Triton) launched them."""
    from benchmarks.profile_ring import host_behind_gaps
    kernel = lambda ts, dur, name, corr: dict(ph="X", cat="kernel", ts=ts, dur=dur, name=name,  # noqa: E731
                                              args={"correlation": corr})
    launch = lambda ts, cat, corr: dict(ph="X", cat=cat, ts=ts, dur=5, name="launch",  # noqa: E731
                                        args={"correlation": corr})
    python = lambda ts, dur, name: dict(ph="X", cat="python_function", ts=ts, dur=dur, name=name)  # noqa: E731
    events = [kernel(100, 50, "merge", 1), kernel(1150, 100, "attention", 2),  # idle from 150 to 1150
              launch(90, "cuda_driver", 1), launch(1100, "cuda_runtime", 2),
              python(0, 2000, "backward"), python(200, 600, "setup"), python(300, 200, "plan"),
              python(1500, 100, "later")]  # after the second launch: not behind the gap
    gap, = host_behind_gaps({"traceEvents": events}, top=1)
    assert gap["gap_ms"] == 1.0 and gap["host_ms_between_launches"] == 1.01
    assert gap["host"] == [("backward", 0.41), ("setup", 0.4), ("plan", 0.2)]  # each less its callees' time


def _bench_mesh(rank, world_size):
    from benchmarks import bench_mesh
    rows = bench_mesh.run(bench_mesh.parse_args(["--device", "cpu", "--tokens-per-rank", "32", "--heads", "4",
                                                 "--head-dim", "8", "--iters", "1", "--warmup", "0", "--rounds", "1",
                                                 "--doc-len", "16"]))
    return [(r["mask"], sorted(n for n in r if n == "ring" or n.startswith("mesh ")),
             all(r[n]["efficiency_fwd_bwd"] > 0 for n in r if n == "ring" or n.startswith("mesh "))) for r in rows]


def test_bench_mesh_smoke():
    """The heads x ring benchmark times the pure ring and every mesh of 4 ranks."""
    rows = run_world(4, _bench_mesh)[0]
    assert rows == [(mask, ["mesh 1x4", "mesh 2x2", "mesh 4x1", "ring"], True) for mask in ("none", "causal", "documents")]


def _bench_block(rank, world_size):
    from benchmarks import bench_block
    rows = bench_block.run(bench_block.parse_args([
        "--device", "cpu", "--seq-lens", "64", "--dim", "16", "--heads", "2", "--iters", "1", "--warmup", "0",
        "--rounds", "1", "--window", "16", "--doc-len", "16", "--layouts", "zigzag", "default", "by-mask"]))
    return [(r["mask"], r["layout"], r["block_ms"] > 0 and r["call_ms"] > 0, r["block_vs_best"], r["call_vs_best"])
            for r in rows]


def test_bench_block_smoke():
    """A transformer block around the ring, in each layout, against the fastest for its mask."""
    rows = run_world(2, _bench_block)[0]
    assert [(mask, layout) for mask, layout, *_ in rows] == [(m, l) for m in ("window", "documents", "causal")
                                                             for l in ("zigzag", "default", "by-mask")]
    assert all(ok for _, _, ok, *_ in rows)
    for mask in ("window", "documents", "causal"):
        for ratios in zip(*[r[3:] for r in rows if r[0] == mask]):  # the block's, the call's: 1 for the fastest
            assert min(ratios) == 1 and all(x >= 1 for x in ratios), (mask, ratios)


def test_mesh_model_prices_the_measured_rows_and_prefers_heads_inside_a_node_across_hosts():
    from pathlib import Path

    from benchmarks import mesh_model
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    measured = results / "4xh100_2026-11-27_head_groups_8k_nccl_alltoall.json"  # after the dK/dV shares
    rows = mesh_model.check(str(measured)).splitlines()[1:]
    for row in rows:
        measured, model = map(float, row.split("|")[1].split())
        assert abs(model - measured) < 0.05 * measured, row
    s = 8192 * 16  # 2 nodes of 8 GPUs, 8k tokens per GPU
    assert mesh_model.efficiency(8, 2, s, 32, 0.5) > 2 * mesh_model.efficiency(1, 16, s, 32, 0.5)


def test_sharding_model_prints_the_chosen_sharding_per_mask(capsys):
    """``benchmarks/sharding_model.py`` at toy sizes: every mask gets a chosen row."""
    from benchmarks import sharding_model
    import sys
    argv, sys.argv = sys.argv, ["sharding_model", "--per-rank", "256", "--world-sizes", "2", "--window", "64",
                                "--repeats", "1", "--batches", "2"]
    try:
        sharding_model.main()
    finally:
        sys.argv = argv
    assert capsys.readouterr().out.count("(chosen)") == 4
