"""Log-sum-exp merge of partial attention results, in the accumulation dtype (fp32 or fp64)."""
from __future__ import annotations

import torch
from torch import Tensor


def merge_(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """Folds one hop's (part_out, part_lse) into the running (out, lse), in place.

    Rows that saw no key so far and none in this hop keep lse -inf and out 0, never NaN.
    """
    new_lse = torch.logaddexp(lse, part_lse)
    finite = torch.where(new_lse.isneginf(), 0.0, new_lse)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.add_(part_out.to(out.dtype) * torch.exp(part_lse.to(lse.dtype) - finite).unsqueeze(-1))
    lse.copy_(new_lse)
