"""The ring benchmark runs end to end (CPU, gloo, reference kernel, toy sizes)."""
import sys
from pathlib import Path

from harness import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def _bench(rank, world_size):
    import bench
    rows = bench.run(bench.parse_args(["--device", "cpu", "--seq-lens", "64", "--heads", "2", "--head-dim", "8",
                                       "--iters", "1", "--warmup", "0", "--window", "16", "--doc-len", "16"]))
    return [(r["mask"], r["ringflex"]["efficiency_fwd_bwd"] > 0) for r in rows]


def test_bench_smoke():
    rows = run_world(2, _bench)[0]
    assert [mask for mask, _ in rows] == ["none", "causal", "window", "documents", "causal_softcap"]
    assert all(ok for _, ok in rows)
