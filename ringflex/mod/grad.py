"""The derivative of a score_mod with respect to the score, as a graph: a kernel's backward
evaluates it per score element (``score_grad``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .graph import SCORE_INPUTS, ModGraph, Node, UnsupportedModError, topological, const, leaf, op


def _zero() -> Node:
    return const(0.0, torch.float32)


def _add(x: Optional[Node], y: Optional[Node]) -> Optional[Node]:
    return y if x is None else x if y is None else op("add", x, y)


def _mul(g: Node, x: Node) -> Node:
    if x.op == "const" and x.value == 1:
        return g
    return op("mul", g, x)


def _vjp(n: Node, g: Node) -> List[Optional[Node]]:
    """Gradients of ``n``'s arguments given the gradient ``g`` of ``n``."""
    a = n.args
    if n.op == "add":
        return [g, g]
    if n.op == "sub":
        return [g, op("neg", g)]
    if n.op == "mul":
        return [_mul(g, a[1]), _mul(g, a[0])]
    if n.op == "div":
        return [op("div", g, a[1]), op("neg", op("div", op("mul", g, n), a[1]))]
    if n.op == "neg":
        return [op("neg", g)]
    if n.op == "exp":
        return [op("mul", g, n)]
    if n.op == "log":
        return [op("div", g, a[0])]
    if n.op == "sqrt":
        return [op("div", g, op("mul", const(2.0), n))]
    if n.op == "tanh":
        return [op("tanh_backward", g, a[0])]
    if n.op == "sigmoid":
        return [op("sigmoid_backward", g, a[0])]
    if n.op == "abs":
        zero = _zero()
        return [op("where", op("gt", a[0], zero), g, op("where", op("lt", a[0], zero), op("neg", g), zero))]
    if n.op == "pow":
        if a[1].deps:
            raise UnsupportedModError("x ** y is differentiable w.r.t. the score only for a constant exponent y")
        return [op("mul", g, op("mul", a[1], op("pow", a[0], op("sub", a[1], const(1)))))]
    if n.op in ("minimum", "maximum"):
        win = op("lt" if n.op == "minimum" else "gt", a[0], a[1])
        lose = op("lt" if n.op == "minimum" else "gt", a[1], a[0])
        zero = _zero()
        if n.value == "clamp":  # x = a[0] takes the gradient unless it lies beyond the bound
            return [op("where", lose, zero, g), op("where", lose, g, zero)]
        half = op("mul", g, const(0.5))
        # torch splits the gradient evenly between equal operands.
        return [op("where", win, g, op("where", lose, zero, half)),
                op("where", lose, g, op("where", win, zero, half))]
    if n.op == "where":
        zero = _zero()
        return [None, op("where", a[0], g, zero), op("where", a[0], zero, g)]
    if n.op == "mod":
        return [g, op("neg", op("mul", g, op("floordiv", a[0], a[1])))]
    if n.op == "cast":
        return [g if n.dtype.is_floating_point and a[0].dtype.is_floating_point else None]
    return [None] * len(a)  # comparisons, logic, floor, floordiv, lookups: zero gradient


def score_grad(graph: ModGraph) -> ModGraph:
    """The graph of ``grad * d score_mod / d score`` with inputs (grad, score, b, h, q_idx, kv_idx).

    Built backwards from the output, so a kernel's backward can reuse the forward's
    intermediate values (e.g. the pre-tanh score of a softcap).
    """
    if graph.kind != "score_mod":
        raise ValueError(f"score_grad needs a score_mod graph, got a {graph.kind} graph")
    grad = leaf("grad", torch.float32)
    grads: Dict[int, Node] = {id(graph.output): grad}
    for n in reversed(graph.nodes):
        g = grads.get(id(n))
        if g is None or not n.args:
            continue
        for x, gx in zip(n.args, _vjp(n, g)):
            if gx is not None and "score" in x.deps and x.dtype.is_floating_point:
                grads[id(x)] = _add(grads.get(id(x)), gx)
    score = next((n for n in graph.nodes if n.op == "score"), None)
    result = grads.get(id(score)) if score is not None else None
    if result is None:
        result = op("mul", grad, _zero())
    return ModGraph("score_grad", ("grad",) + SCORE_INPUTS, topological(result))

