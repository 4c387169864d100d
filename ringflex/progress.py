"""One-line progress reports for long runs (training, benchmarks), printed by one rank only."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

import torch.distributed as dist


def _format(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
    """``update(step, **fields)`` prints ``label step/total  elapsed  eta  field=value ...``
    at most every ``interval`` seconds, and always for the first and last step.

    Prints on global rank 0 only (pass ``enabled`` to choose), to stderr by default, flushed,
    so logs of torchrun jobs show where a run is.
    """

    def __init__(self, total: int, label: str = "", interval: float = 10.0, file: Optional[TextIO] = None,
                 enabled: Optional[bool] = None):
        if total < 1:
            raise ValueError(f"total must be a positive number of steps, got {total}")
        self.total, self.label, self.interval = total, label, interval
        self.file = file if file is not None else sys.stderr
        if enabled is None:
            enabled = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.enabled = enabled
        self.start = time.monotonic()
        self._last = -float("inf")

    def update(self, step: int, **fields) -> None:
        """Reports that ``step`` (1-based) of ``total`` is done."""
        now = time.monotonic()
        if not self.enabled or (now - self._last < self.interval and step not in (1, self.total)):
            return
        self._last = now
        elapsed = now - self.start
        eta = elapsed / step * (self.total - step)
        parts = [f"{self.label} {step}/{self.total}".strip(), f"{elapsed:.0f}s", f"eta {eta:.0f}s"]
        parts += [f"{key}={_format(value)}" for key, value in fields.items()]
        print("  ".join(parts), file=self.file, flush=True)
