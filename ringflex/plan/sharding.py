"""Choosing a ``Sharding`` (``plan.layout``: which positions each rank holds, as a value) from
the mask.

``shard_by_mask`` picks, of the fixed layouts (contiguous, zigzag, striped) and the candidates
of ``plan.candidates``, the one the ring's cost model (``plan.cost.estimate``) prices cheapest;
``resharding`` decides whether a call left in the default layout moves to it. See
docs/sharding.md.

Imports no torch.distributed: it is pure planning, the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..mod import captured
from ..mod.fingerprint import fingerprint
from .candidates import document_bounds, packed_documents, per_document, searched
from .cost import MOVE_HOST_PAIRS, MOVE_PAIRS, Weights, compares_order_only, estimate, mask_work
from .layout import LAYOUTS, Sharding, divisor


def shard_by_mask(mask_mod: Optional[Callable], seq_len: int, world_size: int, *, document_ids: Optional[Tensor] = None,
                  batch: int = 1, heads: int = 1, chunks: Optional[int] = None, device=None,
                  weights: Weights = Weights()) -> Sharding:
    """The Sharding of ``seq_len`` positions over ``world_size`` ranks (equal sizes) that the
    cost model (``estimate``) prices cheapest for ``mask_mod``: never dearer than the best
    fixed layout; on a tie, the one with less GPU work (``cheapest``). ``document_ids``
    ([seq_len], as ``mods.document`` takes them) adds candidates that cut by document; ``chunks`` (a
    multiple of ``world_size`` dividing ``seq_len``) sets the pieces the search moves (default
    4 per rank, each a multiple of the workload's tile where the length allows); ``weights``
    what the model prices beyond pairs (``Weights``: kernel calls and travelling rows on the
    GPU, steps and calls on the host, strided pairs; fitted at B=1, H=32, D=128).
    Deterministic: every rank computes the same Sharding from the same arguments."""
    found = compare(mask_mod, seq_len, world_size, document_ids=document_ids, batch=batch, heads=heads,
                    chunks=chunks, device=device, weights=weights)
    return cheapest(found)[0]


def cheapest(found: List[Tuple[Sharding, Dict[str, object]]]) -> Tuple[Sharding, Dict[str, object]]:
    """The (sharding, estimate) of ``found`` (``compare``'s) that costs least, less GPU work
    deciding a tie (``estimate``'s ``gpu_cost``), the first of those on a tie again."""
    return min(found, key=lambda c: (c[1]["cost"], c[1]["gpu_cost"]))


@dataclass(frozen=True)
class Resharding:
    """How a call left in the default layout runs where the cost model prices that layout more
    than 10% dearer than the mask's cheapest sharding: its tokens move from ``source`` (the
    caller's shards) to ``target`` and its output back, or, where the move would save less than
    a tenth of the call, they stay (``target`` None) and the call runs slower than it could;
    ``message`` says which, to be said once."""

    source: Sharding
    target: Optional[Sharding]
    message: str


_RESHARDINGS: Dict[tuple, Optional[Resharding]] = {}


def resharding(mask_mod: Optional[Callable], seq_len: int, world_size: int, layout: str, *, batch: int = 1,
               heads: int = 1, device=None, price: bool = True) -> Optional[Resharding]:
    """How a call that runs ``mask_mod`` in the fixed ``layout`` it did not choose runs, where
    the cost model prices the best sharding of ``compare`` more than 10% cheaper than
    ``layout``: there, where it stays more than 10% cheaper with the move of its tokens there
    and back, else in place (None where ``layout`` is within 10% of the best, or where the mask
    cannot be priced). Decided once per mask structure and size (packed batches' masks, new
    every step, share one), the same on every rank; ``price=False`` gives only a decision made
    before (a CUDA-graph capture cannot price on its device)."""
    key = (fingerprint(mask_mod), seq_len, world_size, layout, batch, heads)
    if key in _RESHARDINGS or not price:
        return _RESHARDINGS.get(key)
    _RESHARDINGS[key] = None
    if mask_mod is None or world_size < 2:
        return None
    try:
        found = compare(mask_mod, seq_len, world_size, batch=batch, heads=heads, device=device)
    except Exception:  # noqa: BLE001 (the call itself checks the mask, in its plan)
        return None
    given = next((e["cost"] for s, e in found if s.name == layout), None)
    best, chosen = cheapest(found)
    cost = chosen["cost"]
    if given is None or best.name == layout or cost >= 0.9 * given:
        return None
    source = Sharding.of_layout(layout, seq_len, world_size)
    rows = _most_rows_sent(source, best)
    moved = cost + MOVE_PAIRS * rows + MOVE_HOST_PAIRS * (world_size - 1)  # an exchange per ring distance
    slower = (f"ringflex: this mask runs an estimated {given / cost:.1f}x slower in the default layout {layout!r} "
              f"than in the sharding {best.name!r} that ringflex.shard_by_mask chooses for it")
    advice = ("shard with layout=ringflex.shard_by_mask(mask_mod, seq_len, world_size) and pass the same layout "
              f"to ring_flex_attention and unshard; or pass layout={layout!r} to keep the tokens where they are")
    if moved < 0.9 * given:
        _RESHARDINGS[key] = Resharding(source, best, (
            f"{slower}, so each call re-shards: q, k and v move there and the output back (up to "
            f"{rows} of a rank's {seq_len // world_size} tokens; with the move the call is estimated "
            f"{given / moved:.1f}x faster than in place, the move about {1 - cost / moved:.0%} of "
            f"its time). To avoid the move, {advice}"))
    else:
        _RESHARDINGS[key] = Resharding(source, None, (
            f"{slower}. Moving its tokens there at each call (up to {rows} of a rank's {seq_len // world_size}) "
            f"would save less than a tenth of the call, so calls run in place, slower than they could. To run in "
            f"that sharding, {advice}"))
    return _RESHARDINGS[key]


def _most_rows_sent(source: Sharding, target: Sharding) -> int:
    """The most rows one rank sends to other ranks when a sequence moves from ``source`` to ``target``."""
    owners = source.owners()
    leaving = owners[owners != target.owners()]
    return int(torch.bincount(leaving, minlength=source.world_size).max())


def compare(mask_mod: Optional[Callable], seq_len: int, world_size: int, *, document_ids: Optional[Tensor] = None,
            batch: int = 1, heads: int = 1, chunks: Optional[int] = None, device=None,
            weights: Weights = Weights()) -> List[Tuple[Sharding, Dict[str, object]]]:
    """Every candidate ``shard_by_mask`` weighs, with its ``estimate``, in the order they are
    preferred on equal cost: the fixed layouts first."""
    if world_size < 1 or seq_len < world_size or seq_len % world_size:
        raise ValueError(f"seq_len ({seq_len}) must be a positive multiple of world_size ({world_size}): "
                         "a ring's shards have equal sizes")
    if document_ids is not None and tuple(document_ids.shape) != (seq_len,):
        raise ValueError(f"document_ids must have shape [{seq_len}], got {tuple(document_ids.shape)}")
    device = device if device is not None else (document_ids.device if document_ids is not None else None)
    fixed = [Sharding.of_layout(name, seq_len, world_size) for name in LAYOUTS
             if seq_len % divisor(name, world_size) == 0]
    with captured.one_walk():  # the mask's pairs and its order read one trace of it (a new packed batch: a new mask)
        work = mask_work(mask_mod, seq_len, batch=batch, heads=heads, device=device)
        price = dict(work=work, order_only=compares_order_only(mask_mod, device), weights=weights, device=device)
    if world_size == 1 or mask_mod is None:  # every sharding does the same work; one segment a rank calls least
        return [(fixed[0], estimate(fixed[0], mask_mod, **price))]
    extra = searched(work, world_size, chunks, weights)
    if document_ids is not None:
        docs = document_bounds(document_ids)
        extra += [per_document(docs, world_size), packed_documents(docs, world_size, work.row_pairs())]
    found, seen = [], set()
    for s in fixed + extra:
        if s is not None and s not in seen:
            seen.add(s)
            found.append((s, estimate(s, mask_mod, **price)))
    return found
