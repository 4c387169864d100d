"""Reads of captured tensors: which index a mod's lookup (``table[subscript]``) takes, and
the refusal of one that reads outside its tensor, found before any kernel evaluates it.
"""
from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

from torch import Tensor

from .graph import MASK_INPUTS, ModGraph, topological, evaluate


def subscripts(graph: ModGraph) -> Iterator[Tuple[Tuple[int, ...], int, ModGraph]]:
    """Every subscript of a lookup into a captured tensor: (the tensor's shape, the size of the
    dimension it indexes, the subscript's graph)."""
    for n in graph.nodes:
        if n.op == "index":
            shape = tuple(n.args[0].value.shape)
            for size, subscript in zip(shape, n.args[1:]):
                yield shape, size, ModGraph(graph.kind, graph.inputs, topological(subscript))


def subscripts_read_tensors(graph: ModGraph) -> bool:
    """Whether a lookup's subscript itself reads a captured tensor (``t[ids[q_idx]]``): then
    whether the lookups stay in bounds depends on tensor values, not only on their shapes."""
    return any(n.op == "tensor" for _, _, subscript in subscripts(graph) for n in subscript.nodes)


def read_outside(subscript: ModGraph, size: int, values: Dict[str, Tensor]) -> Optional[Tuple[int, Dict[str, int]]]:
    """The first index outside a dimension of ``size`` that ``subscript`` takes at any
    combination of the ``values`` (1-D, by input name) of the inputs it reads, and those
    inputs' values there; None where it takes none. Negative indices count from the end, as
    torch reads them."""
    grid = {name: values[name].view([-1 if other == name else 1 for other in MASK_INPUTS]) for name in subscript.deps}
    at = evaluate(subscript.output, grid).long()
    bad = ((at >= size) | (at < -size)).nonzero()
    if not len(bad):
        return None
    first = bad[0].tolist()
    return int(at[tuple(first)]), {name: int(values[name][first[MASK_INPUTS.index(name)]])
                                    for name in MASK_INPUTS if name in subscript.deps}


def lookup_message(kind: str, shape: Tuple[int, ...], index: int, at: Dict[str, int]) -> str:
    """The refusal of a ``kind`` that reads ``index`` of a captured tensor of ``shape`` at the inputs ``at``."""
    where = f" (at {', '.join(f'{name} = {value}' for name, value in at.items())})" if at else ""
    positions = at.keys() & {"q_idx", "kv_idx"}
    if len(positions) == 2:
        why = ("a tensor a mod indexes by q_idx and kv_idx together must cover every pair of the global sequence's "
               "positions (for q_idx - kv_idx, every distance), not one rank's shard")
    elif positions:
        why = "a tensor a mod indexes by position must cover every position of the global sequence, not one rank's shard"
    else:
        why = "it must have an entry for every batch element and head of the call"
    return f"{kind} reads index {index} of a captured tensor of shape {shape}{where}: {why}"


def lookup_error(graph: ModGraph, values: Dict[str, Tensor]) -> Optional[str]:
    """What ``graph`` reads outside a captured tensor, or None. Every lookup whose subscript
    depends on one input at most is evaluated at all of that input's ``values`` (the positions,
    batches and heads of a call): on a GPU such a read would end the process's CUDA context
    with a device-side assert. Subscripts of several inputs take too many values to evaluate
    at each: ``bounds.ranged_lookup_error`` checks them on ranges."""
    for shape, size, subscript in subscripts(graph):
        if len(subscript.deps) <= 1 and subscript.deps <= values.keys():
            found = read_outside(subscript, size, values)
            if found:
                return lookup_message(graph.kind, shape, *found)
    return None

