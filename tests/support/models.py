"""The smallest model that ``RingFlexAttention`` routes, for tests that train it on a ring
against one process."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TinyModel(nn.Module):
    """Embedding, one causal SDPA attention of ``heads`` heads, a head; in fp64. Given
    ``positions`` (global token positions), the model adds them to the embedding, as RoPE
    would make its output depend on them."""

    def __init__(self, heads: int = 2, length: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.length = heads, length  # length: the positions' scale
        self.embed, self.qkv, self.head = nn.Embedding(11, 16), nn.Linear(16, 48), nn.Linear(16, 11)
        self.double()

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        x = self.embed(tokens)
        if positions is not None:
            x = x + positions.unsqueeze(-1).double() / self.length
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, 16 // self.heads)).permute(2, 0, 3, 1, 4)
        return self.head(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
