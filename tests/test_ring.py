"""The ring against the single-process truth: world sizes 1-4, every layout, fp32 and bf16,
every mask / score_mod of the matrix, forward and backward."""
import contextlib
import types

import pytest
import torch

import ringflex
from support.cases import cases, make_inputs
from support.calls import agreed_calls
from support.harness import run_world
from support.oracle import attention, visible_extent
from ringflex.kernels.reference import ReferenceKernel
from ringflex.plan.blocks import BlockKind

LOCAL_LEN = 12  # query tokens per rank (even, so zigzag fits; K/V: 6 for cross-attention)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _lend_any_row():
    """Ranks lend rows wherever that evens their work (``lending``): at these sizes the
    granularity of real calls would lend none."""
    from ringflex.plan import lending
    lending.QUANTUM = 1


def _max_errors(rank, world_size, layout):
    """Worst absolute error of output and q/k/v gradients, per (case, dtype), on this rank."""
    _lend_any_row()
    seq_len = LOCAL_LEN * world_size
    errors = {}
    for name, case in cases(seq_len).items():
        for dtype in TOLERANCE:
            q, k, v, dout = make_inputs(case, seq_len, dtype=dtype)
            full = [t.double().requires_grad_() for t in (q, k, v)]
            expected = attention(*full, case.score_mod, case.mask_mod)
            expected.backward(dout.double())
            local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
            out = ringflex.ring_flex_attention(*local, score_mod=case.score_mod, mask_mod=case.mask_mod,
                                               layout=layout, enable_gqa=True, backend="reference")
            out.backward(ringflex.shard(dout, 2, layout=layout))
            got = [out] + [t.grad for t in local]
            want = [expected] + [t.grad for t in full]
            assert all(g.dtype == dtype for g in got), name
            errors[name, str(dtype)] = [
                (g.double() - ringflex.shard(w, 2, layout=layout)).abs().max().item() / max(1.0, w.abs().max().item())
                for g, w in zip(got, want)]
            assert not any(torch.isnan(g).any() for g in got), name
    return errors


@pytest.mark.parametrize("layout", ringflex.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_matches_single_process(world_size, layout):
    failures = []
    for rank, errors in enumerate(run_world(world_size, _max_errors, layout)):
        for (name, dtype), errs in errors.items():
            tol = TOLERANCE[getattr(torch, dtype.split(".")[1])]
            if max(errs) > tol:
                failures.append(f"rank {rank} {name} {dtype}: out/dq/dk/dv errors {errs} > {tol}")
    assert not failures, "\n".join(failures)


def _lse_gradient_errors(rank, world_size, layout):
    """Worst errors of the LSE and of dq/dk/dv when the loss reads the LSE, with the output
    or alone, per (case, dtype, loss), on this rank."""
    _lend_any_row()
    seq_len = LOCAL_LEN * world_size
    errors = {}
    for name, case in cases(seq_len).items():
        for dtype, lse_only in [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]:
            q, k, v, dout = make_inputs(case, seq_len, dtype=dtype)
            dlse = torch.randn(dout.shape[:3], generator=torch.Generator().manual_seed(1))
            full = [t.double().requires_grad_() for t in (q, k, v)]
            expected = attention(*full, case.score_mod, case.mask_mod, return_lse=True)
            local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
            got = ringflex.ring_flex_attention(*local, score_mod=case.score_mod, mask_mod=case.mask_mod, layout=layout,
                                               enable_gqa=True, backend="reference", return_lse=True)
            grads = [dout, dlse]
            for outputs, upstream in ((expected, [dout.double(), dlse.double()]),
                                      (got, [ringflex.shard(t, 2, layout=layout) for t in grads])):
                torch.autograd.backward(outputs[1:] if lse_only else outputs, upstream[1:] if lse_only else upstream)
            want_lse = ringflex.shard(expected[1], 2, layout=layout)
            assert torch.equal(got[1].isneginf(), want_lse.isneginf()), name
            lse_error = (got[1] - want_lse).nan_to_num(0.0).abs().max().item()
            want = [torch.zeros_like(w) if w.grad is None else w.grad for w in full]  # dv of the LSE alone
            errors[name, str(dtype), lse_only] = [lse_error] + [
                (g.grad.double() - ringflex.shard(w, 2, layout=layout)).abs().max().item() / max(1.0, w.abs().max().item())
                for g, w in zip(local, want)]
    return errors


@pytest.mark.parametrize("layout", ringflex.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 3])
def test_gradients_through_the_lse_match_single_process(world_size, layout):
    """flex_attention's LSE is differentiable: a loss that reads it (a z-loss, attention sinks,
    merging with other attention) gets the same gradients from the ring as from one process."""
    failures = []
    for rank, errors in enumerate(run_world(world_size, _lse_gradient_errors, layout)):
        for (name, dtype, lse_only), errs in errors.items():
            tol = TOLERANCE[getattr(torch, dtype.split(".")[1])]
            if max(errs) > tol:
                failures.append(f"rank {rank} {name} {dtype} {'lse only' if lse_only else 'out and lse'}: "
                                f"lse/dq/dk/dv errors {errs} > {tol}")
    assert not failures, "\n".join(failures)


def test_rows_that_see_no_key_take_no_lse_gradient():
    """Whatever a loss makes of the LSE of a row that sees nothing (-inf), that row adds
    nothing to the gradients (an infinite dlse there would spread NaN to every key)."""
    case = cases(8)["late_queries"]
    q, k, v, _ = make_inputs(case, 8, dtype=torch.float64)
    grads = []
    for at_empty_rows in (0.0, float("-inf")):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        _, lse = ringflex.ring_flex_attention(*inputs, mask_mod=case.mask_mod, return_lse=True)
        lse.backward(torch.where(lse.isneginf(), at_empty_rows, 1.0))
        grads.append([t.grad for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _sink_errors(rank, world_size, layout):
    """Per (case, loss): the worst error of the output, LSE, dq/dk/dv and the sinks' gradient
    (summed over the ranks), with attention sinks, against the definition in one process."""
    _lend_any_row()
    import torch.distributed as dist

    seq_len = LOCAL_LEN * world_size
    errors = {}
    for name, case in cases(seq_len).items():
        q, k, v, dout = make_inputs(case, seq_len, dtype=torch.float64)
        dlse = torch.randn(dout.shape[:3], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        sinks = torch.randn(case.q_heads, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        for reads, part in (("output", slice(0, 1)), ("output and LSE", slice(0, 2)), ("LSE", slice(1, 2))):
            full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            want = attention(*full[:3], case.score_mod, case.mask_mod, return_lse=True, sinks=full[3])
            torch.autograd.backward(want[part], [dout, dlse][part])
            local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)] + [
                sinks.clone().requires_grad_()]
            got = ringflex.ring_flex_attention(*local[:3], score_mod=case.score_mod, mask_mod=case.mask_mod,
                                               layout=layout, enable_gqa=True, return_lse=True, sinks=local[3])
            torch.autograd.backward(got[part], [ringflex.shard(t, 2, layout=layout) for t in (dout, dlse)][part])
            dist.all_reduce(local[3].grad)
            pairs = [(got[0], ringflex.shard(want[0], 2, layout=layout)), (got[1], ringflex.shard(want[1], 2, layout=layout))]
            pairs += [(g.grad, ringflex.shard(_grad(w), 2, layout=layout)) for g, w in zip(local[:3], full[:3])]
            pairs += [(local[3].grad, full[3].grad)]
            errors[name, reads] = [(g - w).abs().max().item() / max(1.0, w.abs().max().item()) for g, w in pairs]
    return errors


@pytest.mark.parametrize("layout", ringflex.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 3])
def test_attention_sinks_match_single_process(world_size, layout):
    """Sinks (gpt-oss: a logit per head in every softmax's denominator, with no value) give the
    definition's output, LSE and gradients, the sinks' own included, for every case."""
    failures = [f"rank {rank} {name} (the loss reads the {reads}): out/lse/dq/dk/dv/dsinks errors {errs}"
                for rank, errors in enumerate(run_world(world_size, _sink_errors, layout))
                for (name, reads), errs in errors.items() if max(errs) > 1e-10]
    assert not failures, "\n".join(failures)


def _learnable_mods(seq_len: int):
    """Score mods that read tensors requiring grad, as a model's learnable biases do: a leaf
    table of relative-position biases, and per-head slopes computed from one (not a leaf)."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(4, 9, dtype=torch.float64, generator=g).requires_grad_()
    raw = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_()
    slopes = raw.exp()

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(-4, 4) + 4]

    def learnable_alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    documents = cases(seq_len)["documents"].mask_mod
    return [table, raw], {"relative bias": (relative_bias, None), "relative bias, documents": (relative_bias, documents),
                          "learnable alibi, causal": (learnable_alibi, ringflex.mods.causal)}


def _tensor_gradient_errors(rank, world_size, layout):
    """Per (mod, loss): the worst error of dq/dk/dv and of the gradients of the tensors the
    score_mod reads (summed over the ranks, as a gradient reduction over them does)."""
    _lend_any_row()
    import torch.distributed as dist

    seq_len = LOCAL_LEN * world_size
    q, k, v, dout = make_inputs(cases(seq_len)["no_mask"], seq_len, dtype=torch.float64)
    dlse = torch.randn(dout.shape[:3], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    errors = {}
    for reads_lse in (False, True):
        for name in _learnable_mods(seq_len)[1]:
            # one process, and the ring, each with its own copies of the same learnable tensors
            (leaves, named), (ring_leaves, ring_named) = _learnable_mods(seq_len), _learnable_mods(seq_len)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            want_out, want_lse = attention(*full, *named[name], return_lse=True)
            torch.autograd.backward([want_out, want_lse][:1 + reads_lse], [dout, dlse][:1 + reads_lse])
            local = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
            score_mod, mask_mod = ring_named[name]
            out, lse = ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod, layout=layout,
                                                    backend="reference", return_lse=True)
            upstream = [ringflex.shard(t, 2, layout=layout) for t in (dout, dlse)]
            torch.autograd.backward([out, lse][:1 + reads_lse], upstream[:1 + reads_lse])
            got = [t.grad for t in local] + [_grad(t) for t in ring_leaves]
            for t in got[3:]:
                dist.all_reduce(t)
            want = [ringflex.shard(t.grad, 2, layout=layout) for t in full] + [_grad(t) for t in leaves]
            errors[name, reads_lse] = [(g - w).abs().max().item() / max(1.0, w.abs().max().item())
                                       for g, w in zip(got, want)]
    return errors


def _grad(t):
    """``t``'s gradient, zeros where no mod read it."""
    return torch.zeros_like(t) if t.grad is None else t.grad


@pytest.mark.parametrize("layout", ringflex.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gradients_of_tensors_the_score_mod_reads_match_single_process(world_size, layout):
    """A learnable bias read by the score_mod gets its gradient, as with flex_attention: each
    rank its share, which add up to one process's gradient."""
    failures = [f"rank {rank} {name} (loss reads the LSE: {reads_lse}): dq/dk/dv/tensor errors {errs}"
                for rank, errors in enumerate(run_world(world_size, _tensor_gradient_errors, layout))
                for (name, reads_lse), errs in errors.items() if max(errs) > 1e-10]
    assert not failures, "\n".join(failures)


def _second_derivative(rank, world_size):
    """First-order gradients with ``create_graph=True``, and what differentiating them raises."""
    q, k, v = (ringflex.shard(t, 2).requires_grad_() for t in make_inputs(cases(8 * world_size)["causal"], 8 * world_size,
                                                                          dtype=torch.float64)[:3])
    mask = ringflex.mods.causal
    plain = torch.autograd.grad(ringflex.ring_flex_attention(q, k, v, mask_mod=mask).sum(), (q, k, v))
    graphed = torch.autograd.grad(ringflex.ring_flex_attention(q, k, v, mask_mod=mask).sum(), (q, k, v),
                                  create_graph=True)
    with pytest.raises(RuntimeError) as info:
        sum((g ** 2).sum() for g in graphed).backward()
    return all(torch.equal(a, b.detach()) for a, b in zip(plain, graphed)), str(info.value)


_GLOBAL_IDS = None
_GLOBAL_CONFIG = types.SimpleNamespace(window=2)


def _global_documents(b, h, q_idx, kv_idx):  # a mask that reads a module global
    return _GLOBAL_IDS[q_idx] == _GLOBAL_IDS[kv_idx]


def _global_config_window(b, h, q_idx, kv_idx):  # ... or an attribute of a global object
    return (q_idx >= kv_idx) & (q_idx - kv_idx < _GLOBAL_CONFIG.window)


class _Documents:
    """A mask as a callable object, its document ids an attribute."""

    def __init__(self, ids):
        self.ids = ids

    def __call__(self, b, h, q_idx, kv_idx):
        return self.ids[q_idx] == self.ids[kv_idx]


class _WindowModule(torch.nn.Module):
    """A mask as an nn.Module: calling it runs its forward, which reads the window attribute."""

    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < self.window)


def _what_the_mask_reads_changes_every_call(rank, world_size):
    """Per way of changing what a mask reads between calls, the error of each call."""
    global _GLOBAL_IDS
    q, k, v, _ = make_inputs(cases(16)["no_mask"], 16, dtype=torch.float64)
    local = [ringflex.shard(t, 2) for t in (q, k, v)]
    documents, config, module = _Documents(None), types.SimpleNamespace(window=2), _WindowModule(2)
    in_closure = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < config.window)  # noqa: E731
    errors = {}
    for lengths, window in (([8, 8], 2), ([4, 12], 16), ([13, 3], 5)):  # a new packed batch, a new window
        _GLOBAL_IDS = documents.ids = ringflex.mods.document_ids(lengths)
        _GLOBAL_CONFIG.window = config.window = module.window = window
        for name, mask in (("global reassigned", _global_documents), ("object's attribute set", documents),
                           ("module's attribute set", module),
                           ("global object's attribute set", _global_config_window),
                           ("closure's object's attribute set", in_closure)):
            out = ringflex.ring_flex_attention(*local, mask_mod=mask)
            want = ringflex.shard(attention(q, k, v, None, mask), 2)
            errors.setdefault(name, []).append((out - want).abs().max().item())
    return errors


def test_what_the_mask_reads_may_change_between_calls():
    """A mask that reads document ids from a module global reassigned at every call, or a
    window or ids from an attribute set on an object: each call plans what it sees (the trace
    and the plans were cached by the function alone: the third call ran the first's documents
    on one rank, 0.78 off; an object's attributes were not looked at: 2.4 off; an nn.Module's,
    whose call runs its forward, neither)."""
    for errors in run_world(2, _what_the_mask_reads_changes_every_call):
        assert all(max(e) < 1e-12 for e in errors.values()), errors


def _plans_of_repeated_calls(rank, world_size):
    """Over calls that repeat: how many times the ring had planned hops and made its offer to
    lend after each call, and each call's error."""
    import os
    from ringflex.plan import blocks, lending
    planned, offered, plan_hops, offer = [], [], blocks.plan_hops, lending.offer
    blocks.plan_hops = lambda *args, **kwargs: planned.append(1) or plan_hops(*args, **kwargs)
    lending.offer = lambda *args, **kwargs: offered.append(1) or offer(*args, **kwargs)
    try:
        q, k, v, _ = make_inputs(cases(16)["no_mask"], 16, dtype=torch.float64)
        local = [ringflex.shard(t, 2) for t in (q, k, v)]
        ids = ringflex.mods.document_ids([5, 11])
        documents = ringflex.mods.document(ids, causal_within=False)
        counts, errors = [], []
        for change in (None, None, "ids written in place", None, "lending off"):
            if change == "ids written in place":
                ids.copy_(ringflex.mods.document_ids([9, 7]))
            if change == "lending off":
                os.environ["RINGFLEX_LENDING"] = "0"
            out = ringflex.ring_flex_attention(*local, mask_mod=documents)
            errors.append((out - ringflex.shard(attention(q, k, v, None, documents), 2)).abs().max().item())
            counts.append((len(planned), len(offered)))
        return counts, errors
    finally:
        blocks.plan_hops, lending.offer = plan_hops, offer
        os.environ.pop("RINGFLEX_LENDING", None)


def test_a_repeated_call_plans_once():
    """A training loop's call plans its steps and the next rank's hops and makes its offer to
    lend at its first call only (``api._CALL_PLANS``); new document ids written into the same
    tensor plan anew, and another lending setting makes the offer anew."""
    for counts, errors in run_world(2, _plans_of_repeated_calls):
        assert max(errors) < 1e-12, errors
        first, again, written, written_again, lending_off = counts
        assert first[0] > 0 and first[1] == 1 and again == first, counts
        assert written[0] > again[0] and written[1] == 2 and written_again == written, counts
        assert lending_off == (written[0], 3), counts


def _changed_before_backward(rank, world_size):
    """What backward says where the documents a mask reads change between forward and backward
    (as training code that sets the next batch's ids before the last backward might)."""
    q, k, v, _ = make_inputs(cases(16)["no_mask"], 16, dtype=torch.float64)
    local = [ringflex.shard(t, 2).requires_grad_() for t in (q, k, v)]
    documents = _Documents(ringflex.mods.document_ids([5, 11]))
    out = ringflex.ring_flex_attention(*local, mask_mod=documents)
    documents.ids = ringflex.mods.document_ids([9, 7])
    with pytest.raises(RuntimeError) as raised:
        out.sum().backward()
    return str(raised.value)


def test_a_mask_changed_before_its_backward_raises():
    """Backward evaluates the mask again: with the new documents it gave gradients 32 off."""
    for message in run_world(2, _changed_before_backward):
        assert "what the mask_mod reads changed since its forward" in message, message


def test_a_second_derivative_raises_instead_of_being_zero():
    """A gradient penalty differentiates the gradients: the ring has no second derivative, and
    says so where they are differentiated, instead of treating them as constants."""
    for same, message in run_world(2, _second_derivative):
        assert same
        assert "ring_flex_attention has no second derivative" in message


def test_ring_with_blocks_split_into_small_tiles(monkeypatch):
    """The planner's splitting of sparse blocks (normally >= 1024 tokens) at toy sizes."""
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    for rank, errors in enumerate(run_world(2, _max_errors, "zigzag")):
        for (name, dtype), errs in errors.items():
            assert max(errs) <= TOLERANCE[getattr(torch, dtype.split(".")[1])], (rank, name, dtype, errs)


class _RoundingKernel(ReferenceKernel):
    """The reference kernel returning its results in the input dtype, as cuDNN does."""

    def grad_dtype(self, dtype):
        return dtype

    def forward(self, q, *args):
        out, lse, res = super().forward(q, *args)
        return out.to(q.dtype), lse, res

    def backward(self, q, *args, **kwargs):
        return tuple(g.to(q.dtype) for g in super().backward(q, *args, **kwargs))


def _with_kernel(kernel):
    """Makes every ring call of this process use ``kernel``."""
    import ringflex.api
    ringflex.api.select_kernel = lambda *args, **kwargs: kernel


@contextlib.contextmanager
def _recorded_transfers(describe):
    """Yields a list that gets ``describe(comm, send, shift)`` of every transfer made inside."""
    from ringflex.parallel import fault
    seen, original = [], fault.GuardedComm.exchange

    def recording(self, send, recv, shift=1, send_after=None):
        seen.append(describe(self, send, shift))
        return original(self, send, recv, shift, send_after)

    fault.GuardedComm.exchange = recording
    try:
        yield seen
    finally:
        fault.GuardedComm.exchange = original


def _transfers(rank, world_size, kernel=None):
    """The transfers of one forward and one backward: (pass, shift, tensors, dtypes)."""
    if kernel is not None:
        _with_kernel(kernel)
    with _recorded_transfers(lambda comm, send, shift: (comm.phase, shift, len(send),
                                                        tuple(str(t.dtype) for t in send))) as seen:
        q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        ringflex.ring_flex_attention(q, k, v, layout="contiguous").sum().backward()
    return seen


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_backward_sends_each_share_straight_to_the_owner(world_size):
    """Every block comes straight from its owner: forward brings the block of the rank d back
    from it at step d. Backward starts on the block forward ended on and runs the steps in
    reverse, to the own block: N - 2 K/V transfers (the last block was kept, the own block is
    here), and at each other step every rank's share of the block it holds goes straight to
    that block's owner, in the dtype the kernel returned it in (fp32 for the reference
    kernel): no partial sum travels on, and no finished gradient, which nothing could hide behind."""
    bf16, fp32 = ("torch.bfloat16",) * 2, ("torch.float32",) * 2
    expected = sorted([("forward", distance, 2, bf16) for distance in range(1, world_size)]
                      + [("backward", distance, 2, bf16) for distance in range(1, world_size - 1)]
                      + [("backward", -distance, 2, fp32) for distance in range(1, world_size)])
    for seen in run_world(world_size, _transfers):
        assert sorted(seen) == expected


def _debug_mode_errors(rank, world_size):
    """A causal and a document mask over zigzag in debug mode (``RINGFLEX_DEBUG=1``: every
    transfer checked across the ranks), fwd+bwd in fp64: the worst error against one process."""
    import os
    os.environ["RINGFLEX_DEBUG"] = "1"
    seq_len = LOCAL_LEN * world_size
    worst = 0.0
    for name in ("causal", "documents"):
        case = cases(seq_len)[name]
        q, k, v, dout = (t.double() for t in make_inputs(case, seq_len, dtype=torch.float32))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*full, case.score_mod, case.mask_mod).backward(dout)
        local = [ringflex.shard(t, 2, layout="zigzag").requires_grad_() for t in (q, k, v)]
        out = ringflex.ring_flex_attention(*local, score_mod=case.score_mod, mask_mod=case.mask_mod,
                                           layout="zigzag", enable_gqa=True)
        out.backward(ringflex.shard(dout, 2, layout="zigzag"))
        worst = max([worst] + [(a.grad - ringflex.shard(b.grad, 2, layout="zigzag")).abs().max().item()
                               for a, b in zip(local, full)])
    return worst


def test_every_share_checks_out_in_debug_mode():
    """On four ranks backward sends dK/dV shares over distances 1 to 3; the debug mode checks
    that each rank received what the rank that many after it sent (no RingDebugError), and
    the gradients are one process's."""
    assert max(run_world(4, _debug_mode_errors)) < 1e-10


@pytest.mark.parametrize("world_size", [2, 4])
def test_shares_travel_as_the_kernel_returned_them(world_size):
    """A kernel that returns dk/dv in the input dtype (cuDNN) sends its shares in that dtype:
    half the bytes of fp32 and nothing rounded twice."""
    bf16 = ("torch.bfloat16",) * 2
    expected = sorted([("forward", distance, 2, bf16) for distance in range(1, world_size)]
                      + [("backward", distance, 2, bf16) for distance in range(1, world_size - 1)]  # K/V blocks
                      + [("backward", -distance, 2, bf16) for distance in range(1, world_size)])
    for seen in run_world(world_size, _transfers, _RoundingKernel()):
        assert sorted(seen) == expected


def _rounding_kernel_errors(rank, world_size, layout):
    _with_kernel(_RoundingKernel())
    return _max_errors(rank, world_size, layout)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_with_a_kernel_that_rounds_its_results(world_size):
    """With hop results in the input dtype (as cuDNN returns them) the ring still matches."""
    for rank, errors in enumerate(run_world(world_size, _rounding_kernel_errors, "zigzag")):
        for (name, dtype), errs in errors.items():
            assert max(errs) <= TOLERANCE[getattr(torch, dtype.split(".")[1])], (rank, name, dtype, errs)


def _rounding_kernel_lse_errors(rank, world_size, layout):
    _with_kernel(_RoundingKernel())
    return _lse_gradient_errors(rank, world_size, layout)


@pytest.mark.parametrize("world_size", [2, 3])
def test_lse_gradients_with_a_kernel_that_rounds_its_results(world_size):
    """The LSE's share joins the hop's dq and dk in fp32 before the rank's dK/dV share leaves,
    in the input dtype as cuDNN returns it: the ring still matches."""
    for rank, errors in enumerate(run_world(world_size, _rounding_kernel_lse_errors, "zigzag")):
        for (name, dtype, lse_only), errs in errors.items():
            assert max(errs) <= TOLERANCE[getattr(torch, dtype.split(".")[1])], (rank, name, dtype, lse_only, errs)


class _WholeBlockKernel(ReferenceKernel):
    """The reference kernel, claiming to skip the empty parts of any block itself: each block
    reaches it whole, trimmed to the rows and keys where the mask holds somewhere."""

    def plans_within(self, mask_mod, has_score_mod, q_seg, kv_seg, device):
        # over the batches and heads of the test cases (make_inputs: 2 and at most 4)
        return visible_extent(mask_mod, q_seg, kv_seg, batch=2, heads=4, device=device)


def _whole_block_errors(rank, world_size, layout):
    _with_kernel(_WholeBlockKernel())
    return _max_errors(rank, world_size, layout)


@pytest.mark.parametrize("world_size, layout", [(2, "zigzag"), (2, "contiguous"), (3, "contiguous"), (4, "zigzag"),
                                               (4, "striped")])
def test_ring_with_blocks_the_kernel_keeps_whole(world_size, layout, monkeypatch):
    """Sparse blocks that the kernel plans within reach it unsplit, trimmed to the part it
    computes, and only the rows of a block that some rank reads travel: the same results."""
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    for rank, errors in enumerate(run_world(world_size, _whole_block_errors, layout)):
        for (name, dtype), errs in errors.items():
            assert max(errs) <= TOLERANCE[getattr(torch, dtype.split(".")[1])], (rank, name, dtype, errs)


def _saved_block(rank, world_size):
    """Bytes of memory behind the block forward saves for backward, and the block's own bytes."""
    from ringflex import mods
    _with_kernel(_WholeBlockKernel())
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    out = ringflex.ring_flex_attention(q, k, v, mask_mod=mods.sliding_window(3), layout="contiguous")
    last_k = out.grad_fn.saved_tensors[8]  # q, k, v, out, lse, res, sinks, borrowed queries, then the blocks kept
    return last_k.untyped_storage().nbytes(), last_k.numel() * last_k.element_size(), last_k.shape[2]


def test_forward_saves_only_the_rows_of_the_block_that_travelled():
    """A window of 3 over the contiguous layout: the block forward ends on holds the 2 rows
    that travelled (none for the block no rank reads), saved in memory of their own size,
    not as a view that keeps the whole-block receive buffer (8 rows) alive until backward."""
    for rank, (memory, own, length) in enumerate(run_world(3, _saved_block)):
        assert (memory, length) == (own, 2 if rank else 0), (rank, memory, own, length)


def _kept_block(rank, world_size):
    """Whether the block forward keeps for backward lies where its hop read it (not copied
    out of a larger buffer), and its rows, over a window over the contiguous layout."""
    from ringflex import mods
    kernel, read = _WholeBlockKernel(), []
    forward = kernel.forward

    def recording(q, k, *args, **kwargs):
        read.append(k.untyped_storage().data_ptr())
        return forward(q, k, *args, **kwargs)

    kernel.forward = recording
    _with_kernel(kernel)
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    out = ringflex.ring_flex_attention(q, k, v, mask_mod=mods.sliding_window(3), layout="contiguous")
    kept_k = out.grad_fn.saved_tensors[8]  # after q, k, v, out, lse, res, sinks, borrowed queries
    return kept_k.untyped_storage().data_ptr() == read[-1], kept_k.shape[2]


def test_a_ring_of_one_transfer_receives_the_block_it_keeps_into_memory_of_its_rows():
    """On two ranks forward keeps the block it receives: its receive buffer holds just the
    rows that travel (2 of 8 for a window of 3), so backward reads the very memory forward's
    hop read, not a copy out of a whole-block buffer."""
    in_place, rows_kept = run_world(2, _kept_block)[1]  # rank 1 reads the rank before it
    assert in_place and rows_kept == 2


def _kept_blocks(rank, world_size):
    """Rows, and bytes of memory behind them, of each K block forward keeps for backward over
    a window over zigzag (the halves it received, joined)."""
    from ringflex import mods
    _with_kernel(_WholeBlockKernel())
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    out = ringflex.ring_flex_attention(q, k, v, mask_mod=mods.sliding_window(4), layout="zigzag")
    kept_k = out.grad_fn.saved_tensors[8::2]  # after q, k, v, out, lse, res, sinks, borrowed queries: K, V of each
    return [(t.shape[2], t.untyped_storage().nbytes() // (t.shape[1] * t.shape[3] * t.element_size())) for t in kept_k]


def test_forward_keeps_the_halves_it_received_as_one_block_of_their_size(monkeypatch):
    """A window of 4 over zigzag on 4 ranks (chunks of 4 of 8 rows): the halves a rank receives
    from both neighbours fill one block, so they arrive in one step as one block, which forward
    keeps in memory of its own size (not the whole-block buffers they arrived in)."""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    for rank, kept in enumerate(run_world(4, _kept_blocks)):
        ahead, behind = (4 if rank else 0), (4 if rank < 3 else 0)  # rows read of the ranks 1 and 3 back
        assert kept == [(ahead + behind, ahead + behind)], (rank, kept)


def _gradient_storage(rank, world_size):
    """Where the ring's gradients live, and where the kernel's last backward put its own."""
    from ringflex.parallel import ring
    kernel, returned = ReferenceKernel(), {}
    kernel_backward, ring_backward = kernel.backward, ring.ring_backward
    kernel.backward = lambda *args, **kwargs: _record(returned, "kernel", kernel_backward(*args, **kwargs))
    ring.ring_backward = lambda *args, **kwargs: _record(returned, "ring", ring_backward(*args, **kwargs))
    _with_kernel(kernel)
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    ringflex.ring_flex_attention(q, k, v, layout="contiguous").sum().backward()
    return returned["kernel"], returned["ring"]


def _record(into: dict, name: str, tensors):
    into[name] = [t.data_ptr() for t in tensors[:3]]  # dq, dk, dv
    return tensors


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_last_hop_gradients_become_the_result(world_size):
    """The own block's hop at the last backward step covers every row: its dq, dk and dv
    become the ring's gradients, with the other steps' shares added into them, not copied."""
    for kernel_last, ring_result in run_world(world_size, _gradient_storage):
        assert kernel_last == ring_result


def _cyclic_garbage(rank, world_size):
    """Objects Python's collector finds unreachable after warmed-up ring calls, fwd+bwd, over
    masks that plan differently and a score_mod."""
    import gc
    from ringflex import mods
    full = 16 * world_size
    calls = [dict(mask_mod=cases(full)["causal"].mask_mod), dict(mask_mod=cases(full)["documents"].mask_mod),
             dict(score_mod=mods.softcap(5.0), mask_mod=mods.sliding_window(5))]
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    for _ in range(2):
        for kwargs in calls:
            ringflex.ring_flex_attention(q, k, v, **kwargs).sum().backward()
    gc.collect()
    gc.disable()
    try:
        for kwargs in calls:
            ringflex.ring_flex_attention(q, k, v, **kwargs).sum().backward()
        return gc.collect()
    finally:
        gc.enable()


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_ring_call_leaves_no_cyclic_garbage(world_size):
    """Reference cycles live until Python's collector runs, which may be inside a user's
    CUDA-graph capture (freeing a CUDAGraph there invalidates it) and keeps what they hold:
    a ring call makes none."""
    assert run_world(world_size, _cyclic_garbage) == [0] * world_size


def _twice(rank, world_size, mask_name):
    """Gradients of one backward, and of two through a retained graph; whether forward kept
    every block it received."""
    kept = agreed_calls()
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = {"causal": cases(4 * world_size)["causal"].mask_mod, "window": ringflex.mods.sliding_window(2)}[mask_name]
    out = ringflex.ring_flex_attention(q, k, v, mask_mod=mask, layout="contiguous" if mask_name == "window" else "zigzag")
    out.backward(torch.ones_like(out), retain_graph=True)
    once = [t.grad.clone() for t in (q, k, v)]
    out.backward(torch.ones_like(out))
    return once, [t.grad for t in (q, k, v)], kept[0].keeps


@pytest.mark.parametrize("mask_name, keeps", [("causal", False), ("window", True)])
def test_backward_twice_through_a_retained_graph(mask_name, keeps):
    """Backward only reads what forward saved (the block forward ended on travels, but is
    never received into; or every block it received, held), so a retained graph gives the
    same gradients again."""
    for once, twice, kept in run_world(3, _twice, mask_name):
        assert kept == keeps
        for a, b in zip(once, twice):
            torch.testing.assert_close(b, 2 * a)


def _short_ring(rank, world_size, mask_name, kernel=None):
    """Transfers of one forward and backward (pass, rows of each tensor sent), and the
    largest error against the oracle."""
    from ringflex import mods
    if kernel is not None:
        _with_kernel(kernel)
    local = 8
    mask = {"window": mods.sliding_window(4),  # each rank needs only the previous rank's block
            "aligned_documents": mods.document(mods.document_ids([local] * world_size))}[mask_name]
    q, k, v, dout = (torch.randn(1, 2, local * world_size, 8, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(i)) for i in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, mask_mod=mask)
    want.backward(dout)
    parts = [ringflex.shard(t, 2, layout="contiguous").requires_grad_() for t in (q, k, v)]
    with _recorded_transfers(lambda comm, send, shift: (comm.phase, tuple(t.shape[2] for t in send))) as seen:
        out = ringflex.ring_flex_attention(*parts, mask_mod=mask, layout="contiguous")
        out.backward(ringflex.shard(dout, 2, layout="contiguous"))
    errors = [(a - ringflex.shard(b, 2, layout="contiguous")).abs().max().item()
              for a, b in zip([out] + [t.grad for t in parts], [want] + [t.grad for t in full])]
    return seen, max(errors)


@pytest.mark.parametrize("mask_name, forward, backward", [("window", 1, 1), ("aligned_documents", 0, 0)])
def test_ring_stops_where_no_rank_needs_further_blocks(mask_name, forward, backward, monkeypatch):
    """A sliding window over the contiguous layout needs the previous rank's block only: the
    ring runs two steps on 4 ranks (one K/V transfer forward; backward one exchange of dK/dV
    shares and no K/V block), not four. Documents that end at rank boundaries need no transfer at all.
    (Without lending, whose transfers tests/test_lending.py counts.)"""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    for seen, error in run_world(4, _short_ring, mask_name):
        phases = [phase for phase, _ in seen]
        assert phases.count("forward") == forward and phases.count("backward") == backward, seen
        assert error < 1e-10


def _zigzag_window(rank, world_size, kernel=None):
    """A window of 4 over zigzag (chunks of 4 tokens): the shifts of one forward's and
    backward's transfers and the rows of K they send, and the largest error against the oracle."""
    from ringflex import mods
    if kernel is not None:
        _with_kernel(kernel)
    mask, seq_len = mods.sliding_window(4), 8 * world_size
    q, k, v, dout = (torch.randn(1, 2, seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                     for i in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, mask_mod=mask)
    want.backward(dout)
    parts = [ringflex.shard(t, 2, layout="zigzag").requires_grad_() for t in (q, k, v)]
    with _recorded_transfers(lambda comm, send, shift: (comm.phase, shift, send[0].shape[2])) as seen:
        out = ringflex.ring_flex_attention(*parts, mask_mod=mask, layout="zigzag")
        out.backward(ringflex.shard(dout, 2, layout="zigzag"))
    errors = [(a - ringflex.shard(b, 2, layout="zigzag")).abs().max().item()
              for a, b in zip([out] + [t.grad for t in parts], [want] + [t.grad for t in full])]
    return seen, max(errors)


def test_a_window_over_zigzag_brings_the_blocks_of_both_neighbours_alone(monkeypatch):
    """Over zigzag a window reads the ranks on either side (distances 1 and W - 1 = 3), so on 4
    ranks forward brings those two blocks straight from their owners and skips distance 2;
    backward starts on the block of distance 3, brings distance 1's, and sends each its
    dK/dV share: the reference kernel reads whole blocks, two of which forward does not keep
    (``RingCall.keeps_received``). (Without lending.)"""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    for seen, error in run_world(4, _zigzag_window):
        assert [s[:2] for s in seen] == [("forward", 1), ("forward", 3), ("backward", 1), ("backward", -3),
                                         ("backward", -1)], seen
        assert error < 1e-10


def test_a_window_over_zigzag_sends_each_neighbour_the_chunk_it_reads(monkeypatch):
    """Over zigzag a window's reader behind reads the first chunk of a block (4 rows of 8), its
    reader ahead the second: each K/V transfer is that chunk, not the block (the first and
    last rank read nothing of each other); the dK/dV shares come back over the 3 rows read.
    The two chunks a rank receives fill one block, so they come in one step, as one block
    (``RingCall.pieces``), forward keeps it and backward moves no K/V (``RingCall.keeps_received``),
    only the shares, to both owners at once. (With a kernel that plans within blocks, so the
    rows read are exact; without lending.)"""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    for rank, (seen, error) in enumerate(run_world(4, _zigzag_window, _WholeBlockKernel())):
        ahead = 0 if rank == 3 else 4  # rows sent to the rank 1 ahead (rank 0 reads no row of rank 3)
        behind = 0 if rank == 0 else 4  # to the rank 3 ahead, 1 behind
        share_1, share_3 = (0 if rank == 0 else 3), (0 if rank == 3 else 3)  # to the owners 1 and 3 back
        assert seen == [("forward", 1, ahead), ("forward", 3, behind), ("backward", -1, share_1),
                        ("backward", -3, share_3)], (rank, seen)
        assert error < 1e-10


@pytest.mark.parametrize("world_size", [2, 4])
def test_only_the_rows_other_ranks_read_travel(world_size, monkeypatch):
    """With a kernel that reports which keys its calls reach, a window of 4 over the
    contiguous layout moves the last 3 rows of a block (of 8), widened to 4 (``widened``),
    forward, and the dK/dV shares of those 3 rows back; the last rank's block, which no rank
    reads, moves no row. (Without lending.)"""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    for rank, (seen, error) in enumerate(run_world(world_size, _short_ring, "window", _WholeBlockKernel())):
        forward, backward = (4, 4) if rank < world_size - 1 else (0, 0), (3, 3) if rank > 0 else (0, 0)
        assert seen == [("forward", forward), ("backward", backward)], (rank, seen)
        assert error < 1e-10


class _Comm:
    """A transport stand-in for a K/V stream's transfers: it never receives in place, and its
    sends report no end."""

    @staticmethod
    def sendable(t):
        return t

    def receives_in_place(self, device):
        return False

    def exchange(self, send, recv, shift=1, send_after=None):
        return types.SimpleNamespace(sent=None, wait=lambda: None)


def _stream(comm, steps: int, last=None):
    """A K/V stream over a ring of ``steps`` steps without hops, of 4-row blocks."""
    from ringflex.kernels.base import Mods
    from ringflex.parallel.kv import KVStream
    from ringflex.parallel.ring import RingCall
    call = RingCall(comm=comm, schedule=[[] for _ in range(steps)], kernel=ReferenceKernel(), mods=Mods(), scale=1.0)
    return KVStream(call, (torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)), last=last)


def test_receive_buffers_are_made_by_the_transfers_that_fill_them():
    """A K/V stream is made before the own block's compute is queued and holds no buffer yet:
    each transfer makes its receive buffer (for a whole block) when it starts, the first one
    beside that compute (``kv.allocated_beside``, on a GPU: ``tests/gpu/test_stream_order.py``),
    so two buffers serve a pass of any length, and a ring without transfers has none."""
    held = (torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))  # the last step's block, already here
    for steps, last, buffers in ((4, None, 2), (3, None, 2), (2, None, 1), (2, held, 0), (1, None, 0)):
        blocks = _stream(_Comm(), steps, last)
        assert blocks.buffers == []
        for step in range(steps - 1):
            blocks.advance(step, blocks.start(step))
        assert len(blocks.buffers) == buffers, (steps, last is not None)
        assert all(b.shape == (1, 2, 4, 8) for pair in blocks.buffers for b in pair)


def test_each_send_of_the_own_block_waits_for_the_one_before():
    """The sends of the own block share the copy engines: each is given the end of the one
    before as ``send_after``, so the nearest rank, which reads the block first, has it first.
    Where a transport reports no end (the process group orders its sends), nothing waits."""
    class Comm(_Comm):
        def __init__(self, reports_end):
            self.reports_end, self.waited_for, self.sends = reports_end, [], 0

        def exchange(self, send, recv, shift=1, send_after=None):
            self.waited_for.append(send_after)
            self.sends += 1
            return types.SimpleNamespace(sent=f"end of send {self.sends}" if self.reports_end else None,
                                         wait=lambda: None)

    for reports_end, want in ((True, [None, "end of send 1", "end of send 2"]), (False, [None, None, None])):
        comm = Comm(reports_end)
        blocks = _stream(comm, 4)
        for step in range(3):
            blocks.advance(step, blocks.start(step))
        assert comm.waited_for == want


def test_a_groups_first_pass_builds_its_transport_at_its_first_transfer():
    """Building the copy-engine transport is a collective: a K/V stream made before the ranks
    agreed on the call (as forward makes it) does not build it, and the first transfer, after
    they agreed, does; from then on the pass receives in place, into the buffers the senders
    fill (a CUDA graph captured after one eager call finds them made)."""
    class Comm(_Comm):
        def __init__(self):
            self.built, self.into = False, []

        def receives_in_place(self, device):
            self.built = True
            return True

        def receive_buffer(self, key, shape, dtype, device):
            self.into.append(key)
            return torch.empty(shape, dtype=dtype, device=device)

    comm = Comm()
    blocks = _stream(comm, 3)
    assert not comm.built and not blocks.in_place
    for step in range(2):
        blocks.advance(step, blocks.start(step))
    assert comm.built and blocks.in_place and comm.into == [("block", 0, 0), ("block", 0, 1), ("block", 1, 0),
                                                            ("block", 1, 1)]


def _summaries(b, h, q_idx, kv_idx):
    """Each query sees itself and the first key of every 8: over zigzag on 4 ranks of 8 rows,
    one row of each other rank, each at a ring step of its own."""
    return (kv_idx % 8 == 0) | (q_idx == kv_idx)


def _receiving_in_place() -> dict:
    """Whole blocks computed (``_WholeBlockKernel``) and blocks and shares received "in place"
    from now on (``support.in_place``). Returns the buffers."""
    from support.in_place import receive_in_place
    _with_kernel(_WholeBlockKernel())
    return receive_in_place()


def _elsewhere(b, h, q_idx, kv_idx):
    """Each query sees every key but those of its own rank's block (8 rows a rank, contiguous):
    the own block's dK/dV is the shares alone."""
    return q_idx // 8 != kv_idx // 8


def _in_place_calls(rank, world_size, mask_name, layout):
    """Two calls, both forwards before either backward, with blocks and dK/dV shares received in
    place: into buffers that every call reuses (here CPU tensors kept per key, filled over
    gloo), as the copy engines' are. Returns the largest error of both calls against the
    oracle, read once both backwards ran (no gradient lies in a buffer the later call fills),
    and the number of buffers of blocks and of shares."""
    from ringflex import mods
    buffers = _receiving_in_place()
    mask = {"window": mods.sliding_window(4), "causal": mods.causal, "summaries": _summaries,
            "elsewhere": _elsewhere}[mask_name]
    calls = []
    for seed in range(2):
        q, k, v, dout = (torch.randn(1, 2, 8 * world_size, 8, dtype=torch.float64,
                                     generator=torch.Generator().manual_seed(10 * seed + i)) for i in range(4))
        parts = [ringflex.shard(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
        out = ringflex.ring_flex_attention(*parts, mask_mod=mask, layout=layout)
        calls.append((q, k, v, dout, parts, out))
    for q, k, v, dout, parts, out in calls:
        out.backward(ringflex.shard(dout, 2, layout=layout))
    errors = []
    for q, k, v, dout, parts, out in calls:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = attention(*full, mask_mod=mask)
        want.backward(dout)
        errors += [(a - ringflex.shard(b, 2, layout=layout)).abs().max().item()
                   for a, b in zip([out] + [t.grad for t in parts], [want] + [t.grad for t in full])]
    return max(errors), sum(key[0] == "block" for key in buffers), sum(key[0] == "share" for key in buffers)


@pytest.mark.parametrize("world_size, layout, mask_name, blocks, shares", [
    (4, "zigzag", "window", 4, 4), (4, "zigzag", "causal", 4, 6), (4, "zigzag", "summaries", 6, 6),
    (2, "contiguous", "elsewhere", 2, 2), (4, "contiguous", "elsewhere", 4, 6)])
def test_what_arrives_in_place_is_read_out_of_the_buffers_the_next_call_fills(world_size, layout, mask_name, blocks,
                                                                               shares, monkeypatch):
    """Blocks and dK/dV shares received in place land in buffers that the next call fills:
    forward saves what backward reads out of them, every received block where it keeps them all
    (a window's two halves over zigzag, each in a buffer of its own: K and V of two transfers; a
    row of each other rank: three transfers) and the last one where it does not (causal: two
    buffers that alternate); the shares (a dK and a dV buffer per distance) are summed into a
    gradient of its own, also where they are all of it (``elsewhere``: the own block's hops
    read no key of it; on two ranks one share is the whole gradient, on four the last one
    completes it)."""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    for error, made_blocks, made_shares in run_world(world_size, _in_place_calls, mask_name, layout):
        assert error < 1e-10 and (made_blocks, made_shares) == (blocks, shares)


def test_shares_arrive_in_place_up_to_a_block_of_128_mib_of_dk_and_dv():
    """Over the copy engines a dK/dV share arrives in place while its owner's whole-block dK and
    dV buffers take at most 128 MiB (8k rows of 32 heads of 128 in bf16): a buffer per distance
    is kept for every call, so longer blocks' shares go through the mailbox; over the process
    group's P2P, never."""
    from ringflex.parallel import shares

    def call(in_place):
        return types.SimpleNamespace(comm=types.SimpleNamespace(receives_in_place=lambda device: in_place))

    def block(rows, heads=32):
        return torch.empty(1, heads, rows, 128, device="meta")

    assert shares.arrives_in_place(call(True), block(8192), block(8192), torch.bfloat16)
    assert not shares.arrives_in_place(call(True), block(8200), block(8200), torch.bfloat16)
    assert not shares.arrives_in_place(call(True), block(8192), block(8192), torch.float32)
    assert shares.arrives_in_place(call(True), block(32768, heads=8), block(32768, heads=8), torch.bfloat16)
    assert not shares.arrives_in_place(call(False), block(16), block(16), torch.bfloat16)


@pytest.mark.parametrize("reads, steps, keeps", [
    (None, 1, True), (None, 2, True), (None, 3, False),  # no agreement: whole blocks travel
    ([[(0, 8), (4, 8), (0, 0), (0, 4)]] * 4, 3, True),  # two halves: one block in all
    ([[(0, 8), (4, 8), (0, 0), (0, 4)]] * 3 + [[(0, 8), (3, 8), (0, 0), (0, 4)]], 3, False),  # a half widened to 8
    ([[(0, 8), (0, 8), (0, 0), (0, 0)]] * 4, 2, True),  # one transfer: its block, kept anyway
    ([[(0, 8), (0, 8), (0, 8), (0, 8)]] * 4, 4, False)])  # causal: whole blocks
def test_forward_keeps_the_blocks_it_receives_where_they_fill_one_block_at_most(reads, steps, keeps):
    """``RingCall.keeps_received``: every rank's received rows in all (widened as they travel,
    ``plan.blocks.widened``) at most one block, the same answer on every rank."""
    from ringflex.kernels.base import Mods
    from ringflex.parallel.ring import RingCall
    distances = [(d,) for d in [0, 1, 3, 2][:steps]] if reads is not None else None
    call = RingCall(comm=None, schedule=[[] for _ in range(steps)], kernel=ReferenceKernel(), mods=Mods(), scale=1.0,
                    reads=reads, distances=distances)
    assert call.keeps_received(8) == keeps


@pytest.mark.parametrize("rows, length, want", [
    ((5, 8), 8, (4, 8)), ((0, 3), 8, (0, 4)), ((2, 7), 8, (0, 8)), ((3, 4), 8, (3, 4)), ((0, 0), 8, (0, 0)),
    ((1, 6), 6, (0, 6)), ((2, 5), 12, (2, 6)), ((9, 12), 12, (8, 12))])
def test_travelling_rows_are_widened_to_a_power_of_two_inside_the_block(rows, length, want):
    """Received blocks take a few row counts (powers of two, or the whole block), so their
    strides do too: the cuDNN kernel's ragged graphs, built per stride, are reused when the
    rows a mask reads of another rank's block change (packed documents)."""
    from ringflex.plan.blocks import widened
    assert widened(rows, length) == want


class _OneCallKernel(_RoundingKernel):
    """Takes a step's hops of disjoint rows and keys as one call, as the cuDNN kernel does a
    rank's own diagonal blocks of packed documents over zigzag: the results are one tensor over
    all of them, in the input dtype, NaN in rows and keys no hop has (which the ring must not
    read). It counts its joined calls."""

    joined = 0

    def forward_hops(self, q, k, v, hops, mods, scale):
        type(self).joined += 1
        out = q.new_full((*q.shape[:3], v.shape[-1]), torch.nan)
        lse = torch.full(q.shape[:3], torch.nan, dtype=torch.float32)
        for h in hops:
            o, l, _ = self.forward(q[:, :, slice(*h.q_rows)], k[:, :, slice(*h.kv_rows)], v[:, :, slice(*h.kv_rows)],
                                   h.q_seg, h.kv_seg, mods, scale, h.kind != BlockKind.FULL)
            out[:, :, slice(*h.q_rows)], lse[:, :, slice(*h.q_rows)] = o, l
        return out, lse, None

    def backward_hops(self, q, k, v, out, lse, dout, hops, mods, scale, res=None):
        type(self).joined += 1
        grads = [torch.full_like(t, torch.nan) for t in (q, k, v)]
        for h in hops:
            q_rows, kv_rows = slice(*h.q_rows), slice(*h.kv_rows)
            parts = self.backward(q[:, :, q_rows], k[:, :, kv_rows], v[:, :, kv_rows], out[:, :, q_rows],
                                  lse[:, :, q_rows], dout[:, :, q_rows], h.q_seg, h.kv_seg, mods, scale,
                                  h.kind != BlockKind.FULL, res=None if res is None else res[:, :, q_rows])
            for grad, part, r in zip(grads, parts, (q_rows, kv_rows, kv_rows)):
                grad[:, :, r] = part
        return tuple(grads)


def _joined_documents(rank, world_size):
    """Causal packed documents over zigzag, fwd+bwd in bf16 with the one-call kernel: the
    worst error against one process in fp64, and the joined calls made."""
    _with_kernel(_OneCallKernel())
    seq_len = LOCAL_LEN * world_size
    case = cases(seq_len)["documents"]
    q, k, v, dout = make_inputs(case, seq_len, dtype=torch.bfloat16)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    attention(*full, case.score_mod, case.mask_mod).backward(dout.double())
    local = [ringflex.shard(t, 2, layout="zigzag").requires_grad_() for t in (q, k, v)]
    out = ringflex.ring_flex_attention(*local, score_mod=case.score_mod, mask_mod=case.mask_mod, layout="zigzag",
                                       enable_gqa=True)
    out.backward(ringflex.shard(dout, 2, layout="zigzag"))
    want = [attention(*(t.detach() for t in full), case.score_mod, case.mask_mod)] + [t.grad for t in full]
    errors = [(g.double() - ringflex.shard(w, 2, layout="zigzag")).abs().max().item()
              for g, w in zip([out] + [t.grad for t in local], want)]
    return max(errors), _OneCallKernel.joined


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_steps_disjoint_hops_go_to_the_kernel_as_one_call(world_size):
    """Over zigzag a rank's own block of packed documents is its two chunks' diagonal blocks
    (nothing between them is seen): the ring hands them to the kernel at once, forward and
    backward, and the results, rows of one tensor, match one process."""
    results = run_world(world_size, _joined_documents)
    assert all(error < TOLERANCE[torch.bfloat16] for error, _ in results), results
    assert any(joined == 2 for _, joined in results), results  # one forward, one backward call


class _PlanningOneCallKernel(_WholeBlockKernel, _OneCallKernel):
    """Plans within blocks (so the rows read are exact) and takes a step's disjoint hops as one call."""

    joined = 0


def _neighbours_in_one_step(rank, world_size):
    """A window of 4 over zigzag: the call's steps (their distances), the hops of its second
    step, the kernel's joined calls and the largest error against the oracle."""
    calls = agreed_calls()
    error = _zigzag_window(rank, world_size, _PlanningOneCallKernel())[1]
    return calls[-1].distances, len(calls[-1].schedule[1]), _PlanningOneCallKernel.joined, error


def test_a_window_over_zigzag_runs_both_neighbours_rows_as_one_step(monkeypatch):
    """On 4 ranks a zigzag rank reads both neighbours (distances 1 and 3). The rows it reads of
    them fill one block, so they arrive in one step as one block (``RingCall.pieces``), whose
    hops, one per neighbour where a rank reads both, go to the kernel as one call, forward and
    backward: the numbers of one process (to the one-call kernel's fp32 LSE)."""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    for rank, (distances, hops, joined, error) in enumerate(run_world(4, _neighbours_in_one_step)):
        assert distances == [(0,), (1, 3)] and error < 1e-5, (rank, distances, error)
        assert hops == (2 if rank in (1, 2) else 1) and joined >= (2 if rank in (1, 2) else 0), (rank, hops, joined)


@pytest.mark.parametrize("gap", [0, 3])
def test_a_joined_steps_results_are_one_part_where_its_hops_fill_them(gap):
    """A step's hops run as one call come back as one result over their rows and keys where
    they leave none between them (the own block over zigzag), and as each hop's rows of it
    where they do: the same numbers as a call per hop, never a row no hop computed (the
    one-call kernel leaves those NaN)."""
    from ringflex.kernels.base import Mods
    from ringflex.parallel import compute
    from ringflex.plan.blocks import Hop
    from ringflex.plan.layout import Segment

    n = 8
    starts = (0, 100)
    spans = [(0, n), (n + gap, 2 * n + gap)]
    hops = [Hop(r, r, Segment(s, 1, n), Segment(s, 1, n), BlockKind.PARTIAL) for r, s in zip(spans, starts)]
    call = types.SimpleNamespace(kernel=_OneCallKernel(), mods=Mods(None, lambda b, h, q, kv: q >= kv),
                                 scale=0.5, tensors=[])
    q, k, v, dout = (torch.randn(1, 2, 2 * n + gap, 4, dtype=torch.float64) for _ in range(4))

    def keys(r):
        return k[:, :, slice(*r)], v[:, :, slice(*r)]

    parts = compute.step_forward(call, hops, q, keys)
    assert len(parts) == (1 if gap == 0 else 2)
    one_by_one = [(h.q_rows, *compute.hop_forward(call, h, q[:, :, slice(*h.q_rows)], *keys(h.kv_rows)))
                  for h in hops]
    for h, (r, want_out, want_lse, _) in zip(hops, one_by_one):
        (got_rows, out, lse, _), = [p for p in parts if p[0][0] <= r[0] and r[1] <= p[0][1]]
        local = slice(r[0] - got_rows[0], r[1] - got_rows[0])
        torch.testing.assert_close(out[:, :, local], want_out)
        torch.testing.assert_close(lse[:, :, local], want_lse.to(lse.dtype))  # the one-call kernel's lse: fp32
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float64)
    for r, o, l, _ in one_by_one:
        out[:, :, slice(*r)], lse[:, :, slice(*r)] = o, l
    grads = compute.step_backward(call, hops, q, keys, out, lse, None, dout, None)
    assert len(grads) == len(parts)
    for h in hops:
        want = compute.hop_backward(call, h, q[:, :, slice(*h.q_rows)], *keys(h.kv_rows), out[:, :, slice(*h.q_rows)],
                                    lse[:, :, slice(*h.q_rows)], None, dout, None, h.q_rows)[:3]
        (q_rows, kv_rows, *got), = [g for g in grads if g[0][0] <= h.q_rows[0] and h.q_rows[1] <= g[0][1]]
        for g, w, r, base in zip(got, want, (h.q_rows, h.kv_rows, h.kv_rows), (q_rows, kv_rows, kv_rows)):
            torch.testing.assert_close(g[:, :, r[0] - base[0]:r[1] - base[0]], w)
            assert not g.isnan().any()


def _evaluation_saves(rank, world_size, mask_name):
    """A call without grad mode, then the same with it: (blocks forward saved out of its
    receive buffers, whether it kept every block it received) for each, and the outputs' largest
    difference. Blocks are received "in place", into buffers every call reuses (as the copy
    engines'), so each saved block is a copy."""
    from ringflex import mods
    from ringflex.parallel import ring
    _receiving_in_place()
    calls, copies, saved = agreed_calls(), [0], ring.saved
    ring.saved = lambda t, in_place: (copies.__setitem__(0, copies[0] + in_place), saved(t, in_place))[1]
    mask = {"window": mods.sliding_window(4), "causal": mods.causal}[mask_name]
    q, k, v = (ringflex.shard(torch.randn(1, 2, 8 * world_size, 8, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(i)), 2, layout="zigzag")
               .requires_grad_() for i in range(3))
    seen, outs = [], []
    for grad in (False, True):
        copies[0] = 0
        with torch.set_grad_enabled(grad):
            outs.append(ringflex.ring_flex_attention(q, k, v, mask_mod=mask, layout="zigzag"))
        seen.append((copies[0], calls[-1].keeps))
    return seen, (outs[0] - outs[1]).abs().max().item()


@pytest.mark.parametrize("mask_name, with_grad", [("window", (0, True)), ("causal", (2, False))])
def test_a_call_without_grad_saves_no_block(mask_name, with_grad, monkeypatch):
    """Without grad mode (evaluation) no backward will run: forward neither keeps the blocks
    it receives nor copies any out of its receive buffers; with it, the block a window's halves
    were joined into (memory of its own: no copy), or for causal the last block (K and V)."""
    monkeypatch.setenv("RINGFLEX_LENDING", "0")
    monkeypatch.setenv("RINGFLEX_MIN_TILE", "2")
    for (without, with_), error in run_world(4, _evaluation_saves, mask_name):
        assert without == (0, False) and with_ == with_grad and error == 0
