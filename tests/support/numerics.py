"""The ring's error against a float64 oracle, by world size (tests/test_numerics.py and
scripts/numerics_table.py share it).

One global problem for every world size, so only the ring changes. Errors are taken over the
whole gathered sequence and relative to the reference's largest magnitude:
max |got - want| / max |want|, for the output and for dq, dk, dv.
"""
from __future__ import annotations

import hashlib

import torch

import ringflex
from .oracle import attention
from ringflex import mods

SEQ_LEN = 64  # fits zigzag on 1, 2, 4 and 8 ranks
HEADS, HEAD_DIM = 2, 16
DTYPES = (torch.float32, torch.bfloat16)


def problems():
    """name -> (score_mod, mask_mod)."""
    doc_ids = mods.document_ids([13, 1, 20, 8, 22])
    return {
        "no_mask": (None, None),
        "causal": (None, mods.causal),
        "documents": (None, mods.document(doc_ids)),
        "causal_softcap": (mods.softcap(5.0), mods.causal),
    }


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, HEADS, SEQ_LEN, HEAD_DIM, generator=g).to(dtype) for _ in range(4)]


def _ring(q, k, v, dout, score_mod, mask_mod, layout):
    local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
    out = ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod, layout=layout,
                                       backend="reference")
    out.backward(ringflex.shard(dout, 2, layout=layout))
    return [out.detach()] + [t.grad for t in local]


def measure(rank, world_size, layout="zigzag"):
    """{(problem, dtype name): [out, dq, dk, dv] relative errors} (alike on every rank), whether
    a second identical run was bitwise identical, and a digest of this rank's results."""
    errors, repeatable, digest = {}, True, hashlib.sha1()
    for name, (score_mod, mask_mod) in problems().items():
        for dtype in DTYPES:
            q, k, v, dout = _inputs(dtype)
            full = [t.double().requires_grad_() for t in (q, k, v)]
            want = attention(*full, score_mod, mask_mod)
            want.backward(dout.double())
            want = [want.detach()] + [t.grad for t in full]
            got = _ring(q, k, v, dout, score_mod, mask_mod, layout)
            repeatable &= all(torch.equal(a, b) for a, b in zip(got, _ring(q, k, v, dout, score_mod, mask_mod, layout)))
            for t in got:
                digest.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            whole = [ringflex.unshard(t.contiguous(), 2, layout=layout) for t in got]
            errors[name, str(dtype).replace("torch.", "")] = [
                ((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(whole, want)]
    return errors, repeatable, digest.hexdigest()
