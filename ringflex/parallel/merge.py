"""Log-sum-exp merge of partial attention results, in the accumulation dtype (fp32 or fp64)."""
from __future__ import annotations

import torch
from torch import Tensor


def merge_(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor, first: bool = False) -> None:
    """Folds one hop's (part_out, part_lse) into the running (out, lse), in place.

    ``first``: nothing was merged into these rows yet, so this is a copy. Rows that saw no
    key so far and none in this hop keep lse -inf and out 0, never NaN.
    """
    if first:
        out.copy_(part_out)
        lse.copy_(part_lse)
        return
    new_lse = torch.logaddexp(lse, part_lse)
    finite = torch.where(new_lse.isneginf(), 0.0, new_lse)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.addcmul_(part_out, torch.exp(part_lse - finite).unsqueeze(-1).to(out.dtype))
    lse.copy_(new_lse)
