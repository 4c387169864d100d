"""Attention sinks as gpt-oss has them: a learnable logit per head in every softmax's
denominator, with no value. The ring computes attention without them and adds them here, to
its merged output and LSE; backward needs only the sinks' own gradient."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .merge import lse_weights


def with_sinks(out: Tensor, lse: Tensor, res: Optional[Tensor], sinks: Tensor):
    """Attention with a sink per head (a logit in every softmax's denominator, with no value),
    from attention without: the LSE grows to logaddexp(lse, sink) and each row shrinks by
    exp(lse - that), in fp32 (a merge with a part of output 0: ``merge.lse_weights``). A row
    that sees no key keeps output 0, its LSE the sink's. Backward needs nothing more: given
    this output and LSE, a hop's backward computes the softmax over the keys and the sink
    (``sink_grad`` gives the sink's own gradient). Returns (out, lse, res)."""
    (keep, _), lse, res = lse_weights([(lse, res), (sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse), None)])
    return (out.to(lse.dtype) * keep.unsqueeze(-1)).to(out.dtype), lse, res


def sink_grad(out: Tensor, lse: Tensor, res: Optional[Tensor], dout: Optional[Tensor], dlse: Optional[Tensor],
              sinks: Tensor) -> Tensor:
    """The sinks' gradient from this rank's rows: per row, the sink's softmax weight times
    (dlse - rowsum(dout * out)), as for a key whose value is 0; summed over batches and rows."""
    weight = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse - (0.0 if res is None else res))
    delta = 0.0 if dout is None else (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return (weight * ((0.0 if dlse is None else dlse) - delta)).sum((0, 2)).to(sinks.dtype)
