"""The CUDA driver calls the copy-engine transport (``peer``) makes on its streams, through
ctypes: write and await a 32-bit flag (stream memory operations, which torch does not
expose), and copy between addresses, contiguous or as rows (a 2-D copy)."""
from __future__ import annotations

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

    @staticmethod
    def _check(status: int, name: str) -> None:
        if status != 0:
            raise RuntimeError(f"ringflex: {name} failed with CUDA driver error {status}")
