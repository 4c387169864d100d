"""What a mod computes with besides its arguments: its code and the values it captured.

One walk serves every use: fingerprints that ranks compare (``validate``), the tensors a
cached plan depends on (``plan``), and whether a new closure is the same mod as one traced
before with other tensors (``trace``), as ``mods.document(ids)`` is at every training step.
"""
from __future__ import annotations

import functools
import types
from typing import List

from torch import Tensor

PLAIN = (type(None), bool, int, float, complex, str, bytes)
_MAX_DEPTH = 8


def parts(fn) -> List[object]:
    """The parts of ``fn`` in a fixed order: code objects; the values in its closure cells,
    default arguments and ``functools.partial`` arguments, and the module globals its code
    reads (values, containers, tensors and functions: not modules or classes, a marker tuple
    naming each first), followed into the functions, tuples, lists and dicts among them (a
    container or a depth past 8 adds a marker tuple first); tensors and any other object as
    they are, for the caller to judge. A global the caller reassigns between calls (document
    ids of a new batch) is a new part, as a new closure's tensor is."""
    found: List[object] = []
    _walk(fn, found, 0)
    return found


def _walk(value, found: List[object], depth: int) -> None:
    if depth > _MAX_DEPTH:
        found.append(("too deep",))
    elif isinstance(value, PLAIN + (Tensor,)):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        found.append((type(value).__name__, len(value)))
        for item in value:
            _walk(item, found, depth + 1)
    elif isinstance(value, dict):
        found.append(("dict", len(value)))
        for key, item in value.items():
            _walk(key, found, depth + 1)
            _walk(item, found, depth + 1)
    elif isinstance(value, types.CodeType):
        found.append(value)
        for const in value.co_consts:
            if isinstance(const, types.CodeType):  # a function defined inside
                _walk(const, found, depth + 1)
    elif isinstance(value, types.FunctionType):
        _walk(value.__code__, found, depth + 1)
        for name, read in _globals_read(value):
            found.append(("global", name))
            _walk(read, found, depth + 1)
        for cell in value.__closure__ or ():
            try:
                _walk(cell.cell_contents, found, depth + 1)
            except ValueError:  # an empty cell
                found.append(("empty cell",))
        _walk(value.__defaults__, found, depth + 1)
        _walk(value.__kwdefaults__, found, depth + 1)
    elif isinstance(value, types.MethodType):
        _walk(value.__func__, found, depth + 1)
        found.append(value.__self__)
    elif isinstance(value, functools.partial):
        _walk((value.func, value.args, value.keywords), found, depth + 1)
    else:
        found.append(value)


_VALUES = PLAIN + (Tensor, tuple, list, dict, types.FunctionType, functools.partial)
_ABSENT = object()


def _globals_read(fn: types.FunctionType):
    """(name, value) of the module globals that ``fn``'s code (and the code defined inside it)
    names, where the value is one ``parts`` follows: modules, classes and other objects are
    where attributes are looked up, not values a mod computes with."""
    codes, names = [fn.__code__], []
    while codes:
        code = codes.pop()
        names += [n for n in code.co_names if n not in names]
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    for name in names:
        value = fn.__globals__.get(name, _ABSENT)
        if value is not _ABSENT and isinstance(value, _VALUES):
            yield name, value
