"""Runs of a block computed by one cuDNN call: a ragged batch (``Batch``: packed documents, one
call per hop instead of one per document) or, for runs of one shape evenly spaced, a plain call
over batch-n views (``Strided``: a zigzag rank's two diagonal blocks); and the padded memory
that lets a few ragged graphs serve any documents."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .frontend import CUDNN_TILE, MAX_PLANS

FORWARD_INPUTS = ("q", "k", "v")
BACKWARD_INPUTS = ("q", "k", "v", "out", "dout", "lse")
# The row axis of each tensor of a call: its sequences follow the queries' or the keys' spans.
ROW_AXIS = {**dict.fromkeys(("q", "out", "lse", "dout", "dq"), "q"), **dict.fromkeys(("k", "v", "dk", "dv"), "kv")}


@dataclass(frozen=True)
class Ragged:
    """What a ragged graph is built for: sequences, their longest rows and columns, and the
    rows and columns in all, rounded up to powers of two, so that a few graphs serve every
    layout of documents. On the query side both are the rows of the whole block the queries
    are cut from (``query_rows``): every cut of one block shares them. The tensors' heads are
    as many rows apart (``padded_empty``; keys: ``plan.blocks.widened``)."""

    count: int
    max_q: int
    max_kv: int
    total_q: int
    total_kv: int


@dataclass(frozen=True)
class Run:
    """One cuDNN call inside a block: local rows x columns, with the mask as a select
    (``masked``), as cuDNN's native band ``(left_bound, right_bound)``, or without mask."""

    rows: Tuple[int, int]
    cols: Tuple[int, int]
    masked: bool = False
    band: Optional[Tuple[Optional[int], Optional[int]]] = None

    @property
    def row_spans(self) -> Tuple[Tuple[int, int], ...]:  # as a ``Batch`` has them
        return (self.rows,)

    @property
    def col_spans(self) -> Tuple[Tuple[int, int], ...]:
        return (self.cols,)


class Group:
    """Runs of a block computed by one cuDNN call. They share one native mask (or none) and no
    rows or columns, so every output and gradient row has one writer; their rows and columns
    are merged as the spans they form (``row_spans``, ``col_spans``), not per run."""

    def __init__(self, runs: Tuple[Run, ...]):
        self.runs, self.band = runs, runs[0].band
        self.spans = {"q": [r.rows for r in runs], "kv": [r.cols for r in runs]}
        self.row_spans, self.col_spans = _joined(self.spans["q"]), _joined(self.spans["kv"])

    def bound(self, tensors: Dict[str, Tensor], backward: bool) -> Tuple[Dict[str, Tensor], Optional["Ragged"]]:
        """The call's tensors, from the block's whole ones (forward: q, k, v, out, lse as
        [B, H, n, 1]; backward: q, k, v, out, dout, lse as stats, dq, dk, dv), and the ragged
        description its graph is built for (None: a plain graph)."""
        raise NotImplementedError


class Batch(Group):
    """Runs as the sequences of a ragged batch: each starts at its own offset into the block's
    tensors and has its own lengths (cuDNN's padding mask). Packed documents: one call per hop
    instead of one per document."""

    def __init__(self, runs: Tuple[Run, ...]):
        super().__init__(runs)
        self._inputs: Dict[tuple, Tuple[Ragged, Dict[str, Tensor]]] = {}

    def bound(self, tensors: Dict[str, Tensor], backward: bool) -> Tuple[Dict[str, Tensor], Ragged]:
        # The inputs with rows ``head_dim`` elements apart, the stats packed (``head_dim_rows``,
        # ``packed_stats``); the outputs were allocated so (``empty_for``).
        inputs, rows = (BACKWARD_INPUTS if backward else FORWARD_INPUTS), query_rows(tensors["q"])
        tensors = {name: t if name not in inputs else packed_stats(t, rows) if name == "lse" else head_dim_rows(t)
                   for name, t in tensors.items()}
        ragged, offsets = self.inputs(tensors)
        return {**tensors, **offsets}, ragged

    def inputs(self, tensors: Dict[str, Tensor]) -> Tuple[Ragged, Dict[str, Tensor]]:
        """The ragged description over these tensors, and its int32 inputs: per tensor the
        element offset of each sequence, and the sequences' lengths (made once per layout of
        the tensors: a batch is planned once and called at every step). The batch is padded
        with empty sequences to a power of two, so that packed batches with any number of
        documents share a few graphs (each new one is a slow build)."""
        q, k = tensors["q"], tensors["k"]
        key = (q.device, query_rows(q), k.shape[2], *((name, t.stride(2)) for name, t in tensors.items()
                                                      if name in ROW_AXIS))
        if key not in self._inputs:
            self._inputs[key] = self._made_inputs(tensors)
        return self._inputs[key]

    def _made_inputs(self, tensors: Dict[str, Tensor]) -> Tuple[Ragged, Dict[str, Tensor]]:
        q, k = tensors["q"], tensors["k"]
        padding = power_of_two(len(self.runs)) - len(self.runs)

        def int32s(values: List[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int32).view(-1, 1, 1, 1).to(q.device)
        inputs = {f"seq_{axis}": int32s([e - b for b, e in spans] + [0] * padding) for axis, spans in self.spans.items()}
        for name, t in tensors.items():
            axis = ROW_AXIS.get(name)
            if axis is not None:
                step, spans = t.stride(2), self.spans[axis]
                inputs[f"{name}_offsets"] = int32s([b * step for b, _ in spans] + [spans[-1][1] * step] * (padding + 1))
        longest_kv = max(e - b for b, e in self.spans["kv"])
        q_rows = query_rows(q)
        ragged = Ragged(len(self.runs) + padding, q_rows, _bucket(longest_kv, k.shape[2]), q_rows,
                        power_of_two(k.shape[2]))
        return ragged, inputs


class Strided(Group):
    """Runs of one shape, each the rows and keys of the one before moved by the same steps (a
    zigzag rank's two diagonal blocks of a band mask), as one plain call over batch-n views of
    the block's tensors (B = 1). A plain graph reads no offsets, so the call costs less host
    time than a ragged batch, takes any native band (ragged batches only unmasked or causal,
    docs/cudnn.md), and its runs fill the GPU together where each alone would not (a narrow
    window's diagonal blocks)."""

    def __init__(self, runs: Tuple[Run, ...]):
        super().__init__(runs)
        first, second = runs[:2]
        self.starts = {"q": first.rows[0], "kv": first.cols[0]}
        self.steps = {"q": second.rows[0] - first.rows[0], "kv": second.cols[0] - first.cols[0]}
        self.lengths = {"q": first.rows[1] - first.rows[0], "kv": first.cols[1] - first.cols[0]}

    def bound(self, tensors: Dict[str, Tensor], backward: bool) -> Tuple[Dict[str, Tensor], None]:
        views = {name: self._view(t, ROW_AXIS[name]) for name, t in tensors.items()}
        if backward:  # cuDNN's backward wants its stats packed
            views["lse"] = packed_stats(views["lse"], self.lengths["q"])
        return views, None

    def _view(self, t: Tensor, axis: str) -> Tensor:
        """[runs, H, rows of a run, ...] of ``t``'s rows: batch entry i is run i's."""
        s = t.stride()
        return t.as_strided((len(self.runs), t.shape[1], self.lengths[axis], *t.shape[3:]),
                            (self.steps[axis] * s[2], *s[1:]), t.storage_offset() + self.starts[axis] * s[2])

    @staticmethod
    def takes(runs: List[Run]) -> bool:
        """Whether ``runs`` (ascending, two or more) are of one shape and evenly spaced, rows and keys apart."""
        first, second = runs[:2]
        shape = lambda r: (r.rows[1] - r.rows[0], r.cols[1] - r.cols[0])  # noqa: E731
        step = (second.rows[0] - first.rows[0], second.cols[0] - first.cols[0])
        return (step[0] >= shape(first)[0] and step[1] >= shape(first)[1]
                and all(shape(b) == shape(first) and (b.rows[0] - a.rows[0], b.cols[0] - a.cols[0]) == step
                        for a, b in zip(runs, runs[1:])))


def grouped_applies(*tensors: Optional[Tensor]) -> bool:
    """Whether a ``Group``'s runs can be one call over these tensors: one batch (its runs are
    rows of it; ``ragged_applies`` says which groups)."""
    return all(t.shape[0] == 1 for t in tensors if t is not None)


def empty_for(calls, rows: Optional[int] = None) -> Callable:
    """How a block's results are allocated: where a ragged batch writes them, with heads
    ``rows`` (else a power of two) rows apart (see ``padded_empty``)."""
    if any(isinstance(c, Batch) for c in calls):
        return functools.partial(padded_empty, rows=rows)
    return torch.empty


def query_rows(q: Tensor) -> int:
    """The query rows a ragged graph is built for: those of the block ``q``'s rows are cut
    from (its head stride in rows; ``q`` itself if it has none), rounded up to a power of two.
    Every cut of a block then shares the block's graphs, so packed documents that change at
    every call build a few graphs, not one per cut; the graph's larger rows cost no kernel
    time over the cut's own, as the padding mask skips them."""
    return power_of_two(max(q.shape[2], q.stride(1) // q.stride(2)))


def _joined(spans: List[Tuple[int, int]]) -> Tuple[Tuple[int, int], ...]:
    """Ascending spans with each run of adjoining ones joined into one."""
    joined = [spans[0]]
    for begin, end in spans[1:]:
        joined[-1:] = [(joined[-1][0], end)] if begin == joined[-1][1] else [joined[-1], (begin, end)]
    return tuple(joined)


_BATCHED_BANDS = (None, (None, 0))  # unmasked and causal: the ragged forms known right (docs/cudnn.md)


@functools.lru_cache(maxsize=MAX_PLANS)
def batched(runs: Tuple[Run, ...], exact: bool, ragged: bool = True) -> Tuple[object, ...]:
    """The calls for a block's runs. Runs with the same native mask (or none) become one call
    where they can: ``Strided`` where they are of one shape and evenly spaced, else (with
    ``ragged``) one ``Batch`` where their rows and columns follow one another. ``exact``: the
    runs of an exact plan (packed documents), whose shapes follow the documents: they batch
    even alone, as a ragged graph serves any lengths, and run strided only where their lengths
    are powers of two, as a plain graph is built per shape. The rest stay single calls; a
    one-pair run too: cuDNN's backward rejects it (see ``CudnnKernel._backward_call``)."""
    calls, groups = [], {}
    for run in runs:
        one_pair = run.rows[1] - run.rows[0] == 1 and run.cols[1] - run.cols[0] == 1
        if run.masked or one_pair:
            calls.append(run)
        else:
            groups.setdefault(run.band, []).append(run)
    for band, members in groups.items():
        members.sort(key=lambda r: r.rows)
        apart = all(a.rows[1] <= b.rows[0] and a.cols[1] <= b.cols[0] for a, b in zip(members, members[1:]))
        if len(members) > 1 and Strided.takes(members) and (not exact or _recurring_shape(members[0])):
            calls.append(Strided(tuple(members)))
        elif ragged and band in _BATCHED_BANDS and apart and (exact or len(members) > 1):
            calls.append(Batch(tuple(members)))
        else:
            calls += members
    return tuple(calls)


def _recurring_shape(run: Run) -> bool:
    """Whether the run's lengths are among a few whatever the documents: powers of two."""
    return all(n == power_of_two(n) for n in (run.rows[1] - run.rows[0], run.cols[1] - run.cols[0]))


def power_of_two(n: int) -> int:
    """The least power of two >= n (n > 0)."""
    return 1 << (n - 1).bit_length()


def _bucket(n: int, rows: int) -> int:
    """The length a ragged graph is built for, for a longest sequence of ``n`` of ``rows`` rows."""
    return min(power_of_two(rows), max(CUDNN_TILE, power_of_two(n)))


def ragged_applies(q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor] = None, dout: Optional[Tensor] = None) -> bool:
    """Whether a ragged batch computes right over these tensors (the forward's, or with ``out``
    and ``dout`` the backward's): one batch (the runs are per batch), int32 offsets over rows of
    ``head_dim`` elements (``head_dim_rows``), and in the backward no grouped key/value heads,
    and query head dims above 192 only with value heads as wide: cuDNN 9.19 got the gradients
    wrong otherwise (grouped heads; q/k 256 or 224 with v 128; docs/cudnn.md)."""
    tensors = [t for t in (q, k, v, out, dout) if t is not None]
    if not all(t.shape[0] == 1 and t.shape[2] * t.shape[3] < 2 ** 31 for t in tensors):
        return False
    return out is None or (k.shape[1] == q.shape[1] and (q.shape[3] <= 192 or q.shape[3] == v.shape[3]))


def head_dim_rows(t: Tensor) -> Tensor:
    """``t`` with its rows ``head_dim`` elements apart, copied where they are not ([B, S, H, D]
    strides): the only layout ragged batches were measured right in. cuDNN 9.19's backward
    indexes its fp32 dQ accumulator from the query offsets as if query rows were so (dQ was
    wrong otherwise); a copy costs less than a call per document."""
    return t if t.stride(2) == t.shape[3] else _padded_copy(t)


def recurring(t: Tensor) -> bool:
    """Whether ``t``'s row count is one of a few whatever the documents: a power of two (a
    zigzag chunk, a received block), or all the rows of its memory (its rows span its head or
    batch stride: a whole block in [B, H, S, D] or [B, S, H, D] memory, not rows cut from one)."""
    n = t.shape[2]
    return n == power_of_two(n) or n * t.stride(2) in (t.stride(0), t.stride(1))


def padded_empty(shape, dtype: torch.dtype, device, rows: Optional[int] = None) -> Tensor:
    """An empty [B, H, n, ...] tensor whose heads are ``rows`` (>= n; default: n rounded up to
    a power of two) rows apart. A ragged graph bakes in the head stride (``graphs._layout``): tensors
    allocated so serve one graph for any n up to ``rows``."""
    rows = rows or power_of_two(shape[2])
    return torch.empty((*shape[:2], rows, *shape[3:]), dtype=dtype, device=device)[:, :, :shape[2]]


def _padded_copy(t: Tensor, rows: Optional[int] = None) -> Tensor:
    """``t`` copied into rows of its last dims, heads ``rows`` rows apart (``padded_empty``)."""
    return padded_empty(t.shape, t.dtype, t.device, rows).copy_(t)


def packed_stats(stats: Tensor, rows: int) -> Tensor:
    """The backward's [B, H, n, 1] stats with rows packed and heads ``rows`` rows apart, copied
    where they are not (cuDNN wants them packed; ``padded_empty`` says why the heads so)."""
    return stats if stats.stride()[1:] == (rows, 1, 1) else _padded_copy(stats, rows)
