"""Hashes that every process computes alike: of bytes (``digest``), and of what a mod
computes (``fingerprint``). The ranks compare mods by them in the agreement, and caches of
plans key on them (never on addresses, which differ from process to process).
"""
from __future__ import annotations

import hashlib
import types
from typing import List, Optional

import torch

from . import captured


def digest(data: bytes) -> int:
    """A 63-bit hash of ``data``, the same in every process: a record field that stands for
    something longer (a mod, a list of shapes, a dtype)."""
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "little") >> 1


def fingerprint(fn, contents: bool = False, parts: Optional[List[object]] = None) -> int:
    """A 63-bit hash of what a mod computes: its code, constants and captured values
    (``parts``: its ``captured.parts``, where the caller walked them already).

    Captured tensors count by shape and dtype, and by their values only with ``contents``
    (a device-to-host copy, so only debug mode asks for it).
    """
    if fn is None:
        return 0
    if contents:
        return _fingerprint(fn, True, parts)
    return captured.kept(fn, "fingerprint", lambda: _fingerprint(fn, False, parts))


def _fingerprint(fn, contents: bool, parts: Optional[List[object]]) -> int:
    data = []
    for part in captured.parts(fn) if parts is None else parts:  # by content, never by address: every process agrees
        if isinstance(part, torch.Tensor):
            data.append(repr((tuple(part.shape), part.dtype)).encode())
            if contents:
                data.append(part.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(part, types.CodeType):  # the functions defined inside it are parts of their own
            consts = [c if isinstance(c, captured.PLAIN) else type(c).__qualname__ for c in part.co_consts]
            data.append(part.co_code + repr((part.co_names, consts)).encode())
        elif isinstance(part, captured.PLAIN + (tuple,)):  # values and the walk's markers
            data.append(repr(part).encode())
        else:
            data.append(type(part).__qualname__.encode())
    return digest(b"".join(data))
