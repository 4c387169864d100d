"""Merges and sums over two row ranges of the same tensors (a joined call's results) in one
launch of the fused kernels, against each range launched alone: shared by the GPU test
(compiled kernels, tests/gpu/test_fused_merge.py) and the interpreter's (tests/test_fused_kernels.py)."""
import torch

from ringflex.kernels import fused_merge


def mismatches(ranges, counts, device, g: torch.Generator) -> list:
    """The cases that differ, bit for bit, from each range launched alone (or whose rows apart
    are not the ranges' distance): merges of 2 and 3 parts, and sums of ``counts`` parts, alone
    and in pairs (a block's dK and dV), over rows ``ranges`` ((first row, rows), twice) of
    [2, 3, L, D] bf16 tensors (the LSEs fp32) on ``device``."""
    rows, apart_wanted = max(a + n for a, n in ranges) + 3, ranges[1][0] - ranges[0][0]

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    def zeros(*shape, dtype=torch.bfloat16):  # rows in no range stay 0 in both results
        return torch.zeros(*shape, device=device, dtype=dtype)
    wrong = []
    for count in (2, 3):
        xs, lses = [randn(2, 3, rows, 64) for _ in range(count)], [randn(2, 3, rows, dtype=torch.float32) * 4
                                                                   for _ in range(count)]
        results = [(zeros(2, 3, rows, 64), zeros(2, 3, rows, dtype=torch.float32)) for _ in range(2)]
        jobs = [[(d.narrow(2, a, n), [(x.narrow(2, a, n), s.narrow(2, a, n), None) for x, s in zip(xs, lses)],
                  lse.narrow(2, a, n), None) for a, n in ranges] for d, lse in results]
        apart = fused_merge.merge_rows_apart(*jobs[0])
        fused_merge.merge(*jobs[0][0], then=(apart, jobs[0][1]))
        for job in jobs[1]:
            fused_merge.merge(*job)
        if apart != apart_wanted or not all(torch.equal(a, b) for a, b in zip(*results)):
            wrong.append(("merge", count, apart))
    for count in counts:
        parts = [[randn(2, 3, rows, dim) for _ in range(count)] for dim in (128, 96)]
        for pair in (False, True):
            tensors = range(2 if pair else 1)
            results = [[zeros(2, 3, rows, dim) for dim in (128, 96)] for _ in range(2)]
            jobs = [[[(d[i].narrow(2, a, n), [p.narrow(2, a, n) for p in parts[i]]) for i in tensors]
                     for a, n in ranges] for d in results]
            apart = fused_merge.sum_rows_apart(*jobs[0])
            fused_merge.add(*jobs[0][0][0], beside=jobs[0][0][1] if pair else None, then=(apart, jobs[0][1]))
            for job in jobs[1]:
                fused_merge.add(*job[0], beside=job[1] if pair else None)
            if apart != apart_wanted or not all(torch.equal(results[0][i], results[1][i]) for i in tensors):
                wrong.append(("sum", count, pair, apart))
    return wrong
