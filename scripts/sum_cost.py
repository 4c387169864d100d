"""What the ring's passes over a block's rows cost on one GPU: torch against the fused kernels.

    python scripts/sum_cost.py

Where a block's dK/dV gets three parts (a lending window's borrower: its own hop, the sum
the ring brings, the borrowed rows), torch widens the first into fp32, adds the second,
then adds the third into the result: three passes. ``merge.sum_parts`` reads each part
once and writes the result once. Rows of [1, 32, 8192, 128] bf16 tensors, as the ring
sums them (half the rows, views of whole blocks), timed replayed from a CUDA graph; then two
parts, where torch's one add is the alternative, over such rows and over whole tensors; and
the copy of such rows into a contiguous tensor to send (``merge.contiguous_rows``).
"""
import torch

from bench import replayed_ms
from ringflex.parallel import fused_merge
from ringflex.parallel.merge import contiguous_rows, sum_parts


def main():
    whole = [torch.randn(1, 32, 8192, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
    parts = [t.narrow(2, 4096, 4095) for t in whole]

    def in_torch():
        acc = torch.empty(parts[0].shape, dtype=torch.float32, device="cuda")
        acc.copy_(parts[0])
        acc.add_(parts[1])
        torch.add(acc, parts[2], out=parts[2])

    def fused():
        sum_parts(parts[2], parts, torch.float32)

    for name, fn in (("torch: widen, add, add", in_torch), ("fused sum of three", fused)):
        print(f"{name}: {replayed_ms(fn, 50) * 1e3:.1f} us per [1, 32, 4095, 128] bf16 tensor", flush=True)
    # two parts (where two meet: one pass either way), over row views and over whole tensors
    for label, (a, b) in (("[1, 32, 4095, 128] rows", parts[:2]), ("whole [1, 32, 8192, 128]", whole[:2])):
        print(f"two parts, {label}: torch.add {replayed_ms(lambda: torch.add(a, b, out=b), 50) * 1e3:.1f} us, "
              f"fused {replayed_ms(lambda: fused_merge.add(b, [a, b]), 50) * 1e3:.1f} us", flush=True)
    rows = whole[0].narrow(2, 4096, 4096)
    print(f"[1, 32, 4096, 128] rows copied contiguous: torch {replayed_ms(rows.contiguous, 50) * 1e3:.1f} us, "
          f"fused {replayed_ms(lambda: contiguous_rows(rows), 50) * 1e3:.1f} us; "
          f"a contiguous clone of as many bytes {replayed_ms(parts[0].contiguous().clone, 50) * 1e3:.1f} us",
          flush=True)


if __name__ == "__main__":
    main()
