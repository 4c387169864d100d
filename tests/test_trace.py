"""The tracer reproduces every mod exactly, differentiates score_mods like autograd,
fingerprints structurally and refuses what it cannot lower with a clear error."""
import re

import pytest
import torch

from support.cases import cases
from support.harness import run_world
from ringflex import mods
from ringflex.plan.blocks import index_grid
from ringflex.plan.layout import Segment
from ringflex.mod.band import diagonal_band
from ringflex.mod.grad import score_grad
from ringflex.mod.graph import UnsupportedModError
from ringflex.mod.trace import trace_mask_mod, trace_score_mod

SEQ = 48
CASES = cases(SEQ)


def _grid(q_seg: Segment, kv_seg: Segment, batch=2, heads=4):
    return index_grid(batch, heads, q_seg.positions(), kv_seg.positions())


SEGMENTS = [
    (Segment(0, 1, SEQ), Segment(0, 1, SEQ)),
    (Segment(SEQ // 2, 1, SEQ // 4), Segment(5, 1, SEQ // 3)),  # global offsets
    (Segment(1, 3, SEQ // 3), Segment(2, 3, SEQ // 3)),  # striped
]

EXTRA_SCORE_MODS = {
    "arith": lambda s, b, h, q, kv: (s * 2 - 1) / 3 + (q - kv) * 0.01 - s.neg() + 1 - s,
    "unary": lambda s, b, h, q, kv: torch.exp(s / 4) + torch.log(s.abs() + 1) + torch.sqrt(s * s + 1)
    + torch.tanh(s) + torch.sigmoid(s) + s.abs(),
    "minmax": lambda s, b, h, q, kv: torch.clamp(s, -1.0, 1.5) + torch.minimum(s, s * 0.5)
    + torch.maximum(s, (q - kv).float()) + torch.clamp(s, min=0.0) + s.clamp(max=0.3),
    "where": lambda s, b, h, q, kv: torch.where(q >= kv, s * 1.5, s - (q - kv) * 0.25),
    "masked_fill": lambda s, b, h, q, kv: s.masked_fill((q % 3 == 0) & (kv % 2 == 1), -2.0),
    "casts": lambda s, b, h, q, kv: s + (q < kv).float() - (kv // 7).to(torch.float32) + (b + h).float(),
    "logic": lambda s, b, h, q, kv: s * ((q >= kv) | ~(h == 1)) + s * torch.logical_xor(q > 5, kv > 5),
    "pow": lambda s, b, h, q, kv: s ** 2 + s.pow(3) * 0.1 + torch.square(s),
    "mod": lambda s, b, h, q, kv: s % 0.75 + (q % 5) + torch.div(kv, 4, rounding_mode="floor"),
    "constants": lambda s, b, h, q, kv: s * torch.tensor(0.5) + torch.full_like(s, 2.0) + torch.ones_like(s),
    "reciprocal": lambda s, b, h, q, kv: (s * s + 1).reciprocal() + (s * s + 2).rsqrt(),
}


def _score_mods():
    found = {name: c.score_mod for name, c in CASES.items() if c.score_mod is not None}
    found.update(EXTRA_SCORE_MODS)
    return found


def _mask_mods():
    return {name: c.mask_mod for name, c in CASES.items() if c.mask_mod is not None}


@pytest.mark.parametrize("segs", SEGMENTS, ids=["aligned", "offsets", "striped"])
@pytest.mark.parametrize("name", sorted(_mask_mods()))
def test_mask_mod_graph_matches_mod(name, segs):
    fn = _mask_mods()[name]
    b, h, q, kv = _grid(*segs)
    graph = trace_mask_mod(fn)
    expected = torch.broadcast_to(fn(b, h, q, kv), (2, 4, q.shape[2], kv.shape[3]))
    got = torch.broadcast_to(graph(b, h, q, kv), expected.shape)
    assert got.dtype == torch.bool
    assert torch.equal(got, expected)


@pytest.mark.parametrize("segs", SEGMENTS, ids=["aligned", "offsets", "striped"])
@pytest.mark.parametrize("name", sorted(_score_mods()))
def test_score_mod_graph_and_derivative(name, segs):
    fn = _score_mods()[name]
    b, h, q, kv = _grid(*segs)
    g = torch.Generator().manual_seed(0)
    score = torch.randn(2, 4, q.shape[2], kv.shape[3], generator=g, dtype=torch.float64).float() * 3
    graph = trace_score_mod(fn)
    expected = torch.broadcast_to(fn(score, b, h, q, kv), score.shape)
    torch.testing.assert_close(torch.broadcast_to(graph(score, b, h, q, kv), score.shape), expected)

    x = score.clone().requires_grad_()
    upstream = torch.randn(score.shape, generator=g)
    (want,) = torch.autograd.grad(torch.broadcast_to(fn(x, b, h, q, kv), score.shape), x, upstream)
    got = score_grad(graph)(upstream, score, b, h, q, kv)
    torch.testing.assert_close(torch.broadcast_to(got, score.shape), want, rtol=1e-5, atol=1e-5)


def test_softcap_derivative_keeps_the_pre_tanh_value():
    graph = trace_score_mod(mods.softcap(30.0))
    grad = score_grad(graph)
    ops = [n.op for n in grad.nodes]
    assert "tanh_backward" in ops and "tanh" not in ops  # built from tanh's input, not its output
    assert score_grad(trace_score_mod(mods.alibi(torch.ones(4)))).output.op == "grad"  # identity


def test_dependencies():
    slopes = mods.alibi_slopes(4)
    assert trace_score_mod(mods.alibi(slopes)).deps == {"score", "h", "q_idx", "kv_idx"}
    assert trace_score_mod(mods.softcap(2.0)).deps == {"score"}
    assert trace_mask_mod(mods.causal).deps == {"q_idx", "kv_idx"}
    assert trace_mask_mod(lambda b, h, q, kv: b == 0).deps == {"b"}
    assert trace_score_mod(lambda s, b, h, q, kv: torch.zeros_like(s)).deps == frozenset()


def test_fingerprint():
    doc_a, doc_b = mods.document_ids([3, 5]), mods.document_ids([4, 4])
    fp = lambda fn: trace_mask_mod(fn).fingerprint  # noqa: E731
    assert fp(mods.causal) == fp(mods.causal)
    assert fp(mods.sliding_window(4)) == fp(mods.sliding_window(4))
    assert fp(mods.sliding_window(4)) != fp(mods.sliding_window(5))
    assert fp(lambda b, h, q, kv: q >= kv) != fp(lambda b, h, q, kv: q > kv)
    assert fp(lambda b, h, q, kv: q >= kv) != fp(lambda b, h, q, kv: kv <= q)
    assert fp(mods.document(doc_a)) == fp(mods.document(doc_a))
    assert fp(mods.document(doc_a)) != fp(mods.document(doc_b))  # other captured tensor
    assert trace_mask_mod(mods.document(doc_a)).structure == trace_mask_mod(mods.document(doc_b)).structure
    assert (trace_mask_mod(mods.document(doc_a)).structure
            != trace_mask_mod(mods.document(doc_a.to(torch.int32))).structure)
    sfp = lambda fn: trace_score_mod(fn).fingerprint  # noqa: E731
    assert sfp(mods.softcap(2.0)) != sfp(mods.softcap(2.5))
    assert sfp(lambda s, b, h, q, kv: s * 2) != sfp(lambda s, b, h, q, kv: s * 2.0000001)
    assert sfp(lambda s, b, h, q, kv: s * 2) != trace_mask_mod(lambda b, h, q, kv: q * 2 > 0).fingerprint


def test_a_mod_is_walked_once_within_a_call():
    """Within ``one_walk`` (a ring call's forward, or its backward) a mod's parts and
    fingerprint are found once; outside it, at every asking, so a global reassigned between
    calls is seen."""
    from ringflex.mod import captured
    from ringflex.mod.fingerprint import fingerprint
    mask = mods.sliding_window(4)
    assert captured.parts(mask) is not captured.parts(mask)
    with captured.one_walk():
        first = captured.parts(mask)
        with captured.one_walk():  # an inner call (a mesh's ring) keeps the outer walks
            assert captured.parts(mask) is first
        assert captured.parts(mask) is first and fingerprint(mask) == fingerprint(mods.sliding_window(4))
        assert captured.parts(mods.sliding_window(4)) is not first  # another object: walked too
    assert captured.parts(mask) is not first


def test_a_mod_is_traced_once_within_a_call(monkeypatch):
    """Within ``one_walk`` every hop of a pass asks for the mod's trace: it is looked up once
    (the same graph after); outside one, at every asking, so a tensor written between calls
    is traced anew."""
    from ringflex.mod import captured, trace
    looked_up, original = [], trace._looked_up
    monkeypatch.setattr(trace, "_looked_up", lambda *args: looked_up.append(1) or original(*args))
    ids = mods.document_ids([3, 5])
    mask = mods.document(ids)
    with captured.one_walk():
        first = trace_mask_mod(mask)
        assert all(trace_mask_mod(mask) is first for _ in range(3)) and len(looked_up) == 1
    ids.copy_(mods.document_ids([5, 3]))
    assert trace_mask_mod(mask) is not first and len(looked_up) == 2
    trace_mask_mod(mask)
    assert len(looked_up) == 3


def _walks_per_pass(rank, world_size):
    """The walks of the mods in one ring call's forward and in its backward."""
    import ringflex
    from ringflex.mod import captured
    counted, walked = [], captured._walked

    def counting(fn):
        counted.append(fn)
        return walked(fn)

    captured._walked = counting
    try:
        q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
        out = ringflex.ring_flex_attention(q, k, v, mask_mod=mods.causal, score_mod=mods.softcap(5.0))
        forward = len(counted)
        out.sum().backward()
        return forward, len(counted) - forward
    finally:
        captured._walked = walked


def test_a_ring_call_walks_each_mod_once_per_pass():
    assert run_world(2, _walks_per_pass) == [(2, 2)] * 2


def test_trace_is_cached_and_follows_the_closure():
    def make(window):
        return lambda b, h, q, kv: q - kv < window

    mask = make(3)
    assert trace_mask_mod(mask) is trace_mask_mod(mask)
    assert trace_mask_mod(mask).fingerprint != trace_mask_mod(make(4)).fingerprint


def test_a_write_into_a_tensor_the_trace_read_on_the_host_traces_anew():
    """``int(limit)`` is baked into the trace: written in place, the mod is traced again."""
    limit = torch.tensor([3])
    mask = _read_on_host(limit)
    before = trace_mask_mod(mask)
    limit.fill_(5)
    after = trace_mask_mod(mask)
    assert after is not before and _same_mask(after, mask) and not _same_mask(before, mask)


def _traces(monkeypatch) -> list:
    """Records every fresh trace (``make_fx``) of a mod from here on."""
    from ringflex.mod import trace
    seen, real = [], trace._trace
    monkeypatch.setattr(trace, "_trace", lambda fn, *args: seen.append(fn) or real(fn, *args))
    monkeypatch.setattr(trace, "_TEMPLATES", type(trace._TEMPLATES)())
    return seen


def _same_mask(graph, fn, n=24):
    b, q, kv = torch.tensor(0), torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    return torch.equal(graph(b, b, q, kv), fn(b, b, q, kv).expand(n, n))


def test_a_new_closure_of_the_same_code_reuses_the_trace(monkeypatch):
    """Packed documents are a new closure over new ids at every training step: traced once,
    later closures take that graph with their own tensors (10 ms to 0.05 ms per new mask on
    CPU), alone and inside and_masks; each computes its own mask."""
    seen = _traces(monkeypatch)
    for i, make in enumerate([mods.document, lambda ids: mods.and_masks(mods.sliding_window(5), mods.document(ids))]):
        masks = [make(mods.document_ids([4 + j, 12 - j, 8])) for j in range(4)]
        graphs = [trace_mask_mod(m) for m in masks]
        assert len(seen) == i + 1
        assert len({g.fingerprint for g in graphs}) == 4 and len({g.structure for g in graphs}) == 1
        assert all(_same_mask(g, m) for g, m in zip(graphs, masks))


def _capped(limit: torch.Tensor, window: int):
    return lambda b, h, q, kv: (q - kv < window) & (kv < limit[0])


def _read_on_host(limit: torch.Tensor):
    return lambda b, h, q, kv: q - kv < int(limit.tolist()[0])  # the value is baked into the trace


class _Box:
    def __init__(self, ids):
        self.ids = ids


class _Slotted:  # no __dict__: what it holds is not looked at
    __slots__ = ("ids",)

    def __init__(self, ids):
        self.ids = ids


def _boxed(box):
    return lambda b, h, q, kv: box.ids[q] == box.ids[kv]


def _aliased(a: torch.Tensor, b: torch.Tensor):
    return lambda _, h, q, kv: a[q] == b[kv]


def test_a_trace_is_reused_only_where_it_holds_for_the_new_closure(monkeypatch):
    """Traced anew: other captured numbers, other tensor shapes or dtypes, one captured tensor
    where there were two, an object whose contents are not looked at, and a mod that read a
    captured tensor's values on the host while traced (what it computed from them is baked
    into its trace). Reused: a tensor in an object's attribute, as one in a closure."""
    seen = _traces(monkeypatch)
    ids, other = mods.document_ids([10, 14]), mods.document_ids([12, 12])
    pairs = [(_capped(torch.tensor([9]), 3), _capped(torch.tensor([9]), 4)),
             (_capped(torch.tensor([9]), 3), _capped(torch.tensor([9, 1]), 3)),
             (_capped(torch.tensor([9]), 3), _capped(torch.tensor([9], dtype=torch.int32), 3)),
             (_read_on_host(torch.tensor([3])), _read_on_host(torch.tensor([5]))),
             (_aliased(ids, other), _aliased(ids, ids)),
             (_boxed(_Slotted(ids)), _boxed(_Slotted(other)))]
    for first, second in pairs:
        graphs = [trace_mask_mod(first)]
        before = len(seen)
        graphs.append(trace_mask_mod(second))
        assert len(seen) == before + 1, second
        assert all(_same_mask(g, m) for g, m in zip(graphs, (first, second)))
    trace_mask_mod(_boxed(_Box(ids)))
    before = len(seen)
    for same_as_before in (_capped(torch.tensor([5]), 3), _aliased(other, ids), _boxed(_Box(other))):
        assert _same_mask(trace_mask_mod(same_as_before), same_as_before)
    assert len(seen) == before


def test_debug_mode_checks_a_reused_trace(monkeypatch):
    """With RINGFLEX_DEBUG=1 a reused trace is compared with a fresh one of the mod."""
    from ringflex.mod import trace
    seen = _traces(monkeypatch)
    monkeypatch.setenv("RINGFLEX_DEBUG", "1")
    first, second = (mods.document(mods.document_ids(lengths)) for lengths in ([3, 5], [4, 4]))
    trace_mask_mod(first)
    trace_mask_mod(second)
    assert len(seen) == 2
    real = trace._rebound
    monkeypatch.setattr(trace, "_rebound", lambda graph, slots, tensors: real(graph, slots, [t.clone() for t in tensors]))
    with pytest.raises(RuntimeError, match="reused the trace"):
        trace_mask_mod(mods.document(mods.document_ids([2, 6])))


def test_diagonal_band():
    band = lambda fn: diagonal_band(trace_mask_mod(fn))  # noqa: E731
    assert band(mods.causal) == (0, None)
    assert band(lambda b, h, q, kv: kv <= q) == (0, None)
    assert band(lambda b, h, q, kv: q > kv) == (1, None)
    assert band(mods.sliding_window(5)) == (0, 4)
    assert band(lambda b, h, q, kv: (kv - q <= 2) & (q - kv <= 3)) == (-2, 3)
    assert band(lambda b, h, q, kv: 2 * q - 2 * kv < 7) == (None, 3)
    assert band(lambda b, h, q, kv: q == kv) == (0, 0)
    assert band(mods.prefix_lm(4)) is None
    assert band(lambda b, h, q, kv: (q >= kv) & (h == 0)) is None
    assert band(lambda b, h, q, kv: 2 * q >= kv) is None
    # as torch computes them: exact integer casts keep a band, rounding and truncation do not
    assert band(lambda b, h, q, kv: (q - kv).float() <= 4.0) == (None, 4)
    assert band(lambda b, h, q, kv: (q * 0.5).long() >= (kv * 0.5).long()) is None  # blocks of 2, causal
    assert band(lambda b, h, q, kv: (q - kv) * 0.7 >= 6.3) is None  # False at distance 9 in float32
    assert band(lambda b, h, q, kv: q.half() >= kv.half()) is None  # float16 rounds positions past 2048
    assert band(lambda b, h, q, kv: q * 1e8 >= kv * 1e8) is None  # float32 products round past 2**24
    # in exact integers: offsets past 2**53, and casts only where the type holds the values
    assert band(lambda b, h, q, kv: q.long() + (2**53 + 1) >= kv.long() + 2**53) == (-1, None)
    assert band(lambda b, h, q, kv: (q * 100000).float() >= (kv * 100000 + 1).float()) is None
    assert band(lambda b, h, q, kv: (q * 100000).double() >= (kv * 100000 + 1).double()) == (1, None)
    assert band(lambda b, h, q, kv: (q - kv).to(torch.int16) >= 0) is None  # wraps past 32767
    # no pair at all is no band (the planner evaluates such a mask as any other)
    assert band(lambda b, h, q, kv: (q >= kv) & False) is None
    assert band(lambda b, h, q, kv: torch.zeros_like(q, dtype=torch.bool)) is None


def test_clamp_passes_the_whole_gradient_at_its_bounds():
    """As torch's clamp does (torch.minimum and torch.maximum split it between equal operands)."""
    zero = torch.zeros((), dtype=torch.int32)
    for fn in (lambda s, b, h, q, kv: s.clamp(-1.0, 1.0), lambda s, b, h, q, kv: torch.clamp(s, min=0.5),
               lambda s, b, h, q, kv: s.clamp(max=-1.0)):
        score = torch.tensor([1.0, -1.0, 0.5, 2.0, -3.0], requires_grad=True)
        fn(score, zero, zero, zero, zero).backward(torch.ones(5))
        got = score_grad(trace_score_mod(fn))(torch.ones(5), score.detach(), zero, zero, zero, zero)
        assert torch.equal(torch.broadcast_to(got, (5,)), score.grad)


@pytest.mark.parametrize("fn, match", [
    (lambda s, b, h, q, kv: torch.sin(s), "sin"),
    (lambda s, b, h, q, kv: torch.erf(s), "erf"),
    (lambda s, b, h, q, kv: s if s > 0 else -s, "could not be traced"),
    (lambda s, b, h, q, kv: s + torch.div(q, 3, rounding_mode="trunc"), "trunc"),
    (lambda s, b, h, q, kv: s + (q & 3), "booleans only"),
    (lambda s, b, h, q, kv: q > kv, "floating-point"),
])
def test_unsupported_score_mods(fn, match):
    with pytest.raises(UnsupportedModError, match=match):
        trace_score_mod(fn)


def test_unsupported_lookups():
    table = torch.arange(64).view(8, 8)
    with pytest.raises(UnsupportedModError, match="one subscript per dimension"):
        trace_mask_mod(lambda b, h, q, kv: table[q][kv] > 0)
    vec = torch.arange(8)
    with pytest.raises(UnsupportedModError, match="without indexing"):
        trace_mask_mod(lambda b, h, q, kv: (q + vec) > 0)
    graph = trace_mask_mod(lambda b, h, q, kv: table[q % 8, kv % 8] > 20)
    b, h, q, kv = index_grid(1, 1, torch.arange(10, dtype=torch.int32), torch.arange(9, dtype=torch.int32))
    assert torch.equal(graph(b, h, q, kv), table[q % 8, kv % 8] > 20)


def test_lookup_error_names_a_read_past_a_captured_tensor():
    """A captured tensor indexed by position must cover every position; the check evaluates each
    subscript that depends on one input at all of its values (on a GPU the read itself would end
    the CUDA context), and reads negative indices as torch does, from the end."""
    from ringflex.mod.lookups import lookup_error
    from ringflex.mod.trace import trace_mask_mod
    values = {"b": torch.arange(1), "h": torch.arange(4), "q_idx": torch.arange(64, 128), "kv_idx": torch.arange(128)}
    local_ids = mods.document_ids([20, 44])  # one rank's share instead of the whole sequence
    assert "reads index 64 of a captured tensor of shape (64,) (at q_idx = 64)" in lookup_error(
        trace_mask_mod(mods.document(local_ids)), values)
    assert lookup_error(trace_mask_mod(mods.document(mods.document_ids([60, 68]))), values) is None
    per_head = torch.tensor([1, 2, 3])  # one head short
    assert "(at h = 3)" in lookup_error(trace_mask_mod(lambda b, h, q, kv: kv <= q + per_head[h]), values)
    coarse = torch.zeros(2, dtype=torch.bool)  # a flag per 64 keys
    assert lookup_error(trace_mask_mod(lambda b, h, q, kv: coarse[kv // 64] | (kv <= q)), values) is None
    shifted = torch.zeros(128, dtype=torch.bool)
    assert lookup_error(trace_mask_mod(lambda b, h, q, kv: shifted[kv - 100] | (kv <= q)), values) is None


def test_lookups_by_two_inputs_are_ranged_over_the_blocks(monkeypatch):
    """A subscript of two inputs (a table of relative positions) takes a rank's queries times
    the sequence's keys values: ranged over tiles of them, it is evaluated pair by pair only
    where its range reaches outside, which names the read, at any length; where that would take
    too many reads, the error says that it cannot tell."""
    from ringflex.mod import ranges

    def error(mod, q_segs=(Segment(64, 1, 64),), kv_segs=(Segment(0, 1, 64), Segment(64, 1, 64)), batch=2):
        return ranges.ranged_lookup_error(trace_score_mod(mod), batch, 4, q_segs, kv_segs, None)

    every_distance, one_short = torch.zeros(255), torch.zeros(254)  # 2 * 128 - 1 distances
    assert error(lambda s, b, h, q, kv: s + every_distance[q - kv + 127]) is None
    assert ("score_mod reads index 254 of a captured tensor of shape (254,) (at q_idx = 127, kv_idx = 0): a tensor "
            "a mod indexes by q_idx and kv_idx together must cover every pair") in error(
        lambda s, b, h, q, kv: s + one_short[q - kv + 127])
    per_head = torch.zeros(4, 9)
    assert error(lambda s, b, h, q, kv: s + per_head[h, (q - kv).clamp(-4, 4) + 4]) is None
    per_batch_and_head = torch.zeros(4)  # for one batch element of two
    assert "reads index 4 of a captured tensor of shape (4,) (at b = 1, h = 0)" in error(
        lambda s, b, h, q, kv: s + per_batch_and_head[b * 4 + h])
    # a million tokens: the last rank's 128k queries against every key
    long_q, long_kv = [Segment((1 << 20) - (1 << 17), 1, 1 << 17)], [Segment(0, 1, 1 << 20)]
    every_distance, one_short = torch.zeros(2 ** 21 - 1), torch.zeros(2 ** 21 - 2)
    assert error(lambda s, b, h, q, kv: s + every_distance[q - kv + 2 ** 20 - 1], long_q, long_kv) is None
    assert f"reads index {2 ** 21 - 2} of a captured tensor of shape ({2 ** 21 - 2},) (at q_idx = {2 ** 20 - 1}, " \
           "kv_idx = 0)" in error(lambda s, b, h, q, kv: s + one_short[q - kv + 2 ** 20 - 1], long_q, long_kv)
    # a guard the ranges cannot follow: the tiles it leaves open are evaluated pair by pair
    window = torch.zeros(9)
    guarded = lambda s, b, h, q, kv: s + window[torch.where((q >= kv) & (q - kv <= 8), q - kv, 0)]  # noqa: E731
    assert error(guarded) is None
    monkeypatch.setattr(ranges, "_MAX_LOOKUP_READS", 1000)
    assert error(guarded) == (
        "score_mod indexes a captured tensor of shape (9,) by q_idx and kv_idx, and its ranges cannot show that every "
        "read stays inside it: more than 1000 reads at queries 64 to 127 and keys 0 to 63 are left to evaluate one by "
        "one. Clamp the subscript into the tensor (.clamp(0, 8)) to settle them")


def test_a_result_that_is_not_one_value_per_score_element_is_refused():
    """The trace folds a constant into a number, so a constant's shape is checked before:
    create_block_mask refuses torch.ones(5) as a mask, and so does ringflex, as a ValueError
    (an UnsupportedModError would leave the mod to the kernels, which broadcast it). Constants
    that broadcast to every element stay."""
    for trace, mod, shape in ((trace_mask_mod, lambda b, h, q, kv: torch.ones(5, dtype=torch.bool), "(5,)"),
                              (trace_score_mod, lambda s, b, h, q, kv: s + torch.zeros(5), "(5,)"),
                              (trace_mask_mod, lambda b, h, q, kv: (q >= kv) & torch.ones(2, 1, dtype=torch.bool),
                               "(2, 1)")):
        with pytest.raises(ValueError, match=re.escape(f"returned a tensor of shape {shape} for arguments of shape "
                                                       "(1,): it must return one value per score element")) as info:
            trace(mod)
        assert info.type is ValueError
    for constant in (lambda b, h, q, kv: True, lambda b, h, q, kv: torch.tensor(True),
                     lambda b, h, q, kv: torch.ones(1, dtype=torch.bool), lambda b, h, q, kv: b.new_ones(())):
        assert trace_mask_mod(constant)(*_grid(*SEGMENTS[1])).all()


def test_tensors_requiring_grad_are_found_where_grad_mode_is_on():
    from ringflex.mod.trace import tensors_requiring_grad

    table, frozen = torch.zeros(4, requires_grad=True), torch.zeros(4)
    learnable = lambda score, b, h, q_idx, kv_idx: score + table[h] + frozen[h]  # noqa: E731
    assert tensors_requiring_grad(learnable) == (table,)
    assert tensors_requiring_grad(lambda score, b, h, q_idx, kv_idx: score + frozen[h]) == ()
    # read through .detach(): no gradient (it got one of zeros, which weight decay then moved)
    assert tensors_requiring_grad(lambda score, b, h, q_idx, kv_idx: score + table.detach()[h]) == ()
    assert tensors_requiring_grad(None) == ()
    with torch.no_grad():
        assert tensors_requiring_grad(learnable) == ()


def test_a_mod_is_traced_where_its_tensors_live():
    """Without a device the trace takes its captured tensors' (document ids on a GPU; here the
    meta device), and is the very trace a caller naming that device gets: a mod's traces are
    kept for one device, and callers that disagreed would trace it again at every turn."""
    ids = torch.zeros(8, dtype=torch.int64, device="meta")
    mask = mods.document(ids)
    assert trace_mask_mod(mask) is trace_mask_mod(mask, torch.device("meta"))
