"""Four ranks on two GPUs: can each rank write a flag into every peer's IPC-mapped mailbox?

    torchrun --standalone --nproc_per_node=4 benchmarks/probes/ipc_flags.py          # ranks round-robin over the GPUs
    BLOCKS=1 torchrun --standalone --nproc_per_node=4 benchmarks/probes/ipc_flags.py # ranks in blocks
"""
import ctypes, os
import torch, torch.distributed as dist
from ringflex.parallel import peer

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
n = torch.cuda.device_count()
dev = torch.device("cuda", rank // (size // n) if os.environ.get("BLOCKS") else rank % n)
torch.cuda.set_device(dev)
os.environ["RINGFLEX_TRANSPORT"] = "copy-engine"
t = peer.transport(dist.group.WORLD, dev)
lib = ctypes.CDLL("libcuda.so.1")
attr = lib.cuPointerGetAttribute
attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
def pattr(kind, ptr, ctype=ctypes.c_uint64):
    v = ctype(); s = attr(ctypes.byref(v), kind, ptr); return (s, v.value)
ctx = ctypes.c_uint64(); lib.cuCtxGetCurrent(ctypes.byref(ctx))
lines = [f"rank {rank} on {dev}, current ctx {ctx.value:#x}, to {t.to}, source {t.source}"]
for r, base in sorted(t.base.items()):
    s = torch.cuda.current_stream(dev).cuda_stream
    status = t.driver._write(s, base + 4 * 40, 7, 0)
    torch.cuda.synchronize(dev)
    lines.append(f"  peer {r}  base {base:#x}: write status {status}; "
                 f"ctx {pattr(1, base)} ordinal {pattr(9, base, ctypes.c_int)} memtype {pattr(2, base, ctypes.c_int)} "
                 f"mapped {pattr(17, base, ctypes.c_int) if False else ''}")
    # the same write from a fresh stream
    st = torch.cuda.Stream(dev)
    lines.append(f"    fresh stream: {t.driver._write(st.cuda_stream, base + 4 * 41, 7, 0)}")
    torch.cuda.synchronize(dev)
out = [None] * size
dist.all_gather_object(out, "\n".join(lines))
if rank == 0:
    print("\n".join(out))
dist.destroy_process_group()
