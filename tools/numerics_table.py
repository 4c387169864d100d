"""The ring's error against a float64 oracle by world size, as a markdown table (CPU, gloo).

    python -m tools.numerics_table                       # world sizes 1 2 4 8
    python -m tools.numerics_table --world-sizes 1 8 16
    python -m tools.numerics_table --bf16-merge          # control: a ring that rounds per hop

Errors are relative to the reference's largest magnitude over the whole sequence (see
tests/support/numerics.py, which tests/test_numerics.py bounds). ``--bf16-merge`` rounds the running
output to bf16 after every merge, the mistake the design notes warn of, to show that the
test's bounds catch it; only its bf16 rows mean anything.
"""
import argparse

from tests.support.harness import run_world
from tests.support.numerics import measure


def measure_with_bf16_merge(rank, world_size):
    import ringflex.parallel.ring as ring

    class MergeInInputDtype(ring.RowMerge):
        """Accumulates the running output in the input dtype: every merge rounds it."""

        def __init__(self, shape, dtype, acc_dtype, device, expected):
            super().__init__(shape, dtype, dtype, device, expected)
            self.lse = self.lse.to(acc_dtype)

    ring.RowMerge = MergeInInputDtype
    return measure(rank, world_size)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--bf16-merge", action="store_true", help="the control described above")
    args = parser.parse_args()
    fn = measure_with_bf16_merge if args.bf16_merge else measure
    print("| ranks | problem | dtype | out | dq | dk | dv | rerun bitwise equal |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for world_size in args.world_sizes:
        per_rank = run_world(world_size, fn, timeout=600)
        errors = per_rank[0][0]
        repeatable = all(r[1] for r in per_rank)
        for (problem, dtype), errs in errors.items():
            if args.bf16_merge and dtype != "bfloat16":
                continue
            cells = " | ".join(f"{e:.2e}" for e in errs)
            print(f"| {world_size} | {problem} | {dtype} | {cells} | {'yes' if repeatable else 'NO'} |")


if __name__ == "__main__":
    main()
