"""Whether a copy runs beside an attention kernel that holds every SM: a device-local copy
(the mailbox's copy-out), a 2-D one, and a copy that writes into another GPU's memory (a
send), each issued on a second stream while cuDNN's SDPA runs on the first.

    python3 -m benchmarks.probes.copy_beside_kernel
"""
import torch
import torch.nn.functional as F
from ringflex.parallel.driver import Driver
from torch.nn.attention import SDPBackend, sdpa_kernel


def beside_kernel(kernel_stream, copy_stream, copy):
    """(the kernel's ms, when the copy issued beside it ended, ms after the kernel began)."""
    q = torch.randn(1, 32, 16384, 128, device="cuda:0", dtype=torch.bfloat16)
    for _ in range(2):  # the first builds cuDNN's graph
        start, kernel_end, copy_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        with torch.cuda.stream(kernel_stream), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            start.record()
            F.scaled_dot_product_attention(q, q, q)
            kernel_end.record()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_event(start)
            copy()
            copy_end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(kernel_end), start.elapsed_time(copy_end)


def alone(copy) -> float:
    copy()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    copy()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main():
    n = 32 << 20
    a, b = (torch.empty(n, dtype=torch.uint8, device="cuda:0") for _ in range(2))
    wide = torch.empty(2 * n, dtype=torch.uint8, device="cuda:0")
    rows = wide.view(64, -1)[:, : (n // 64)]  # 64 rows of half their pitch: a 2-D copy
    ks, cs = torch.cuda.Stream("cuda:0"), torch.cuda.Stream("cuda:0")
    driver = Driver()

    def raw():
        return torch.cuda.current_stream().cuda_stream

    cases = [("torch copy_, device-local (32 MiB)", lambda: b.copy_(a)),
             ("cuMemcpyAsync, device-local (32 MiB)", lambda: driver.copy(raw(), b.data_ptr(), a.data_ptr(), n)),
             ("cuMemcpy2DAsync, device-local (64 rows)",
              lambda: driver.copy_rows(raw(), b.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[1], 64))]
    if torch.cuda.device_count() > 1:
        remote = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        remote.copy_(a)
        a.copy_(remote)  # peer access on, both ways
        cases += [("cuMemcpyAsync into GPU 1 (a send)", lambda: driver.copy(raw(), remote.data_ptr(), a.data_ptr(), n)),
                  ("cuMemcpyAsync from GPU 1 into GPU 0 (a pull)",
                   lambda: driver.copy(raw(), a.data_ptr(), remote.data_ptr(), n)),
                  ("cuMemcpy2DAsync into GPU 1", lambda: driver.copy_rows(
                      raw(), remote.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[1], 64))]
    for label, copy in cases:
        kernel, copy_end = beside_kernel(ks, cs, copy)
        print(f"{label:46s} alone {alone(copy):6.3f} ms; beside a {kernel:5.2f} ms kernel "
              f"it ends at {copy_end:5.2f} ms")


if __name__ == "__main__":
    main()
