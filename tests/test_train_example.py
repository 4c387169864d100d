"""examples/train_example.py, short: training with ring attention on 2 ranks gives the loss curve
of the plain model in one process (fp64, relative 1e-6 over 20 steps), also with packed
documents and a softcap (each batch sharded as shard_by_mask chooses for its documents), and
with a sliding window, in the sharding chosen for it and over the contiguous layout; the
comparison tool agrees."""
import json

import pytest

from support.harness import run_world

SMALL = ["--device", "cpu", "--dtype", "float64", "--batch", "2", "--seq-len", "32", "--dim", "32", "--heads", "4",
         "--kv-heads", "2", "--progress-every", "1000"]
VARIANTS = {"causal": ["--steps", "20"],
            "packed_softcap": ["--steps", "4", "--packed", "--min-doc", "3", "--max-doc", "12", "--softcap", "5"],
            "window": ["--steps", "4", "--window", "5"],
            "window_contiguous": ["--steps", "4", "--window", "5", "--layout", "contiguous"]}


def _train(rank, world_size, argv):
    from examples import train_example
    return train_example.train(train_example.parse_args(argv))


@pytest.mark.parametrize("variant", VARIANTS)
def test_ring_training_matches_one_process(variant, tmp_path):
    from examples import train_example
    argv = SMALL + VARIANTS[variant]
    single = train_example.train(train_example.parse_args(argv + ["--out", str(tmp_path / "single.json")]))
    ring = run_world(2, _train, argv + ["--out", str(tmp_path / "ring.json")])[0]
    assert ring["world_size"] == 2 and ring["ring"]
    assert single["ring"] == (variant != "causal")  # CPU flex_attention has no backward
    assert max(train_example.relative_differences(ring["losses"], single["losses"])) < 1e-6
    assert train_example.compare([str(tmp_path / "single.json"), str(tmp_path / "ring.json")], 20, 1e-6, None)
    assert json.loads((tmp_path / "ring.json").read_text())["losses"] == ring["losses"]
