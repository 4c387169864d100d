"""The cuDNN hop kernel: cuDNN's fused SDPA with the user's mods compiled into the graph.

``score_mod`` / ``mask_mod`` are traced (``ringflex.mod.trace``) and lowered into cuDNN's
score_mod callback. ``q_idx`` / ``kv_idx`` are generated indices plus the hop's global
offsets (and times the stride of striped layouts); offsets are pass-by-value scalars, so one
built graph serves every hop. Lookups of captured tensors (``doc[q_idx]``, ``slopes[h]``) are
computed in torch for the hop's positions and enter as broadcast tensors: cuDNN has no gather.
A mask becomes a select of -inf after the score modification. The backward's
``score_mod_bprop`` is the traced derivative (``trace.score_grad``).

A block is planned as one or more calls (``blocks.Run``): without mask, plain SDPA; a mask that is
a diagonal band of ``q_idx - kv_idx`` (causal, sliding window) gets cuDNN's native band mask,
which skips tiles, once rows and columns that see nothing are cut off; other masks without a
score_mod are planned from the exact mask (keys every row sees unmasked, native bands where
the mask is one); with a score_mod, cuDNN takes no native mask, so the block is cut into row
chunks that skip empty key tiles (``SPLIT_DEPTH``). Calls that share a native mask (or none) and
no rows or columns run as one call: a plain call over strided views where they are of one shape
and evenly spaced (a zigzag rank's two diagonal blocks, ``batches.Strided``), else a ragged batch
(packed documents, ``batches.Batch``). docs/cudnn.md has the measurements.

Where each part lives: ``kernel`` (``CudnnKernel``, a hop as cuDNN calls), ``blocks`` (a
block planned as calls), ``batches`` (calls grouped into one), ``graphs`` (built graphs,
cached), ``lowering`` (the mods inside a graph), ``frontend`` (the library and its handles).
"""
from __future__ import annotations

import atexit
import gc

from . import batches, blocks, frontend, graphs, kernel, lowering
from .kernel import SPLIT_DEPTH, CudnnKernel, cudnn_unavailable_reason
from .lowering import lowering_error

__all__ = ["SPLIT_DEPTH", "CudnnKernel", "clear_cache", "cudnn_unavailable_reason", "lowering_error"]


def clear_cache() -> None:
    """Frees every built graph and handle (done at exit: live graphs make nanobind report leaks)."""
    graphs._GRAPHS.clear()
    blocks._PLANS.clear()
    blocks._BANDS.clear()
    blocks.band_runs.cache_clear()
    kernel._JOINED.clear()
    batches.batched.cache_clear()
    lowering._LOWERINGS.clear()
    gc.collect()
    frontend.destroy_handles()


atexit.register(clear_cache)
