"""What a mod computes with besides its arguments: its code and the values it captured.

One walk serves every use: fingerprints that ranks compare (``validate``), the tensors a
cached plan depends on (``plan``), and whether a new closure is the same mod as one traced
before with other tensors (``trace``), as ``mods.document(ids)`` is at every training step.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import threading
import types
from typing import Callable, List, Optional

from torch import Tensor
from torch.nn import Module

# values by value (numbers.Number: numpy's scalars too, a captured np.int64 window)
PLAIN = (type(None), bool, int, float, complex, str, bytes, numbers.Number)
_MAX_DEPTH = 8


def device_of(fn, found: Optional[List[object]] = None):
    """The device of the first tensor ``fn`` captured (document ids on a GPU), or None
    (``found``: its ``parts``, where the caller walked them already)."""
    return next((p.device for p in (parts(fn) if found is None else found) if isinstance(p, Tensor)), None)


_CALL = threading.local()  # ``one_walk``'s walks, per thread (autograd may run backward on another)


@contextlib.contextmanager
def one_walk():
    """Within it each mod is walked once: one ring call's checks, plans, traces and kernels
    all read its ``parts`` (a dozen walks of the same mod otherwise), and nothing the mod
    reads changes within a call. Backward opens its own: its first walk of a mod is the one
    it compares with forward's (``snapshot``). Within an outer one it adds nothing."""
    if getattr(_CALL, "walked", None) is not None:
        yield
        return
    _CALL.walked = {}
    try:
        yield
    finally:
        _CALL.walked = None


def parts(fn) -> List[object]:
    """The parts of ``fn`` in a fixed order: code objects; the values in its closure cells,
    default arguments and ``functools.partial`` arguments, and the module globals its code
    reads (not modules or classes, a marker tuple naming each first), followed into the
    functions, tuples, lists and dicts among them (a container or a depth past 8 adds a marker
    tuple first), and into objects: a callable object's ``__call__`` (an ``nn.Module``'s ``forward``), and the attributes
    stored on an object that the code reading it names (``cfg.window``, ``self.doc_ids``: a
    marker tuple naming the class, then each attribute's name and value); tensors and any
    other object as they are, for the caller to judge. A global the caller reassigns between
    calls (document ids of a new batch), or an attribute it sets, is a new part, as a new
    closure's tensor is."""
    return kept(fn, "parts", lambda: _walked(fn))


def kept(fn, what: str, compute: Callable[[], object]):
    """``compute()``, what ``fn`` gives as ``what``: once per ``one_walk`` (every time outside one)."""
    walked = getattr(_CALL, "walked", None)
    if walked is None:
        return compute()
    key = what, id(fn)
    if key not in walked:
        walked[key] = fn, compute()  # holding ``fn``: its id names no other object meanwhile
    return walked[key][1]


def _walked(fn) -> List[object]:
    found: List[object] = []
    _walk(fn, found, 0, frozenset())
    return found


def snapshot(fn) -> tuple:
    """What ``fn`` computes with, as it is now (``state`` of its ``parts``)."""
    return state(parts(fn))


def state(found: List[object]) -> tuple:
    """``parts`` as they are now: tensors by identity and version (which a write in place
    bumps), other objects by identity. Two states differ where something the mod reads changed
    in between (writes torch does not count, through ``.data``, excepted)."""
    return tuple((id(p), p._version) if isinstance(p, Tensor) else p if isinstance(p, PLAIN + (tuple, types.CodeType))
                 else id(p) for p in found)


def _walk(value, found: List[object], depth: int, names: frozenset) -> None:
    """``names``: the attribute names that the code reaching ``value`` reads."""
    if depth > _MAX_DEPTH:
        found.append(("too deep",))
    elif isinstance(value, PLAIN + (Tensor,)):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        found.append((type(value).__name__, len(value)))
        for item in value:
            _walk(item, found, depth + 1, names)
    elif isinstance(value, dict):
        found.append(("dict", len(value)))
        for key, item in value.items():
            _walk(key, found, depth + 1, names)
            _walk(item, found, depth + 1, names)
    elif isinstance(value, types.CodeType):
        found.append(value)
        for const in value.co_consts:
            if isinstance(const, types.CodeType):  # a function defined inside
                _walk(const, found, depth + 1, names)
    elif isinstance(value, types.FunctionType):
        names = names | _names_read(value.__code__)
        _walk(value.__code__, found, depth + 1, names)
        for name, read in _globals_read(value):
            found.append(("global", name))
            _walk(read, found, depth + 1, names)
        for cell in value.__closure__ or ():
            try:
                _walk(cell.cell_contents, found, depth + 1, names)
            except ValueError:  # an empty cell
                found.append(("empty cell",))
        _walk(value.__defaults__, found, depth + 1, names)
        _walk(value.__kwdefaults__, found, depth + 1, names)
    elif isinstance(value, types.MethodType):
        _walk(value.__func__, found, depth + 1, names)
        _walk(value.__self__, found, depth + 1, names | _names_read(value.__func__.__code__))
    elif isinstance(value, functools.partial):
        _walk((value.func, value.args, value.keywords), found, depth + 1, names)
    elif _followed(value):
        # a callable object: its code, and what it reads (an nn.Module's call runs its forward)
        call = getattr(type(value), "forward" if isinstance(value, Module) else "__call__", None)
        if isinstance(call, types.FunctionType):
            _walk(call, found, depth + 1, names)
            names = names | _names_read(call.__code__)
        found.append(("object", type(value).__qualname__))
        for name, attribute in _attributes(value, names):
            found.append(("attribute", name))
            _walk(attribute, found, depth + 1, names)
    else:
        found.append(value)


def _followed(value) -> bool:
    """Whether ``value`` is an object whose attributes a mod may read as values: an instance
    of a Python class (not a module, class or function, whose attributes are code)."""
    return hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType))


def _attributes(value, names: frozenset):
    """(name, value) of the attributes stored on ``value`` (its ``__dict__``, and an
    ``nn.Module``'s parameters, buffers and submodules) whose names are in ``names``, by name."""
    stores = [vars(value)] + [vars(value).get(k) or {} for k in ("_parameters", "_buffers", "_modules")]
    for name in sorted(names):
        for store in stores:
            if isinstance(store, dict) and name in store:
                yield name, store[name]
                break


@functools.lru_cache(maxsize=1024)  # every ring call walks its mods: read each code object once
def _names_read(code: types.CodeType) -> frozenset:
    """The names ``code`` (and the code defined inside it) reads: globals and attributes."""
    codes, names = [code], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return frozenset(names)


_ABSENT = object()


def _globals_read(fn: types.FunctionType):
    """(name, value) of the module globals that ``fn``'s code (and the code defined inside it)
    names, by name; not modules and classes, which hold code, nor built-in functions."""
    for name in sorted(_names_read(fn.__code__)):
        value = fn.__globals__.get(name, _ABSENT)
        if value is not _ABSENT and not isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)):
            yield name, value
