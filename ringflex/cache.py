"""Bounded caches: traces, plans and cuDNN graphs are kept by what they depend on, and the
oldest go beyond a limit (training on packed batches meets new masks at every step)."""
from __future__ import annotations

from collections import OrderedDict


def remember(cache: OrderedDict, key, value, limit: int):
    """``value`` stored under ``key``, the oldest entries beyond ``limit`` dropped; returns ``value``."""
    cache[key] = value
    while len(cache) > limit:
        cache.popitem(last=False)
    return value
