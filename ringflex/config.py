"""Every ``RINGFLEX_*`` setting, in one place: its default, what it takes, what it means;
and ``warn_once``, how ringflex tells of a choice it made for the user.

Settings are read when they are used, so a test or a notebook may change one between calls.
A value that does not parse raises ``ValueError`` naming the variable and what it takes;
``ring_flex_attention``'s argument check reports it on every rank before any transfer
(``errors``), so a typo on one rank refuses the call everywhere instead of hanging the others.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, List, Tuple


def _choice(*choices: str) -> Tuple[Callable[[str], str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError
        return text
    return parse, "one of " + ", ".join(choices)


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise ValueError
    return value


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    parse: Callable[[str], object]
    takes: str
    meaning: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)

    def value(self):
        text = self.raw()
        try:
            return self.parse(text)
        except (ValueError, TypeError):
            raise ValueError(f"{self.name}={text!r}: expected {self.takes}") from None


DEBUG = Setting("RINGFLEX_DEBUG", "0", *_choice("0", "1"),
                "1: per-transfer checks, inputs and outputs compared across ranks, plans re-derived (slow)")
TRANSPORT = Setting("RINGFLEX_TRANSPORT", "auto", *_choice("auto", "copy-engine", "nccl"),
                    "what carries the ring's transfers between GPUs: the copy engines of one host, or NCCL")
LENDING = Setting("RINGFLEX_LENDING", "auto", *_choice("auto", "1", "0"),
                  "auto: a rank lends rows of its busiest hop where the kernels hide the host work; 1: at any "
                  "size (CUDA-graph replays); 0: never")
MIN_TILE = Setting("RINGFLEX_MIN_TILE", "1024", _count, "a whole number of rows >= 1",
                   "the smallest tile of rows the planner decides a block's kinds on")
STRAGGLER_S = Setting("RINGFLEX_STRAGGLER_S", "60", _seconds, "a number of seconds >= 0",
                      "how long a rank waits for the others before it says which ones it waits for")
AGREEMENT = Setting("RINGFLEX_AGREEMENT", "auto", *_choice("auto", "gloo"),
                    "how the ranks exchange each call's argument check: auto: through shared memory where every "
                    "rank of the group runs on one host, else gloo; gloo: always gloo (read when a group is first used)")
CUDNN_GRAPHS = Setting("RINGFLEX_CUDNN_GRAPHS", "2048", _count, "a whole number of graphs >= 1",
                       "how many cuDNN graphs are kept built (the oldest are dropped)")

SETTINGS = (DEBUG, TRANSPORT, LENDING, MIN_TILE, STRAGGLER_S, AGREEMENT, CUDNN_GRAPHS)


def errors() -> List[str]:
    """What is wrong with the settings of this process, one message per bad value."""
    wrong = []
    for setting in SETTINGS:
        try:
            setting.value()
        except ValueError as e:
            wrong.append(str(e))
    return wrong


def debugging() -> bool:
    """``RINGFLEX_DEBUG``, where a bad value reads as off: the argument check refuses the call
    with the value's error on every rank, which the debug mode must not run before."""
    try:
        return DEBUG.value() == "1"
    except ValueError:
        return False


def describe() -> List[str]:
    """Each setting, its value here and its meaning (``python -m ringflex.env``)."""
    return [f"{s.name}={s.raw()} ({s.meaning})" for s in SETTINGS]


_WARNED = set()


def warn_once(message: str) -> None:
    """Warns of ``message`` once per process: a choice ringflex made (a slower kernel, a
    transport) repeats at every call, and its warning would drown the log. The warning names
    the caller's line (``_caller_level``)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=_caller_level())


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel, from ``warn_once``, of the first frame outside ringflex,
    torch and contextlib: ringflex's entry points run inside decorators of torch and contextlib
    (``torch.compiler.disable``, ``captured.one_walk``), whose frames say nothing to a user."""
    inside = (os.path.dirname(os.path.abspath(__file__)), os.path.abspath(contextlib.__file__))
    torch = sys.modules.get("torch")
    if torch is not None:
        inside += (os.path.dirname(os.path.abspath(torch.__file__)),)
    frame, level = sys._getframe(2), 2  # warn_once's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
