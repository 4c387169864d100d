"""Bounded caches: traces, plans and cuDNN graphs are kept by what they depend on, and the
oldest go beyond a limit (training on packed batches meets new masks at every step)."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Optional, Sequence


def remember(cache: OrderedDict, key, value, limit: int):
    """``value`` stored under ``key``, the oldest entries beyond ``limit`` dropped; returns ``value``."""
    cache[key] = value
    while len(cache) > limit:
        cache.popitem(last=False)
    return value


def tensor_versions(tensors) -> tuple:
    """``tensors`` by identity and version (which a write in place bumps): the part of a
    ``ByObjects`` key that names them."""
    return tuple((id(t), t._version) for t in tensors)


class ByObjects:
    """Values computed from objects (a mod, the tensors it captured) kept by a ``key`` that
    names them by ``id`` (and version), and given back only while those very objects live: a
    freed tensor's id goes to the next one made, so a new batch's document ids could meet the
    entry of the old ones (the ranks then planned other blocks from the same call)."""

    def __init__(self, size: int):
        self.size, self.entries = size, OrderedDict()

    def get(self, key, objects: Sequence[object], compute: Optional[Callable]):
        """The value of ``compute()`` for ``objects`` under ``key``; with ``compute`` None only a
        value computed before, else ``LookupError``."""
        entry = self.entries.get(key)
        if entry is not None and len(entry[0]) == len(objects) and all(r() is o for r, o in zip(entry[0], objects)):
            return entry[1]
        if compute is None:
            raise LookupError("not computed before")
        try:
            refs = [weakref.ref(o) for o in objects]
        except TypeError:  # cannot tell whether the object lives on: do not keep the value
            return compute()
        return remember(self.entries, key, (refs, compute()), self.size)[1]

    def clear(self) -> None:
        self.entries.clear()
