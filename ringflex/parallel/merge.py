"""Log-sum-exp merge of partial attention results, computed in fp32 or fp64."""
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
    keep, add = torch.exp(lse - finite).unsqueeze(-1), torch.exp(part_lse - finite).unsqueeze(-1)
    if out.dtype in (torch.float32, torch.float64):
        out.mul_(keep).addcmul_(part_out, add.to(out.dtype))
    else:  # a low-precision output (a kernel's own): merge in fp32, round once
        out.copy_(out.float() * keep + part_out.float() * add)
    lse.copy_(new_lse)
