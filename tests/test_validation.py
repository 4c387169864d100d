"""Bad calls fail with one clear error on every rank, before any transfer, and never hang.

Each distributed test injects mismatches one after another in a single world: a rejected
call leaves the group usable, which the final good call of every world checks too.
"""
import contextlib
import os
import types

import pytest
import torch
import torch.distributed as dist

import ringflex
from support.harness import run_world
from support.oracle import attention
from ringflex import mods
from ringflex.parallel.debug import RingDebugError
from ringflex.kernels.reference import ReferenceKernel

WORLD = 3
LEARNABLE = torch.zeros(2, requires_grad=True)  # a per-head bias (or sinks) a model learns
L = 4  # local tokens (zigzag: 2 chunks of 2)
TIMEOUT = 120


def _inputs(seq_len=L * WORLD, heads=2, dim=8, dtype=torch.float32, layout="zigzag"):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, heads, seq_len, dim, generator=g, dtype=dtype) for _ in range(3)]
    return full, [ringflex.shard(t, 2, layout=layout) for t in full]


def _error_text(fn):
    """The error ``fn()`` raises, as 'Type: message' (None if it returns)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the test compares the text on every rank)
        return f"{type(e).__name__}: {e}"
    return None


def _query_flags(flags):
    def flagged_queries_mask(b, h, q_idx, kv_idx):
        return ~flags[q_idx] & (kv_idx <= q_idx)
    return flagged_queries_mask


def _raising(message):
    def mask_that_raises(b, h, q_idx, kv_idx):
        raise ValueError(message)
    return mask_that_raises


def _undefined_name(score, b, h, q_idx, kv_idx):
    return score + undefined_bias  # noqa: F821 (a name nothing defines)


def _without_grad(call):
    def run():
        with torch.no_grad():
            return call()
    return run


def _with_kernel_named(name, call):
    """``call`` with ``backend="auto"`` choosing a kernel named ``name`` here (a rank whose GPU
    cuDNN cannot use, say); None: as it chooses."""
    def run():
        from ringflex import api
        chosen = api.select_kernel
        if name is not None:
            api.select_kernel = lambda *args, **kwargs: type("Other", (ReferenceKernel,), {"name": name})()
        try:
            return call()
        finally:
            api.select_kernel = chosen
    return run


def _mismatches(rank, world_size):
    """name -> the error text this rank got for each injected mismatch (rank 1 is the odd one)."""
    odd = rank == 1
    full, (q, k, v) = _inputs()
    attn = ringflex.ring_flex_attention
    flags = torch.zeros(L * world_size - 2, dtype=torch.bool)  # too short for the last rank's queries
    seq_len = L * world_size
    relative = torch.zeros(2 * seq_len - 4)  # a table of q_idx - kv_idx: 2 * seq_len - 1 entries cover every pair
    per_head = torch.zeros(1)  # one entry, for two heads

    def with_debug_on_rank_1():
        os.environ["RINGFLEX_DEBUG"] = "1" if odd else "0"
        try:
            return attn(q, k, v)
        finally:
            os.environ["RINGFLEX_DEBUG"] = "0"

    def with_env_on_rank_1(name, value, call):
        def run():
            if odd:
                os.environ[name] = value
            try:
                return call()
            finally:
                os.environ.pop(name, None)
        return run

    def without_grad_on_rank_1(call):
        def run():
            with torch.no_grad() if odd else contextlib.nullcontext():
                return call()
        return run

    def with_transport_on_rank_1(value):
        def call():
            os.environ["RINGFLEX_TRANSPORT"] = value if odd else "auto"
            try:
                return attn(q, k, v)
            finally:
                del os.environ["RINGFLEX_TRANSPORT"]
        return call

    calls = {
        "local query length": lambda: attn(q[:, :, :2] if odd else q, k, v),
        "local key/value length": lambda: attn(q, k[:, :, :2] if odd else k, v[:, :, :2] if odd else v),
        "query heads": lambda: attn(q.repeat(1, 2, 1, 1) if odd else q, k, v, enable_gqa=True),
        "head dim": lambda: attn(*(t[..., :4] if odd else t for t in (q, k, v))),
        "value head dim": lambda: attn(q, k, v[..., :4] if odd else v),
        "dtype": lambda: attn(*(t.bfloat16() if odd else t for t in (q, k, v))),
        "layout": lambda: attn(q, k, v, layout="striped" if odd else "zigzag"),
        "backend": lambda: attn(q, k, v, backend="reference" if odd else "auto"),
        "kernel": _with_kernel_named("cudnn" if odd else None, lambda: attn(q, k, v)),
        "scale": lambda: attn(q, k, v, scale=0.5 if odd else None),
        "enable_gqa": lambda: attn(q, k, v, enable_gqa=odd),
        "sinks": lambda: attn(q, k, v, sinks=torch.zeros(2) if odd else None),
        "return_lse": lambda: attn(q, k, v, return_lse=odd),  # whether a loan's LSE gradient travels
        "mask_mod fingerprint": lambda: attn(q, k, v, mask_mod=mods.sliding_window(3 if odd else 4)),
        "score_mod on one rank": lambda: attn(q, k, v, score_mod=mods.softcap(5.0) if odd else None),
        "gradient tracking": lambda: attn(q.detach().requires_grad_(odd), k, v),
        # what else backward runs the ring for: learnable sinks, a learnable bias a score_mod reads
        "gradient tracking of sinks": without_grad_on_rank_1(lambda: attn(q, k, v, sinks=LEARNABLE)),
        "gradient tracking of a score_mod's tensor": without_grad_on_rank_1(
            lambda: attn(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + LEARNABLE[h])),
        "bad RINGFLEX_STRAGGLER_S on one rank": with_env_on_rank_1("RINGFLEX_STRAGGLER_S", "60s",
                                                                   lambda: attn(q, k, v)),
        "bad RINGFLEX_MIN_TILE on one rank": with_env_on_rank_1("RINGFLEX_MIN_TILE", "abc", lambda: attn(q, k, v)),
        "debug mode": with_debug_on_rank_1,
        "transport": with_transport_on_rank_1("nccl"),
        "bad transport on one rank": with_transport_on_rank_1("ipc"),
        "bad argument on one rank": lambda: attn(q[0] if odd else q, k, v),
        "bad layout name on one rank": lambda: attn(q, k, v, layout="zigzig" if odd else "zigzag"),
        # rank 1 reports it: rank 2's queries read past the tensor, and rank 1 plans rank 2's hops against its block
        "mask_mod reading past a captured tensor": lambda: attn(q, k, v, mask_mod=_query_flags(flags),
                                                               layout="contiguous"),
        "score_mod reading past a captured tensor": lambda: attn(q, k, v, score_mod=mods.alibi(mods.alibi_slopes(1))),
        # without grad mode no gradient check evaluates a score_mod that cannot be traced: the lookup check does
        "score_mod raising without grad": _without_grad(lambda: attn(q, k, v, score_mod=_undefined_name)),
        "score_mod of the wrong shape without grad": _without_grad(
            lambda: attn(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s.reshape(-1)[:3])),
        # the trace folds a constant into a number: its shape is checked before
        "mask_mod returning a constant of the wrong shape": lambda: attn(
            q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: torch.ones(5, dtype=torch.bool)),
        "score_mod adding a constant of the wrong shape": lambda: attn(
            q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + torch.zeros(5)),
        # subscripts of two inputs, ranged over the blocks
        "relative-position bias past its table": lambda: attn(
            q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + relative[q_idx - kv_idx + seq_len - 1]),
        "relative-position mask past its table": lambda: attn(
            q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: relative[q_idx - kv_idx + seq_len - 1] == 0),
        "bias by batch and head past its table": lambda: attn(
            q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + per_head[b * 2 + h]),
        # mods that cannot be traced, tried at every batch element and head
        "untraceable score_mod reading past its table": lambda: attn(
            q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + torch.sin(per_head[h])),
        "untraceable mask_mod reading past its table": lambda: attn(
            q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: torch.sin(per_head[h]) == 0),
        # the record carries 400 bytes of the message: cut inside a character, it still decodes
        "long message on one rank": lambda: attn(q, k, v, mask_mod=_raising("x" + "\u00e9" * 300) if odd else mods.causal),
    }
    results = {name: _error_text(call) for name, call in calls.items()}
    out = attn(q, k, v, mask_mod=mods.causal)  # the group still works
    expected = ringflex.shard(attention(*full, mask_mod=mods.causal), 2)
    results["good call afterwards"] = (out - expected).abs().max().item()
    # constants that broadcast as flex_attention's do (a Python bool, 0-d tensors): every key seen
    for name, mask_mod, score_mod in (
            ("True", lambda b, h, q_idx, kv_idx: True, lambda s, b, h, q_idx, kv_idx: s * torch.tensor(0.5)),
            ("0-d", lambda b, h, q_idx, kv_idx: torch.ones((), dtype=torch.bool), None)):
        with torch.no_grad():
            out = attn(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
        expected = ringflex.shard(attention(*full, score_mod=score_mod), 2)
        results[f"constant {name}"] = (out - expected).abs().max().item()
    return results


EXPECTED = {
    "local query length": "CallRejected: ring_flex_attention: the ranks disagree on the local query length "
                          "(rank 0: 4, rank 1: 2, rank 2: 4); every rank of the ring must make the same call",
    "local key/value length": "disagree on the local key/value length (rank 0: 4, rank 1: 2, rank 2: 4)",
    "query heads": "disagree on the query heads (rank 0: 2, rank 1: 4, rank 2: 2)",
    "head dim": "disagree on the head dim (rank 0: 8, rank 1: 4, rank 2: 8)",
    "value head dim": "disagree on the value head dim (rank 0: 8, rank 1: 4, rank 2: 8)",
    "dtype": "disagree on the dtype (rank 0: torch.float32, rank 1: torch.bfloat16, rank 2: torch.float32)",
    "layout": "disagree on the layout (rank 0: 'zigzag', rank 1: 'striped', rank 2: 'zigzag')",
    "backend": "disagree on the backend (rank 0: 'auto', rank 1: 'reference', rank 2: 'auto')",
    "kernel": "disagree on the kernel (rank 0: 'reference', rank 1: 'cudnn', rank 2: 'reference')",
    "scale": "disagree on the scale (rank 0: None, rank 1: 0.5, rank 2: None)",
    "enable_gqa": "disagree on the enable_gqa (rank 0: False, rank 1: True, rank 2: False)",
    "sinks": "disagree on the sinks (rank 0: None, rank 1: given, rank 2: None)",
    "return_lse": "disagree on the return_lse (rank 0: False, rank 1: True, rank 2: False)",
    "mask_mod fingerprint": "disagree on the mask_mod (rank 0: fingerprint",
    "score_mod on one rank": "disagree on the score_mod (rank 0: fingerprint 0000000000000000, rank 1: fingerprint",
    "gradient tracking": "disagree on the gradient tracking (whether backward will run the ring) "
                         "(rank 0: False, rank 1: True, rank 2: False)",
    "gradient tracking of sinks": "disagree on the gradient tracking (whether backward will run the ring) "
                                  "(rank 0: True, rank 1: False, rank 2: True)",
    "gradient tracking of a score_mod's tensor": "disagree on the gradient tracking (whether backward will run "
                                                 "the ring) (rank 0: True, rank 1: False, rank 2: True)",
    "bad RINGFLEX_STRAGGLER_S on one rank": "CallRejected: ring_flex_attention: rank 1: RINGFLEX_STRAGGLER_S='60s': "
                                            "expected a number of seconds >= 0",
    "bad RINGFLEX_MIN_TILE on one rank": "CallRejected: ring_flex_attention: rank 1: RINGFLEX_MIN_TILE='abc': "
                                         "expected a whole number of rows >= 1",
    "debug mode": "disagree on the RINGFLEX_DEBUG mode (rank 0: False, rank 1: True, rank 2: False)",
    "transport": "disagree on the RINGFLEX_TRANSPORT (rank 0: 'auto', rank 1: 'nccl', rank 2: 'auto')",
    "bad transport on one rank": "CallRejected: ring_flex_attention: rank 1: RINGFLEX_TRANSPORT='ipc': expected one "
                                 "of auto, copy-engine, nccl",
    "bad argument on one rank": "CallRejected: ring_flex_attention: rank 1: q must be 4-D [batch, heads, "
                                "local_seq_len, head_dim], got shape (2, 4, 8)",
    "bad layout name on one rank": "CallRejected: ring_flex_attention: rank 1: layout must be one of "
                                   "('contiguous', 'zigzag', 'striped') or a ringflex.Sharding, got 'zigzig'",
    "mask_mod reading past a captured tensor": (
        "CallRejected: ring_flex_attention: rank 1: ValueError: mask_mod reads index 10 of a captured tensor of "
        "shape (10,) (at q_idx = 10): a tensor a mod indexes by position must cover every position of the global "
        "sequence, not one rank's shard (while planning the ring, before any transfer)"),
    "score_mod reading past a captured tensor": "rank 0: ValueError: score_mod reads index 1 of a captured tensor of "
                                                "shape (1,) (at h = 1): it must have an entry for every batch "
                                                "element and head of the call",
    "long message on one rank": "CallRejected: ring_flex_attention: rank 1: ValueError: x" + "\u00e9" * 193 + "\ufffd",
    "mask_mod returning a constant of the wrong shape": "rank 0: ValueError: mask_mod returned a tensor of shape (5,) "
                                                        "for arguments of shape (1,)",
    "score_mod adding a constant of the wrong shape": "rank 0: ValueError: score_mod returned a tensor of shape (5,)",
    "score_mod raising without grad": "CallRejected: ring_flex_attention: rank 0: NameError: name 'undefined_bias' is "
                                      "not defined (while planning the ring, before any transfer)",
    "score_mod of the wrong shape without grad": "rank 0: ValueError: score_mod returned a tensor of shape (3,) for "
                                                 "arguments of shape (1, 2, 4, 10): it must return one value per score "
                                                 "element",
    "relative-position bias past its table": (
        "CallRejected: ring_flex_attention: rank 0: ValueError: score_mod reads index 21 of a captured tensor of shape "
        "(20,) (at q_idx = 10, kv_idx = 0): a tensor a mod indexes by q_idx and kv_idx together must cover every pair "
        "of the global sequence's positions (for q_idx - kv_idx, every distance), not one rank's shard (while planning "
        "the ring, before any transfer)"),
    "relative-position mask past its table": "rank 0: ValueError: mask_mod reads index 21 of a captured tensor of "
                                             "shape (20,) (at q_idx = 10, kv_idx = 0)",
    "bias by batch and head past its table": "rank 0: ValueError: score_mod reads index 1 of a captured tensor of shape "
                                             "(1,) (at b = 0, h = 1): it must have an entry for every batch element "
                                             "and head of the call",
    "untraceable score_mod reading past its table": "rank 0: IndexError: index 1 is out of bounds for dimension 0 with "
                                                    "size 1 (while planning the ring, before any transfer)",
    "untraceable mask_mod reading past its table": "rank 0: IndexError: index 1 is out of bounds for dimension 0 with "
                                                   "size 1 (while planning the ring, before any transfer)",
}


def test_every_rank_raises_the_same_clear_error():
    per_rank = run_world(WORLD, _mismatches, timeout=TIMEOUT)
    for name, expected in EXPECTED.items():
        texts = {r[name] for r in per_rank}
        assert len(texts) == 1, f"{name}: the ranks raised different errors: {texts}"
        text = texts.pop()
        assert text is not None and expected in text, f"{name}: got {text!r}, expected {expected!r}"
    assert all(r[name] < 1e-5 for r in per_rank for name in ("good call afterwards", "constant True", "constant 0-d"))


@pytest.mark.parametrize("call, expected", [
    (lambda q: ringflex.ring_flex_attention(q, q, "v"), "v must be a torch.Tensor, got str"),
    (lambda q: ringflex.ring_flex_attention(q.long(), q.long(), q.long()),
     "q must be float16, bfloat16, float32 or float64, got torch.int64"),
    (lambda q: ringflex.ring_flex_attention(*(q.to(torch.float8_e4m3fn),) * 3),
     "q must be float16, bfloat16, float32 or float64, got torch.float8_e4m3fn"),
    (lambda q: ringflex.ring_flex_attention(q, q.double(), q), "q, k and v must have one dtype"),
    (lambda q: ringflex.ring_flex_attention(q.to_sparse(), q, q), "q must be a dense (strided) tensor"),
    (lambda q: ringflex.ring_flex_attention(q[..., :0], q[..., :0], q), "q must have at least one head and a head dim > 0"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, scale=True), "scale must be a finite number or None, got True"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, scale=float("nan")), "scale must be a finite number or None"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, mask_mod=lambda b, h, q_idx: q_idx > 0),
     "mask_mod must take 4 arguments (b, h, q_idx, kv_idx), but it takes 3"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, score_mod=mods.causal),
     "score_mod must take 5 arguments (score, b, h, q_idx, kv_idx), but it takes 4"),
    (lambda q: ringflex.ring_flex_attention(q, q[:, :1], q, enable_gqa=True),
     "k and v must have the same heads and length"),
    (lambda q: ringflex.ring_flex_attention(q, q[:, :1], q[:, :1]), "pass enable_gqa=True"),
    (lambda q: ringflex.ring_flex_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3]),
     "local length of q (3) does not fit layout 'zigzag': it must be a multiple of 2"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, sinks=torch.zeros(3)),
     "sinks must be a floating-point tensor of one logit per query head, [2] on cpu, got torch.float32 of shape "
     "(3,) on cpu"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, sinks=[0.0, 0.0]),
     "sinks must be a floating-point tensor of one logit per query head, [2] on cpu, got list"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + LEARNABLE[h],
                                            backend="cudnn"),
     "backend='cudnn' cannot run this call: the score_mod reads a tensor that requires grad, and cuDNN's fused "
     "backward gives no gradient for it"),
    (lambda q: ringflex.ring_flex_attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + torch.sin(LEARNABLE[h])),
     "score_mod reads a tensor that requires grad, and ringflex finds such tensors only in mods it can trace: "
     "operation sin.default is not supported"),
])
def test_bad_arguments_are_rejected_clearly(call, expected):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="ring_flex_attention: ") as info:
        call(q)
    assert expected in str(info.value)


_GLOBAL_IDS = None


def _global_documents(b, h, q_idx, kv_idx):  # a mask that reads a module global
    return _GLOBAL_IDS[q_idx] == _GLOBAL_IDS[kv_idx]


def _debug_checks(rank, world_size):
    """RINGFLEX_DEBUG=1: what each injected fault makes every rank raise."""
    os.environ["RINGFLEX_DEBUG"] = "1"
    full, (q, k, v) = _inputs()
    results = {}
    for p in (q, k, v):
        p.requires_grad_()
    out = ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal)
    out.backward(torch.ones_like(out))
    os.environ["RINGFLEX_DEBUG"] = "0"
    plain = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = ringflex.ring_flex_attention(*plain, mask_mod=mods.causal)
    ref.backward(torch.ones_like(ref))
    results["debug equals plain"] = all(torch.equal(a, b) for a, b in
                                        zip([out] + [t.grad for t in (q, k, v)], [ref] + [t.grad for t in plain]))
    os.environ["RINGFLEX_DEBUG"] = "1"
    q, k, v = (t.detach() for t in (q, k, v))

    bad_k = k.clone()
    if rank == 1:
        bad_k[0, 1, 2, 3] = float("nan")
    results["nan input"] = _error_text(lambda: ringflex.ring_flex_attention(q, bad_k, v))

    doc_ids = mods.document_ids([4, 4, 4])
    if rank == 1:
        doc_ids = mods.document_ids([4, 2, 6])  # same shape, other values: only debug mode sees it
    results["captured values differ"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v, mask_mod=mods.document(doc_ids)))
    global _GLOBAL_IDS
    _GLOBAL_IDS = doc_ids  # the same, read from this module's globals
    results["global values differ"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v, mask_mod=_global_documents))

    ids = mods.document_ids([6, 6])
    mask = mods.document(ids)
    ringflex.ring_flex_attention(q, k, v, mask_mod=mask, layout="zigzag")  # planned and cached (in place)
    ids.data[:] = 0  # one document now, but .data does not bump the version the cache keys on
    results["stale plan"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v, mask_mod=mask, layout="zigzag"))

    from ringflex.parallel import fault
    original = fault.GuardedComm.exchange

    def corrupting(self, send, recv, shift=1, send_after=None):
        pending = original(self, send, recv, shift, send_after)

        class Corrupted:
            sent = pending.sent

            def wait(self_inner):
                pending.wait()
                recv[0].view(-1)[0] += 1
        return Corrupted()

    if rank == 1:
        fault.GuardedComm.exchange = corrupting
    # A fault inside the ring leaves its group failed: each of these gets a group of its own.
    group = dist.new_group(list(range(world_size)))
    results["corrupted transfer"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v, group=group))
    fault.GuardedComm.exchange = original

    group = dist.new_group(list(range(world_size)))
    g = q.clone().requires_grad_()
    out = ringflex.ring_flex_attention(g, k, v, group=group)
    upstream = torch.ones_like(out)
    if rank == 2:
        upstream[0, 0, 0, 0] = float("inf")
    results["non-finite gradient"] = _error_text(lambda: out.backward(upstream))
    return results


DEBUG_EXPECTED = {
    "nan input": "RingDebugError: ring_flex_attention: rank 1: k has 1 NaN/Inf values (the first at index (0, 1, 2, 3))",
    "captured values differ": "CallRejected: ring_flex_attention: the ranks disagree on the mask_mod",
    "global values differ": "CallRejected: ring_flex_attention: the ranks disagree on the mask_mod",
    "stale plan": "CallRejected: ring_flex_attention: rank 0: ValueError: the cached plan differs from a fresh plan",
    "corrupted transfer": "RingDebugError: ring_flex_attention: rank 1 received other bytes than rank 0 sent "
                          "(forward transfer 0, tensor 0)",
    "non-finite gradient": "RingDebugError: ring_flex_attention: rank 2 sent a block with NaN or +inf values "
                           "(backward transfer 1, tensor 0)",
}


def test_debug_mode_finds_faults_on_every_rank():
    per_rank = run_world(WORLD, _debug_checks, timeout=TIMEOUT)
    assert all(r["debug equals plain"] for r in per_rank)
    for name, expected in DEBUG_EXPECTED.items():
        texts = {r[name] for r in per_rank}
        assert len(texts) == 1, f"{name}: the ranks raised different errors: {texts}"
        text = texts.pop()
        assert text is not None and text.startswith(expected), f"{name}: got {text!r}, expected {expected!r}"


def test_debug_mode_checks_gradients_on_one_process(monkeypatch):
    monkeypatch.setenv("RINGFLEX_DEBUG", "1")
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = ringflex.ring_flex_attention(q, q, q)
    upstream = torch.ones_like(out)
    upstream[0, 1, 2, 3] = float("nan")
    with pytest.raises(RingDebugError, match=r"backward produced bad values: dq has \d+ NaN/Inf values"):
        out.backward(upstream)


def test_check_transfer_names_the_fault():
    from ringflex.parallel.debug import _check_transfer
    ok = [[1, 0, 11, 22, 1, 11, 22, 1]] * 2  # [phase, index] + sent (shape, bytes, finite) + received
    _check_transfer(ok, 3, "forward")
    with pytest.raises(RingDebugError, match="the ranks are at different transfers"):
        _check_transfer([ok[0], [2, 0] + ok[1][2:]], 3, "forward")
    with pytest.raises(RingDebugError, match="rank 1 received a block of another shape or dtype than rank 0"):
        _check_transfer([ok[0], ok[1][:5] + [99] + ok[1][6:]], 3, "forward")
    with pytest.raises(RingDebugError, match="rank 0 sent a block with NaN or \\+inf"):
        _check_transfer([ok[0][:4] + [0] + ok[0][5:], ok[1]], 3, "forward")
    # The backward ring passes blocks to the previous rank: rank r receives from rank r + 1.
    received = {1: 2, 2: 3, 3: 1}  # what each of three ranks sent -> what reached it, backwards
    three = [[2, 0, 11, sent, 1, 11, received[sent], 1] for sent in (1, 2, 3)]
    _check_transfer(three, 3, "backward", shift=-1)
    with pytest.raises(RingDebugError, match="rank 0 received other bytes than rank 2 sent"):
        _check_transfer(three, 3, "forward")
    three[0][6] = 9
    with pytest.raises(RingDebugError, match="rank 0 received other bytes than rank 1 sent"):
        _check_transfer(three, 3, "backward", shift=-1)


def test_lookups_of_a_mod_used_every_call_are_checked_once(monkeypatch):
    from ringflex.plan import blocks
    checked = []
    monkeypatch.setattr(blocks, "lookup_error", lambda graph, values: checked.append(graph.kind))
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    for _ in range(3):  # new tensors of the same shapes every call: their bounds are the same
        score_mod, mask_mod = mods.alibi(mods.alibi_slopes(4)), mods.document(mods.document_ids([5, 11]))
        ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    assert sorted(checked) == ["mask_mod", "score_mod"]
    nested = torch.tensor([0, 1, 1, 0]), torch.tensor([0, 1])
    for _ in range(2):  # a subscript that reads a tensor: checked again for new tensors only
        ringflex.ring_flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + nested[1][nested[0][h]])
    assert sorted(checked) == ["mask_mod", "score_mod", "score_mod"]


def test_a_bound_method_as_mod_is_named_once(monkeypatch, recwarn):
    """``self.score_mod`` is a new object at every access, and traces and plans are kept by the
    mod object: ringflex says once that such a mod is traced at every call."""
    from ringflex import config

    monkeypatch.setattr(config, "_WARNED", set())

    class Halved(torch.nn.Module):
        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score * 0.5

    model, q = Halved(), torch.randn(1, 2, 4, 8)
    for _ in range(2):
        ringflex.ring_flex_attention(q, q, q, score_mod=model.score_mod)
    messages = [str(w.message) for w in recwarn if "bound method" in str(w.message)]
    assert len(messages) == 1 and "Halved.score_mod), a new object at every access" in messages[0]


def _capture_errors(rank, world_size):
    """The errors of calls and a backward made while a CUDA graph is being captured (simulated:
    the check's own test of capture answers yes), before and after the ring's transport was
    chosen, and where one rank captures and the other does not."""
    from ringflex.parallel import comm, peer
    _, (q, k, v) = _inputs(heads=2)
    q.requires_grad_()
    group = dist.group.WORLD
    errors = {}
    comm.capturing = lambda t: True
    errors["before an eager call"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v))
    peer._TRANSPORTS[group] = None  # an eager call chose the process group's P2P
    errors["over the process group"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v))
    comm.capturing = lambda t: False
    out = ringflex.ring_flex_attention(q, k, v)
    comm.capturing = lambda t: True
    errors["backward"] = _error_text(lambda: out.sum().backward())
    peer._TRANSPORTS[group] = object()  # the copy engines, which capture
    comm.capturing = lambda t: rank == 0
    errors["one rank captures"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v))
    comm.capturing = lambda t: False
    del peer._TRANSPORTS[group]
    errors["eager again"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v))
    return errors


def test_a_ring_over_several_ranks_captures_only_on_the_copy_engines():
    """Where a replay could not repeat the transfers, every rank says why before any transfer."""
    for errors in run_world(2, _capture_errors, timeout=TIMEOUT):
        assert errors["before an eager call"].startswith(
            "CallRejected: ring_flex_attention: rank 0: a ring call over several ranks is captured in a CUDA graph "
            "only after an eager call on the same process group"), errors
        assert errors["over the process group"].startswith(
            "CallRejected: ring_flex_attention: rank 0: the ring's transfers go through the process group's P2P "
            "(gloo), which ringflex does not capture"), errors
        assert errors["backward"].startswith(
            "RuntimeError: ring_flex_attention backward: the ring's transfers go through the process group's P2P "
            "(gloo)"), errors
        assert errors["one rank captures"] == (
            "CallRejected: ring_flex_attention: the ranks disagree on the CUDA-graph capture (rank 0: capturing, "
            "rank 1: not capturing); every rank of the ring must make the same call"), errors
        assert errors["eager again"] is None


def _first_call_rejected(rank, world_size):
    """The first call on a group, rejected for one rank's argument, where building the
    transport is a collective (as on GPUs: simulated here on the CPU), then a good call."""
    from ringflex.parallel import comm, groups, peer

    def transport(group, device):  # the copy engines' first use: a collective of the group
        if group not in peer._TRANSPORTS:
            groups.gather_objects(group, None)
            peer._TRANSPORTS[group] = None  # then the process group's P2P, as on a CPU
        return peer._TRANSPORTS[group]

    peer.transport, comm.RingComm._copy_engines = transport, lambda self, device: peer.transport(self.group, device)
    group = dist.new_group(list(range(world_size)))
    _, (q, k, v) = _inputs()
    scale = float("nan") if rank == 1 else None
    errors = {"first": _error_text(lambda: ringflex.ring_flex_attention(q, k, v, scale=scale, group=group))}
    dist.barrier()  # on the default group: a rank left in the group's collective would never reach it
    errors["again"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v, group=group))
    return errors, peer.built(group)


def test_a_groups_first_call_rejected_leaves_no_rank_in_the_transports_collective():
    """Building the ring's transport is a collective (its first use on a group, on GPUs): a
    rank whose first call is rejected never joins it, so no rank starts it before the ranks
    agreed on the call; every rank raises the same error, and the next call builds it."""
    for errors, built in run_world(WORLD, _first_call_rejected, timeout=60):
        assert errors["first"] == ("CallRejected: ring_flex_attention: rank 1: scale must be a finite number or "
                                   "None, got nan"), errors
        assert errors["again"] is None and built, errors


def _cold_capture_errors(rank, world_size):
    """A call captured (simulated) before any eager call with its mask and shapes, and after one."""
    from ringflex.parallel import comm, peer
    _, (q, k, v) = _inputs(heads=2)
    window = mods.sliding_window(3)
    peer._TRANSPORTS[dist.group.WORLD] = object()  # the copy engines, which capture
    comm.capturing = lambda t: True
    errors = {"cold": _error_text(lambda: ringflex.ring_flex_attention(q, k, v, mask_mod=window))}
    comm.capturing = lambda t: False
    ringflex.ring_flex_attention(q, k, v, mask_mod=window)
    comm.capturing = lambda t: True
    errors["warm"] = _error_text(lambda: ringflex.ring_flex_attention(q, k, v, mask_mod=window))
    comm.capturing = lambda t: False
    del peer._TRANSPORTS[dist.group.WORLD]
    return errors


def test_a_call_captured_before_it_ran_eagerly_is_refused_clearly():
    """Planning works on the host and the device at once, which a CUDA graph cannot capture (on
    an H100 the first call failed inside the capture with a host-to-device copy, or invalidated
    it): captured before an eager call with the same mask and shapes, every rank says so."""
    for errors in run_world(2, _cold_capture_errors, timeout=TIMEOUT):
        assert errors["cold"] == (
            "CallRejected: ring_flex_attention: rank 0: RuntimeError: ring_flex_attention is being captured in a "
            "CUDA graph, but no call with this mask, these shapes and this backend ran before: a first call plans "
            "the ring and builds its kernels, which a capture cannot hold. Run the call once eagerly before "
            "capturing (torch.cuda.make_graphed_callables does) (while planning the ring, before any transfer)"), errors
        assert errors["warm"] is None, errors


def test_processes_torchrun_launched_without_a_process_group_are_warned(monkeypatch, recwarn):
    """WORLD_SIZE=2 but no process group: every process would work alone, with no error
    anywhere; shard and the attention say so, once."""
    from ringflex import config

    monkeypatch.setattr(config, "_WARNED", set())
    monkeypatch.setenv("WORLD_SIZE", "2")
    q = torch.randn(1, 2, 8, 4)
    for _ in range(2):
        ringflex.ring_flex_attention(ringflex.shard(q, 2), q, q)
    messages = [str(w.message) for w in recwarn if "WORLD_SIZE" in str(w.message)]
    assert len(messages) == 1 and "init_process_group" in messages[0]


def _interrupted_while_planning(rank, world_size):
    """Rank 1's mask raises KeyboardInterrupt while it plans the call; then two good calls."""
    full, (q, k, v) = _inputs()

    def interrupting(b, h, q_idx, kv_idx):
        raise KeyboardInterrupt("stopped by the user")

    try:
        ringflex.ring_flex_attention(q, k, v, mask_mod=interrupting if rank == 1 else mods.causal)
        first = None
    except BaseException as e:  # noqa: BLE001 (the test compares what each rank raised)
        first = f"{type(e).__name__}: {e}"
    expected = ringflex.shard(attention(*full, mask_mod=mods.causal), 2)
    errors = [(ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal) - expected).abs().max().item()
              for _ in range(2)]
    return first, errors


def test_an_interruption_while_planning_rejects_the_call_on_every_rank():
    """The interrupted rank raises the interruption itself, after the others learnt of it (it
    left before the exchange, which then paired their call with its next one: calls matched
    up wrongly, then a hang); the group stays in step."""
    for rank, (first, errors) in enumerate(run_world(WORLD, _interrupted_while_planning, timeout=TIMEOUT)):
        if rank == 1:
            assert first == "KeyboardInterrupt: stopped by the user"
        else:
            assert first.startswith("CallRejected: ring_flex_attention: rank 1: KeyboardInterrupt: stopped by the "
                                    "user"), first
        assert max(errors) < 1e-5, (rank, errors)


def _numpy_windows(rank, world_size):
    np = pytest.importorskip("numpy")
    full, (q, k, v) = _inputs()
    window = types.SimpleNamespace(size=np.int64(2))
    mask = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < window.size)  # noqa: E731
    results = {"other window on rank 1": _error_text(lambda: ringflex.ring_flex_attention(
        q, k, v, mask_mod=mods.sliding_window(np.int64(3 if rank == 1 else 2))))}
    for size in (2, 5):  # set on the object between calls: planned anew
        window.size = np.int64(size)
        expected = ringflex.shard(attention(*full, mask_mod=mods.sliding_window(size)), 2)
        results[size] = (ringflex.ring_flex_attention(q, k, v, mask_mod=mask) - expected).abs().max().item()
    return results


def test_numpy_numbers_a_mod_captures_count_by_value():
    """A window held as a numpy integer was fingerprinted by its type alone: ranks with other
    windows passed the check (1.35 off), and a window set anew reused the old plan (0.29 off)."""
    pytest.importorskip("numpy")
    for results in run_world(WORLD, _numpy_windows, timeout=TIMEOUT):
        assert "disagree on the mask_mod" in results["other window on rank 1"], results
        assert results[2] < 1e-5 and results[5] < 1e-5, results
