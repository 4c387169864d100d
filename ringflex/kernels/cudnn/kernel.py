"""``CudnnKernel``: a hop as cuDNN calls. The block is planned (``blocks``), its calls batched
where they can be (``batches``), each run by a built graph (``graphs``) with the mods lowered
into it (``lowering``); partial results of one block merge by log-sum-exp."""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...cache import ByObjects
from ...plan.blocks import BlockKind, Hop, around
from ...plan.extents import mask_key
from ...plan.layout import Segment
from .. import huge
from ..base import Extent, Mods
from ..merge import RowMerge, RowSum, rows
from ..reference import ReferenceKernel
from . import batches, blocks, frontend, graphs
from .lowering import Program, lowered, lowering_error, packed_strides, traced

# The joined calls of ring steps' hops (``CudnnKernel._joined``), by the hops and what planning them reads.
_JOINED = ByObjects(frontend.MAX_PLANS)
# A masked block with a score_mod runs as 2**SPLIT_DEPTH row chunks (measured best: docs/cudnn.md).
SPLIT_DEPTH = 2
_MIN_CUDNN = 90600  # score_mod arrived in cuDNN 9.6


def _sub(seg: Optional[Segment], r: Tuple[int, int]) -> Optional[Segment]:
    return None if seg is None else seg.slice(*r)


# A call's cost beyond its pairs, in pairs x batch x heads x head dim: a call takes as long as
# 1.3 million pairs at B=1, H=32, D=128 (a fit of a call's fixed cost against its work per
# pair). Lending weighs the ranks' work with it, so many small calls count for what they cost.
_CALL_WORK = 1_300_000 * 32 * 128


class CudnnKernel:
    """HopKernel on cuDNN's fused SDPA (see ``ringflex.kernels.cudnn``)."""

    name = "cudnn"

    def __init__(self, split_depth: int = SPLIT_DEPTH):
        self.split_depth = split_depth

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # cuDNN writes dk/dv in the input dtype; calls of one hop that share key rows are
        # summed in fp32 and rounded once into it
        return dtype

    def call_pairs(self, batch: int, heads: int, head_dim: int) -> int:
        return _CALL_WORK // max(1, batch * heads * head_dim)

    def plans_within(self, mask_mod, has_score_mod: bool, q_seg: Segment, kv_seg: Segment,
                     device) -> Optional[Extent]:
        # Native band calls (see ``blocks.plan``) skip the tiles outside the band, so a band
        # costs per visible pair what causal does; the exact plan's calls are unmasked or
        # native bands over visible keys only.
        if has_score_mod or mask_mod is None:
            return None
        masked = Mods(None, mask_mod)
        mask = traced(masked, True, device).mask
        band = blocks.native_band(mask)
        if band is not None:
            runs = blocks.band_runs(band, q_seg, kv_seg)
        else:
            runs = blocks.exact_runs(masked, mask, q_seg, kv_seg, device)
        if not runs:
            return None
        return around(r.rows for r in runs), around(r.cols for r in runs)

    def _call(self, backward: bool, run: blocks.Run, program: Program, tensors: Dict[str, Tensor], scale: float,
              q_seg, kv_seg) -> None:
        mask = program.mask if run.masked else None
        lowering = None
        q_seg, kv_seg = _sub(q_seg, run.rows), _sub(kv_seg, run.cols)
        if program.score is not None or mask is not None:
            if q_seg is None or kv_seg is None:
                raise ValueError("a score_mod needs the block's q_seg and kv_seg")
            lowering = lowered(program.score, mask, backward)
        strided = {"q_idx": q_seg is not None and q_seg.stride != 1, "kv_idx": kv_seg is not None and kv_seg.stride != 1}
        graphs.graph(backward, tensors, scale, run.band, lowering, strided).execute(tensors, q_seg, kv_seg, lowering)

    def forward(self, q, k, v, q_seg: Optional[Segment], kv_seg: Optional[Segment], mods: Mods, scale: float,
                masked: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        program = traced(mods, masked, q.device)
        # cuDNN's stats hold the LSE as one float: rows whose scores are all huge go to the reference kernel
        return huge.exact_forward(self.name, huge.holds_huge(program.score),
                                  *self._forward(program, q, k, v, q_seg, kv_seg, mods, scale), q, k, v, q_seg, kv_seg,
                                  mods, scale, masked)

    def _forward(self, program: Program, q, k, v, q_seg: Optional[Segment], kv_seg: Optional[Segment], mods: Mods,
                 scale: float) -> Tuple[Tensor, Tensor]:
        q, k, v = (_inner_contiguous(t) for t in (q, k, v))
        calls = self._calls(program, blocks.plan(program, mods, q, k, q_seg, kv_seg, self.split_depth), q, k, v)
        if len(calls) == 1:  # its results are the block's (a block's documents as one batch, too): no merge
            return self._forward_one(calls[0], program, q, k, v, scale, q_seg, kv_seg)
        shape, empty = (*q.shape[:3], v.shape[-1]), batches.empty_for(calls, batches.query_rows(q))
        merged = RowMerge(shape, q.dtype, torch.float32, q.device, [span for c in calls for span in c.row_spans], empty)
        for call in calls:
            if isinstance(call, batches.Group):
                self._forward_group(call, q, k, v, merged, scale)
                continue
            # The result's own rows where no call wrote yet; else computed aside, then merged.
            n = call.rows[1] - call.rows[0]
            o, lse = merged.destination(call.rows) or (q.new_empty(*shape[:2], n, shape[3]),
                                                       q.new_empty(*shape[:2], n, dtype=torch.float32))
            self._forward_call(call, program, q, k, v, o, lse, scale, q_seg, kv_seg)
            merged.add(call.rows, o, lse)
        return merged.result()[:2]

    def _forward_one(self, call, program: Program, q, k, v, scale: float, q_seg, kv_seg,
                     hops: Optional[Sequence[Hop]] = None) -> Tuple[Tensor, Tensor]:
        """The block's (out, lse) from its one call (a run, or a batch of them); of several
        ``hops`` joined in it, their rows alone (``forward_hops``: rows in no hop are unread)."""
        empty = batches.empty_for((call,), batches.query_rows(q))
        out = empty((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = empty(q.shape[:3], dtype=torch.float32, device=q.device)
        if isinstance(call, batches.Group):
            self._group_call(False, call, dict(q=q, k=k, v=v, out=out, lse=lse.unsqueeze(-1)), scale)
        else:
            self._forward_call(call, program, q, k, v, rows(out, call.rows), rows(lse, call.rows), scale, q_seg, kv_seg)
        within = None if hops is None else [h.q_rows for h in hops]
        for r in _outside(call.row_spans, q.shape[2], within):  # rows that see no key
            rows(out, r).zero_()
            rows(lse, r).fill_(-math.inf)
        return out, lse

    def forward_hops(self, q, k, v, hops: Sequence[Hop], mods: Mods, scale: float):
        batch = self._joined(hops, mods, q, k, v)
        if batch is None:
            return None
        out, lse = self._forward_one(batch, None, *(_inner_contiguous(t) for t in (q, k, v)), scale, None, None, hops)
        return out, lse, None

    def backward_hops(self, q, k, v, out, lse, dout, hops: Sequence[Hop], mods: Mods, scale: float, res=None):
        if res is not None:  # rows whose scores are all huge, for the reference kernel
            return None
        batch = self._joined(hops, mods, q, k, v, out, dout)
        if batch is None:
            return None
        q, k, v, out, dout = (_inner_contiguous(t) for t in (q, k, v, out, dout))
        stats = lse.float().unsqueeze(-1)  # a batch's runs are unmasked or causal: every row sees a key
        return self._backward_one(batch, None, mods, q, k, v, out, lse, stats, dout, scale, None, None, hops)

    def _joined(self, hops: Sequence[Hop], mods: Mods, q, k, v, out=None, dout=None) -> Optional[batches.Group]:
        """The hops' runs as one call (``batches.Group``), or None where they do not make one (a
        score_mod, runs that cannot be one call over these tensors). Kept by what planning them
        reads (``_JOINED``): a training step's ring calls join the same hops at every step."""
        if mods.score_mod is not None or not batches.grouped_applies(q, k, v, out, dout):
            return None
        ragged = batches.ragged_applies(q, k, v, out, dout)
        mask = traced(mods, True, q.device).mask
        key = (tuple(hops), self.split_depth, ragged, *q.shape[:2], str(q.device))
        key, objects = (key, ()) if mask is None else (mask_key(mask, *key), mask.tensors())
        return _JOINED.get(key, objects, lambda: self._join(hops, mods, q, k, ragged))

    def _join(self, hops: Sequence[Hop], mods: Mods, q, k, ragged: bool) -> Optional[batches.Group]:
        runs, exact = [], False
        for hop in hops:
            program = traced(mods, hop.kind != BlockKind.FULL, q.device)
            exact = exact or _exact(program)
            planned = blocks.plan(program, mods, rows(q, hop.q_rows), rows(k, hop.kv_rows), hop.q_seg, hop.kv_seg,
                                  self.split_depth)
            runs += [blocks.shifted(run, hop.q_rows[0], hop.kv_rows[0]) for run in planned]
        calls = batches.batched(tuple(runs), exact, ragged)
        return calls[0] if len(calls) == 1 and isinstance(calls[0], batches.Group) else None

    @staticmethod
    def _calls(program: Program, runs: Sequence[blocks.Run], *tensors: Tensor) -> Tuple[object, ...]:
        """The block's runs as cuDNN calls: grouped where they can be (``batches.batched``). The
        exact plan's runs (masks that are no band: packed documents) batch even alone: their
        shapes follow the documents, and a graph of exact shapes would be built for every new
        length (a slow build each), where ragged graphs are built for a few sizes (``batches.Ragged``).
        So does a run over the whole block where the block's shape follows the documents (the
        ring cuts a hop to a document that straddles two ranks); where it recurs (``batches.recurring``)
        the run stays a plain call, which costs less: a ragged graph reads its offsets (docs/cudnn.md)."""
        q, k = tensors[:2]
        exact = _exact(program)
        whole = len(runs) == 1 and (runs[0].rows, runs[0].cols) == ((0, q.shape[2]), (0, k.shape[2]))
        recurring = whole and batches.recurring(q) and batches.recurring(k)
        if (program.score is not None or (len(runs) < 2 and not exact) or recurring
                or not batches.grouped_applies(*tensors)):
            return tuple(runs)
        return batches.batched(tuple(runs), exact, batches.ragged_applies(*tensors))

    def _forward_group(self, group: batches.Group, q, k, v, merged: RowMerge, scale: float) -> None:
        """The group's runs in one call, into the result itself where no call wrote their rows yet."""
        (out, lse), parts = merged.targets(group.row_spans)
        self._group_call(False, group, dict(q=q, k=k, v=v, out=out, lse=lse.unsqueeze(-1)), scale)
        for span, part in zip(group.row_spans, parts):
            merged.add(span, *part)

    def _group_call(self, backward: bool, group: batches.Group, tensors: Dict[str, Tensor], scale: float) -> None:
        """The group's one cuDNN call over the block's whole tensors (``batches.Group.bound``)."""
        tensors, ragged = group.bound(tensors, backward)
        graphs.graph(backward, tensors, scale, group.band, None, {}, ragged).execute(tensors, None, None, None)

    def _forward_call(self, run: blocks.Run, program: Program, q, k, v, out, lse, scale, q_seg, kv_seg) -> None:
        tensors = dict(q=rows(q, run.rows), k=rows(k, run.cols), v=rows(v, run.cols), out=out, lse=lse.unsqueeze(-1))
        self._call(False, run, program, tensors, scale, q_seg, kv_seg)

    def backward(self, q, k, v, out, lse, dout, q_seg: Optional[Segment], kv_seg: Optional[Segment], mods: Mods,
                 scale: float, masked: bool, tensors=(), res=None) -> Tuple[Tensor, Tensor, Tensor]:
        if tensors:  # ``select_kernel`` takes flex_attention (or the reference kernel) for such calls
            raise ValueError("the cuDNN kernel gives no gradient for the tensors a score_mod reads")
        program = traced(mods, masked, q.device)
        # ``res`` is below fp32's precision of ``lse`` but in rows whose scores are all huge:
        # those go to the reference kernel.
        return huge.exact_backward(
            self.name, huge.holds_huge(program.score),
            lambda stats: self._backward(program, q, k, v, out, stats, dout, q_seg, kv_seg, mods, scale),
            q, k, v, out, lse, dout, q_seg, kv_seg, mods, scale, masked, tensors, res)

    def _backward(self, program: Program, q, k, v, out, lse, dout, q_seg: Optional[Segment],
                  kv_seg: Optional[Segment], mods: Mods, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, dout = (_inner_contiguous(t) for t in (q, k, v, out, dout))
        runs = blocks.plan(program, mods, q, k, q_seg, kv_seg, self.split_depth)
        stats = lse.float()
        if program.score is not None or any(run.masked for run in runs):
            # A row that sees no key anywhere has lse -inf, which cuDNN's backward turns into NaN;
            # +inf makes its probabilities exp(s - inf) = 0. Only a per-element mask or a score_mod
            # can hide every key of a row: each row of an unmasked or native-band call sees a key.
            stats = torch.nan_to_num(stats, nan=math.nan, posinf=math.inf, neginf=math.inf)
        stats = stats.unsqueeze(-1)
        shared = (program, mods, q, k, v, out, lse, stats, dout, scale, q_seg, kv_seg)
        calls = self._calls(program, runs, q, k, v, out, dout)
        if len(calls) == 1:  # its gradients are the block's (a block's documents as one batch, too): no sums
            return self._backward_one(calls[0], *shared)
        q_empty, kv_empty = batches.empty_for(calls, batches.query_rows(q)), batches.empty_for(calls)
        # Calls write in place where no earlier call wrote those rows; elsewhere they are
        # summed in fp32, and every gradient is rounded once.
        dq_sum = RowSum([q.shape], q.dtype, torch.float32, q.device, [span for c in calls for span in c.row_spans],
                        q_empty)
        kv_sum = RowSum([k.shape, v.shape], k.dtype, torch.float32, k.device, [span for c in calls for span in c.col_spans],
                        kv_empty)
        for call in calls:
            if isinstance(call, batches.Group):
                self._backward_group(call, q, k, v, out, stats, dout, scale, dq_sum, kv_sum)
                continue
            grads = (dq_sum.destination(call.rows) or [q.new_empty(rows(q, call.rows).shape)]) + (
                kv_sum.destination(call.cols) or [k.new_empty(rows(k, call.cols).shape), v.new_empty(rows(v, call.cols).shape)])
            self._backward_call(call, *shared, grads)
            dq_sum.add(call.rows, grads[0])
            kv_sum.add(call.cols, *grads[1:])
        (dq,), (dk, dv) = dq_sum.result(), kv_sum.result()
        return dq, dk, dv

    def _backward_one(self, call, program: Program, mods: Mods, q, k, v, out, lse, stats, dout, scale: float, q_seg,
                      kv_seg, hops: Optional[Sequence[Hop]] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """The block's (dq, dk, dv) from its one call (a run, or a batch of them); of several
        ``hops`` joined in it, their rows and keys alone (``backward_hops``)."""
        if isinstance(call, blocks.Run) and (call.rows, call.cols) == ((0, q.shape[2]), (0, k.shape[2])):
            grads = [torch.empty_like(t) for t in (q, k, v)]
        else:
            q_empty, kv_empty = batches.empty_for((call,), batches.query_rows(q)), batches.empty_for((call,))
            grads = [q_empty(q.shape, dtype=q.dtype, device=q.device),
                     *(kv_empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))]
        if isinstance(call, batches.Group):
            self._backward_group_into(call, q, k, v, out, stats, dout, scale, *grads)
        else:
            self._backward_call(call, program, mods, q, k, v, out, lse, stats, dout, scale, q_seg, kv_seg,
                                [rows(grads[0], call.rows), *(rows(g, call.cols) for g in grads[1:])])
        q_within, kv_within = (None, None) if hops is None else ([h.q_rows for h in hops], [h.kv_rows for h in hops])
        for reached, spans, length, within in ((grads[:1], call.row_spans, q.shape[2], q_within),
                                               (grads[1:], call.col_spans, k.shape[2], kv_within)):
            for r in _outside(spans, length, within):  # rows and keys no query reaches
                for grad in reached:
                    rows(grad, r).zero_()
        return tuple(grads)

    def _backward_group(self, group: batches.Group, q, k, v, out, stats, dout, scale: float, dq_sum: RowSum,
                        kv_sum: RowSum) -> None:
        """The group's runs in one call, into the sums themselves where no call wrote their rows yet."""
        (dq,), dq_parts = dq_sum.targets(group.row_spans)
        (dk, dv), kv_parts = kv_sum.targets(group.col_spans)
        self._backward_group_into(group, q, k, v, out, stats, dout, scale, dq, dk, dv)
        for span, part in zip(group.row_spans, dq_parts):
            dq_sum.add(span, *part)
        for span, part in zip(group.col_spans, kv_parts):
            kv_sum.add(span, *part)

    def _backward_group_into(self, group: batches.Group, q, k, v, out, stats, dout, scale: float, dq, dk, dv) -> None:
        self._group_call(True, group, dict(q=q, k=k, v=v, out=out, dout=dout, lse=stats, dq=dq, dk=dk, dv=dv), scale)

    def _backward_call(self, run: blocks.Run, program: Program, mods: Mods, q, k, v, out, lse, stats, dout, scale,
                       q_seg, kv_seg, grads: List[Tensor]) -> None:
        """One call's dq, dk, dv into ``grads``."""
        tensors = dict(q=rows(q, run.rows), k=rows(k, run.cols), v=rows(v, run.cols), out=rows(out, run.rows),
                       dout=rows(dout, run.rows), lse=_packed(rows(stats, run.rows)),
                       dq=grads[0], dk=grads[1], dv=grads[2])
        if run.rows[1] - run.rows[0] == 1 and run.cols[1] - run.cols[0] == 1:
            # cuDNN's backward rejects s_q = s_kv = 1 (a one-token document, say)
            tensors["lse"] = rows(lse, run.rows)
            got = ReferenceKernel().backward(*(tensors[n] for n in ("q", "k", "v", "out", "lse", "dout")),
                                             _sub(q_seg, run.rows), _sub(kv_seg, run.cols), mods, scale,
                                             run.masked or run.band is not None)
            for grad, value in zip(grads, got):
                grad.copy_(value)
        else:
            self._call(True, run, program, tensors, scale, q_seg, kv_seg)


def _exact(program: Program) -> bool:
    """Whether the block is planned from its exact mask (a mask that is no band: packed
    documents), whose calls' shapes follow the documents."""
    return program.mask is not None and blocks.native_band(program.mask) is None


def _outside(spans, length: int, within: Optional[Sequence[Tuple[int, int]]] = None) -> List[Tuple[int, int]]:
    """The rows of ``range(length)`` outside ascending, disjoint ``spans``, as ranges; of
    those, only the rows inside ``within`` (ranges), where it is given."""
    gaps, start = [], 0
    for begin, end in spans:
        if begin > start:
            gaps.append((start, begin))
        start = end
    gaps += [(start, length)] * (start < length)
    if within is None:
        return gaps
    within = sorted(within)
    return [(max(a, lo), min(b, hi)) for a, b in gaps for lo, hi in within if min(b, hi) > max(a, lo)]


def _packed(t: Tensor) -> Tensor:
    """``t`` with packed strides: cuDNN's backward checks its stats' strides literally, size-1
    dims too, where torch calls a view contiguous whatever their strides (one batch and one
    head: rows of a longer block)."""
    return t if list(t.stride()) == packed_strides(t.shape) else t.clone(memory_format=torch.contiguous_format)


def _inner_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=None)
def _device_reason(index: int) -> Optional[str]:
    """Why cuDNN cannot run on this GPU at all, or None: asked once per device (the version
    and capability queries would cost host time at every call)."""
    try:
        cudnn = frontend.cudnn()
    except ImportError as e:
        return f"nvidia-cudnn-frontend is not installed ({e}); pip install 'ringflex[cudnn]'"
    if cudnn.backend_version() < _MIN_CUDNN:
        return f"cuDNN {cudnn.backend_version_string()} is too old: score_mod needs cuDNN 9.6 or newer"
    if torch.cuda.get_device_capability(index) < (9, 0):
        return "the cuDNN kernel needs a Hopper (sm_90) or newer GPU"
    return None


def cudnn_unavailable_reason(q: Tensor, k: Tensor, v: Tensor, mods: Mods,
                             lengths: Optional[Tuple[int, int]] = None) -> Optional[str]:
    """Why ``CudnnKernel`` cannot run this call, or None if it can; ``lengths``: the global query
    and key lengths whose positions the mods see (default: q's and k's own)."""
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the cuDNN kernel needs float16 or bfloat16 inputs, got {q.dtype}"
    reason = _device_reason(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if reason is not None:
        return reason
    for name, dim in (("q/k", q.shape[-1]), ("v", v.shape[-1])):
        if dim % 8 or dim > 256:
            return f"the {name} head dim must be a multiple of 8 and at most 256 for cuDNN, got {dim}"
    if q.shape[1] % k.shape[1]:
        return f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
    return lowering_error(mods, q.device, lengths or (q.shape[2], k.shape[2]), q.shape[0], q.shape[1])
