"""The CUDA driver calls the copy-engine transport (``peer``) makes, through ctypes: on its
streams, write and await 32-bit flags (stream memory operations, which torch does not
expose) and copy between addresses, contiguous or as rows (a 2-D copy); and, where ranks
share a GPU (``mapped``), memory that other processes map by CUDA IPC."""
from __future__ import annotations

import contextlib
import ctypes

_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: an address of the unified address space, on any GPU of the host


class _Memcpy2D(ctypes.Structure):
    """The driver's CUDA_MEMCPY2D."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


class _IpcHandle(ctypes.Structure):
    """The driver's CUipcMemHandle."""
    _fields_ = [("reserved", ctypes.c_char * 64)]


class Driver:
    """The CUDA driver calls the transport makes on its streams: write / await a 32-bit flag
    (which torch does not expose), and copy between addresses: no tensor views to make for a
    chunk and no stream context to enter, which torch's ``copy_`` needs, at every chunk."""

    _AND = 0x2  # CU_STREAM_WAIT_VALUE_AND: until (flag & value) != 0

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = self._function(lib, "cuStreamWaitValue32")
        self._write = self._function(lib, "cuStreamWriteValue32")
        self._copy = lib.cuMemcpyAsync
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._copy_rows = getattr(lib, "cuMemcpy2DAsync_v2", None) or lib.cuMemcpy2DAsync
        self._copy_rows.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self._copy_rows.restype = ctypes.c_int
        self._lib = lib

    @staticmethod
    def _function(lib, name: str):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn

    def write(self, stream: int, address: int, value: int) -> None:
        """On ``stream`` (a raw CUDA stream handle): set the flag at ``address`` to ``value``."""
        self._check(self._write(stream, address, value, 0), "cuStreamWriteValue32")

    def wait(self, stream: int, address: int, mark: int) -> None:
        """On ``stream``: wait until the flag at ``address`` has a bit of ``mark`` set."""
        self._check(self._wait(stream, address, mark, self._AND), "cuStreamWaitValue32")

    def copy(self, stream: int, destination: int, source: int, nbytes: int) -> None:
        """On ``stream``: copy ``nbytes`` from address ``source`` to ``destination``."""
        self._check(self._copy(destination, source, nbytes, stream), "cuMemcpyAsync")

    def copy_rows(self, stream: int, destination: int, source: int, pitch: int, width: int, rows: int) -> None:
        """On ``stream``: copy ``rows`` rows of ``width`` bytes, ``pitch`` apart from address
        ``source`` on, to contiguous memory at ``destination``."""
        params = _Memcpy2D(srcMemoryType=_UNIFIED, srcDevice=source, srcPitch=pitch, dstMemoryType=_UNIFIED,
                           dstDevice=destination, dstPitch=width, WidthInBytes=width, Height=rows)
        self._check(self._copy_rows(ctypes.byref(params), stream), "cuMemcpy2DAsync")

    def allocate(self, device: int, nbytes: int) -> int:
        """``nbytes`` of memory on GPU ``device`` (in its primary context, torch's), outside
        torch's allocator: memory a CUDA IPC handle can name whatever the allocator's settings."""
        address = ctypes.c_uint64()
        with self._context(device):
            self._check(self._call("cuMemAlloc", ctypes.byref(address), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        return address.value

    def free(self, device: int, address: int) -> None:
        """Frees what ``allocate`` returned, once the GPU has done all the work queued so far
        (torch's stream semantics do not cover this memory)."""
        with self._context(device):
            self._check(self._call("cuCtxSynchronize"), "cuCtxSynchronize")
            self._check(self._call("cuMemFree", ctypes.c_uint64(address)), "cuMemFree")

    def ipc_handle(self, device: int, address: int) -> bytes:
        """The CUDA IPC handle of memory that ``allocate`` returned on GPU ``device``, for
        another process to open."""
        handle = _IpcHandle()
        with self._context(device):
            self._check(self._call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(address)),
                        "cuIpcGetMemHandle")
        return bytes(handle.reserved)

    def ipc_open(self, device: int, handle: bytes) -> int:
        """The address at which another process's memory named by ``handle`` is mapped into the
        primary context of GPU ``device`` (whichever GPU it lies on)."""
        address, lazy_peer_access = ctypes.c_uint64(), 1
        with self._context(device):
            self._check(self._call("cuIpcOpenMemHandle", ctypes.byref(address), _IpcHandle(handle),
                                   ctypes.c_uint(lazy_peer_access)), "cuIpcOpenMemHandle")
        return address.value

    def ipc_close(self, device: int, address: int) -> None:
        """Unmaps what ``ipc_open`` mapped."""
        with self._context(device):
            self._check(self._call("cuIpcCloseMemHandle", ctypes.c_uint64(address)), "cuIpcCloseMemHandle")

    def _call(self, name: str, *args) -> int:
        fn = getattr(self._lib, name + "_v2", None) or getattr(self._lib, name)
        return fn(*args)

    @contextlib.contextmanager
    def _context(self, device: int):
        """GPU ``device``'s primary context (torch's) current on this thread while inside."""
        context = ctypes.c_void_p()
        self._check(self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), ctypes.c_int(device)),
                    "cuDevicePrimaryCtxRetain")
        self._check(self._call("cuCtxPushCurrent", context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))
            self._call("cuDevicePrimaryCtxRelease", ctypes.c_int(device))

    @staticmethod
    def _check(status: int, name: str) -> None:
        if status != 0:
            raise RuntimeError(f"ringflex: {name} failed with CUDA driver error {status}")
