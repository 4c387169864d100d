"""Built cuDNN graphs: one per call shape, built on first use (a slow build) and kept (LRU)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ... import config
from ...cache import remember
from ...config import warn_once
from ...plan.layout import Segment
from . import frontend
from .batches import BACKWARD_INPUTS, FORWARD_INPUTS, ROW_AXIS, Ragged
from .lowering import Emitter, Inputs, Lowering

# Built graphs kept (LRU). Every distinct call shape needs its own: packed documents that
# cannot batch give one per document length, fwd and bwd, so a long packed sequence needs hundreds.
_GRAPHS: "OrderedDict[tuple, Graph]" = OrderedDict()


@dataclass
class Graph:
    """A built cuDNN graph and how to bind its tensors (by uid, in a fixed order)."""

    graph: object
    names: Tuple[str, ...]  # the attention tensors, first in the order
    inputs: Optional[Inputs]
    workspace: int
    uids: List[int]

    def execute(self, tensors: Dict[str, Tensor], q_seg: Optional[Segment], kv_seg: Optional[Segment],
                lowering: Optional[Lowering]) -> None:
        q = tensors["q"]
        buffers = [tensors[name] for name in self.names]
        if self.inputs is not None:
            buffers += self.inputs.buffers(q, q_seg, kv_seg, lowering)
        workspace = torch.empty(max(1, self.workspace), dtype=torch.uint8, device=q.device)
        self.graph.execute(buffers, workspace, handle=frontend.handle(q.device), tensor_uids=self.uids)


# The tensors whose layouts a graph bakes in; a ragged batch's int32 inputs follow from ``Ragged``.
_ATTENTION = frozenset(BACKWARD_INPUTS + ("dq", "dk", "dv"))
_DTYPES = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT"}


def _layout(t: Tensor, ragged: bool) -> tuple:
    """What a graph bakes in of ``t``. A ragged graph reads its rows through offsets and
    lengths (``batches.Ragged``): only heads, head_dim and the strides between them count."""
    if ragged:
        return t.shape[1], t.shape[3:], t.stride()[1:], t.dtype
    return t.shape, t.stride(), t.dtype


def _band_kwargs(band: Tuple[Optional[int], Optional[int]]) -> dict:
    left, right = band
    if left is None and right == 0:
        return dict(use_causal_mask=True)
    kwargs = dict(diagonal_alignment=frontend.cudnn().diagonal_alignment.TOP_LEFT)
    if right is not None:
        kwargs["diagonal_band_right_bound"] = right
    if left is not None:
        kwargs["diagonal_band_left_bound"] = left
    return kwargs


def graph(backward: bool, tensors: Dict[str, Tensor], scale: float, band, lowering: Optional[Lowering],
           strided: Dict[str, bool], ragged: Optional[Ragged] = None) -> Graph:
    """The built graph for this call's layouts and mods, from the cache when it was built before."""
    q = tensors["q"]
    deterministic = backward and torch.are_deterministic_algorithms_enabled()
    key = (backward, deterministic, q.device, scale, band, lowering and lowering.key,
           tuple(sorted(strided.items())) if lowering and lowering.indices else None, ragged,
           tuple((name, _layout(t, ragged is not None)) for name, t in sorted(tensors.items()) if name in _ATTENTION))
    found = _GRAPHS.get(key)  # the key is hashed at each lookup: once here, once to mark it recent
    if found is not None:
        _GRAPHS.move_to_end(key)
        return found
    if q.is_cuda and torch.cuda.is_current_stream_capturing():  # building would invalidate the capture
        raise RuntimeError("ringflex: a cuDNN graph for this call's shapes is not built yet, and building one cannot "
                           "be captured in a CUDA graph: run the call once eagerly before capturing")
    most = config.CUDNN_GRAPHS.value()
    if len(_GRAPHS) >= most:
        warn_once(f"ringflex: the cuDNN graph cache is full ({most} graphs): older graphs are dropped and "
                  "rebuilt when needed again (0.1 to 1.5 s each); raise RINGFLEX_CUDNN_GRAPHS if this "
                  "workload has that many call shapes")
    built = _build(backward, tensors, scale, band, lowering, strided, ragged, deterministic)
    return remember(_GRAPHS, key, built, most)


def _build(backward: bool, tensors: Dict[str, Tensor], scale: float, band, lowering: Optional[Lowering],
           strided: Dict[str, bool], ragged: Optional[Ragged], deterministic: bool = False) -> Graph:
    cudnn = frontend.cudnn()
    F = cudnn.data_type.FLOAT
    q = tensors["q"]
    g = cudnn.pygraph(io_data_type=getattr(cudnn.data_type, _DTYPES[q.dtype]), intermediate_data_type=F,
                      compute_data_type=F, handle=frontend.handle(q.device))
    io, offsets = {}, {}
    if ragged is not None:  # int32 inputs: each sequence's element offset per tensor, and its lengths
        scalars = dict(stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        offsets = {name: g.tensor(name=f"{name}_offsets", dim=[ragged.count + 1, 1, 1, 1], **scalars)
                   for name in tensors if name in ROW_AXIS}
        io.update({f"{name}_offsets": t for name, t in offsets.items()})
        io.update({name: g.tensor(name=name, dim=[ragged.count, 1, 1, 1], **scalars) for name in ("seq_q", "seq_kv")})

    def describe(name: str, t: Tensor) -> dict:
        if ragged is None:
            return dict(dim=list(t.shape), stride=list(t.stride()))
        n = ragged.max_q if ROW_AXIS[name] == "q" else ragged.max_kv
        return dict(dim=[ragged.count, t.shape[1], n, t.shape[3]], stride=[n * t.stride(2), *t.stride()[1:]])

    io.update({name: g.tensor(name=name, data_type=getattr(cudnn.data_type, _DTYPES[t.dtype]), **describe(name, t),
                              **({"ragged_offset": offsets[name]} if ragged is not None else {}))
               for name, t in tensors.items() if name in (BACKWARD_INPUTS if backward else FORWARD_INPUTS)})
    kwargs = dict(attn_scale=scale)
    if band is not None:
        kwargs.update(_band_kwargs(band))
    if ragged is not None:
        kwargs.update(use_padding_mask=True, seq_len_q=io["seq_q"], seq_len_kv=io["seq_kv"])
        if backward:  # bounds the workspace, which is sized for count x max lengths otherwise
            kwargs.update(max_total_seq_len_q=ragged.total_q, max_total_seq_len_kv=ragged.total_kv)
    inputs = emitter = None
    callbacks = []
    if lowering is not None:
        shapes = {"b": q.shape[0], "h": q.shape[1], "q_idx": q.shape[2], "kv_idx": tensors["k"].shape[2]}
        inputs = Inputs(g, lowering, shapes, strided, backward)
        emitter = Emitter(lowering, inputs)
        callbacks.append(_Callback(emitter.forward))
        kwargs["score_mod"] = callbacks[-1]
        if backward:
            callbacks.append(_Callback(emitter.backward))
            kwargs["score_mod_bprop"] = callbacks[-1]
    if deterministic:  # torch.use_deterministic_algorithms(True): dQ summed without atomics
        warn_once("ringflex: torch.use_deterministic_algorithms(True) is on, so cuDNN's attention backward runs "
                  "its deterministic algorithm (1.2x to 2.1x slower on an H100, docs/reliability.md)")
        kwargs["use_deterministic_algorithm"] = True
    if backward:
        outs = g.sdpa_backward(q=io["q"], k=io["k"], v=io["v"], o=io["out"], dO=io["dout"], stats=io["lse"],
                               name="sdpa_backward", **kwargs)
        names = ("dq", "dk", "dv")
    else:
        outs = g.sdpa(q=io["q"], k=io["k"], v=io["v"], generate_stats=True, name="sdpa", **kwargs)
        names = ("out", "lse")
    for name, t in zip(names, outs):
        ref, layout = tensors[name], describe(name, tensors[name])
        t.set_output(True).set_dim(layout["dim"]).set_stride(layout["stride"])
        t.set_data_type(getattr(cudnn.data_type, _DTYPES[ref.dtype]))
        if ragged is not None:
            t.set_ragged_offset(offsets[name])
        io[name] = t
    g.validate()
    g.build_operation_graph()
    # Mode A only. Every graph the kernel builds runs the first plan of mode A (every graph the
    # GPU tests build), and asking for the fallback list too, which declines most of them, left
    # the decline's exception in a frame its traceback holds (frontend 1.32): a reference cycle
    # that kept every caller's frame and locals alive until Python's collector ran, which could
    # be inside a CUDA-graph capture, where freeing a CUDAGraph invalidates the capture.
    g.create_execution_plans([cudnn.heur_mode.A])
    g.check_support()
    g.build_plans()
    order = [io[name] for name in io]
    for callback in callbacks:
        callback.release()
    if emitter is not None:
        emitter.release()
        inputs.freeze()
        order += inputs.order
    return Graph(g, tuple(io), inputs, g.get_workspace_size(), [t.get_uid() for t in order])


class _Callback:
    """A score_mod callback as handed to the frontend, which lets go of what it reaches once
    the graph is built. The frontend (1.32) wraps a callback in a closure over its lowering,
    whose closure holds the C++ graph, which holds the wrapper: a cycle through C++ that
    Python's collector cannot see, so every such graph would outlive the cache (and nanobind
    would report it leaked at exit). Emptying the callback and the lowering's closure (kept
    from the graph wrapper the frontend passes in) breaks the cycle."""

    def __init__(self, fn):
        self.fn, self.lowerings = fn, []

    def __call__(self, graph, tensor):
        lowering = getattr(graph, "_lower", None)  # the frontend's wrapper around the C++ graph
        if lowering is not None:
            self.lowerings.append(lowering)
        return self.fn(graph, tensor)

    def release(self) -> None:
        for lowering in self.lowerings:
            for cell in getattr(lowering, "__closure__", None) or ():
                cell.cell_contents = None
        self.fn, self.lowerings = None, []
