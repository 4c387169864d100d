"""Packed variable-length batches: many sequences end to end in one sharded sequence.

A batch of sequences (given as lengths, ``cu_seqlens`` or a jagged nested tensor) is packed
into one sequence, padded to a length the layout can split over the group, and attended with
the document mask, so no token sees another sequence. Padding is a document of its own:
no real token sees it and its rows are never empty (no NaN); give its labels
``ignore_index`` and the loss ignores it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import mods
from .parallel import mesh as meshes
from .api import reject, ring_flex_attention
from .parallel.shard import shard, unshard
from .plan import layout as layouts
from .plan.sharding import shard_by_mask


class PackedSequences:
    """Sequences of ``lengths`` packed end to end and padded to fit ``layout`` over ``group``.

    ``doc_ids`` (global, padding included) is the same on every rank, so masks built from it
    read global positions. Build one with ``from_lengths``, ``from_cu_seqlens`` or ``from_nested``.
    ``layout`` None (the default): on a ring, the sharding ``shard_by_mask`` chooses for these
    sequences' causal document mask (zigzag keeps every document on every rank, which costs
    packed documents up to twice the time on 4 GPUs); on a heads x ring mesh, zigzag. A layout
    passed is used as given. Every rank computes the same choice from the same lengths.
    """

    def __init__(self, lengths: Sequence[int], *, group=None, layout=None, device=None):
        lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError(f"lengths must be a non-empty list of positive sequence lengths, got {lengths}")
        self.lengths = tuple(lengths)
        self.group = meshes.group_or_mesh(group)
        self.world_size = meshes.world_size(group)
        self.total = sum(lengths)
        multiple = meshes.divisor(layouts.or_default(layout), group)
        self.padded_len = -(-self.total // multiple) * multiple
        padded = lengths + ([self.padded_len - self.total] if self.padded_len > self.total else [])
        self.doc_ids = mods.document_ids(padded, device=device)
        self._masks = {}
        if layout is None and self.world_size > 1 and meshes.describe(self.group) is None:
            layout = shard_by_mask(self.mask_mod(causal=True), self.padded_len, self.world_size)
        self.layout = layouts.check_layout(layouts.or_default(layout))

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], **kwargs) -> "PackedSequences":
        return cls(lengths, **kwargs)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, **kwargs) -> "PackedSequences":
        """From cumulative lengths ``[0, n0, n0+n1, ...]`` (flash-attention's varlen convention)."""
        cu = torch.as_tensor(cu_seqlens).flatten()
        if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu.diff() <= 0).any()):
            raise ValueError(f"cu_seqlens must start at 0 and strictly increase, got {cu.tolist()}")
        return cls(cu.diff(), device=kwargs.pop("device", cu.device), **kwargs)

    @classmethod
    def from_nested(cls, nested: Tensor, **kwargs) -> "PackedSequences":
        """From a jagged nested tensor [batch, ragged_len, ...] (``torch.nested``, layout=torch.jagged)."""
        _check_nested(nested)
        return cls(nested.offsets().diff(), device=kwargs.pop("device", nested.device), **kwargs)

    @property
    def cu_seqlens(self) -> Tensor:
        """Cumulative lengths of the real sequences, int32, ``[0, ..., total]``."""
        lengths = torch.tensor(self.lengths, dtype=torch.int32, device=self.doc_ids.device)
        return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))

    def mask_mod(self, causal: bool = True):
        """The document mask (causal within each sequence by default), at global positions.

        The same object on every call, so the ring's planner classifies its blocks once."""
        if causal not in self._masks:
            self._masks[causal] = mods.document(self.doc_ids, causal_within=causal)
        return self._masks[causal]

    def position_ids(self) -> Tensor:
        """Global [padded_len] position of each token within its own sequence (for RoPE)."""
        starts = torch.nn.functional.pad(torch.bincount(self.doc_ids).cumsum(0), (1, 0))[self.doc_ids]
        return torch.arange(self.padded_len, device=self.doc_ids.device) - starts

    def pad(self, x: Tensor, dim: int = 0, value=0) -> Tensor:
        """``x`` (or a jagged nested tensor's values) padded along ``dim`` from ``total`` tokens
        to ``padded_len`` with ``value``."""
        x = _values(x) if x.is_nested else x
        dim = dim % x.dim()
        if x.shape[dim] == self.padded_len:
            return x
        if x.shape[dim] != self.total:
            raise ValueError(f"x must have {self.total} tokens (or {self.padded_len} padded) along dim {dim}, "
                             f"got shape {tuple(x.shape)}")
        shape = list(x.shape)
        shape[dim] = self.padded_len - self.total
        return torch.cat([x, x.new_full(shape, value)], dim)

    def shard(self, x: Tensor, dim: int = 0, pad_value=0) -> Tensor:
        """This rank's tokens of the packed ``x``; padding takes ``pad_value`` (-100 for labels).

        ``x`` holds all ``total`` tokens along ``dim``, or is a jagged nested tensor, whose
        packed values [total, ...] are used (``dim`` then counts the dims of the values)."""
        padded = self.pad(x, dim, pad_value)
        return shard(padded, dim % padded.dim(), self.group, self.layout)

    def unshard(self, x: Tensor, dim: int = 0) -> Tensor:
        """All ``total`` real tokens, in packed order, gathered from every rank's shard."""
        return unshard(x, dim, self.group, self.layout).narrow(dim, 0, self.total)

    def to_nested(self, values: Tensor) -> Tensor:
        """The packed ``values`` [total, ...] as a jagged nested tensor [batch, ragged_len, ...]."""
        return torch.nested.nested_tensor_from_jagged(values, self.cu_seqlens.to(values.device, torch.int64))


def _check_nested(nested: Tensor) -> None:
    if not (isinstance(nested, Tensor) and nested.is_nested and nested.layout == torch.jagged):
        raise TypeError("expected a nested tensor with layout=torch.jagged")
    if nested._ragged_idx != 1 or nested.lengths() is not None:
        raise ValueError("the nested tensor must be ragged along dim 1 and contiguous (no holes)")


def _values(nested: Tensor) -> Tensor:
    _check_nested(nested)
    return nested.values()


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, packed: PackedSequences, *, causal: bool = True,
                     score_mod=None, scale: Optional[float] = None, enable_gqa: bool = False,
                     backend: str = "auto", sinks: Optional[Tensor] = None) -> Tensor:
    """Attention within each packed sequence, in flash-attention's varlen layout.

    q: [S_local, Hq, D], k/v: [S_local, Hkv, D]: this rank's shard (``packed.shard``) of the
    packed tokens. Returns [S_local, Hq, Dv]. ``score_mod`` sees global packed positions;
    ``sinks`` [Hq]: attention sinks, as ``ring_flex_attention``'s.
    """
    local = packed.padded_len // packed.world_size
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[0] != local:  # raised on every rank: the others wait
            got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            reject(f"varlen_attention: {name} must be [{local}, heads, head_dim] (this rank's shard of "
                   f"{packed.padded_len} packed tokens), got {got}", packed.group)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = ring_flex_attention(q4, k4, v4, score_mod=score_mod, mask_mod=packed.mask_mod(causal), group=packed.group,
                              layout=packed.layout, scale=scale, enable_gqa=enable_gqa, backend=backend, sinks=sinks)
    return out.squeeze(0).transpose(0, 1)
