"""The flex_attention kernel on CPU. torch's flex_attention has no CPU backward, so the ring
tests give the kernel a dense attention with flex_attention's semantics (block mask tiles
included); torch's own flex_attention runs the forward, uncompiled. The compiled kernel is
tested on a GPU (tests/gpu)."""
import pytest
import torch

import ringflex
from support.cases import cases, make_inputs
from support.harness import run_world
from support.oracle import attention
from ringflex.kernels import select_kernel
from ringflex.kernels.base import Mods
from ringflex.kernels.flex import FlexKernel, _flex_attention
from ringflex.kernels.reference import ReferenceKernel
from ringflex.plan.layout import Segment
from test_numerics import _score_ignoring_errors
from test_ring import TOLERANCE, _lse_gradient_errors, _max_errors, _tensor_gradient_errors, _with_kernel

TILE = 4  # small tiles: the toy blocks of the ring tests hold several


def _visible_tiles(counts: torch.Tensor, indices: torch.Tensor, num_kv: int) -> torch.Tensor:
    """[B, H, nq, nk] bool from flex_attention's (counts, indices) of one kind of tile."""
    picked = torch.arange(indices.shape[-1]) < counts.unsqueeze(-1)
    tiles = torch.zeros(*indices.shape[:-1], num_kv, dtype=torch.bool)
    return tiles.scatter_(-1, indices.long(), picked) if picked.any() else tiles


def dense_flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options=None):
    """flex_attention from its definition, differentiable on CPU: the score_mod on every pair,
    the mask_mod only in partial tiles, nothing in empty ones; (out in q's dtype, fp32 LSE)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).to(dtype), v.repeat_interleave(groups, 1).to(dtype)
    s = q.to(dtype) @ k.transpose(-1, -2) * scale
    index = lambda n, dim: torch.arange(n, dtype=torch.int32).view([-1 if d == dim else 1 for d in range(4)])
    b, h, qi, ki = index(q.shape[0], 0), index(q.shape[1], 1), index(q.shape[2], 2), index(k.shape[2], 3)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if block_mask is not None:
        tile_q, tile_kv = block_mask.BLOCK_SIZE
        num_kv = -(-k.shape[2] // tile_kv)
        partial = _visible_tiles(block_mask.kv_num_blocks, block_mask.kv_indices, num_kv)
        full = _visible_tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, num_kv)
        per_pair = lambda tiles: tiles.repeat_interleave(tile_q, 2)[:, :, :q.shape[2]].repeat_interleave(
            tile_kv, 3)[..., :k.shape[2]]
        visible = per_pair(full) | (per_pair(partial) & block_mask.mask_mod(b, h, qi, ki))
        s = torch.where(visible, s, float("-inf"))
    sees_any = (s > float("-inf")).any(-1, keepdim=True)
    s = torch.where(sees_any, s, 0.0)
    lse = torch.where(sees_any[..., 0], torch.logsumexp(s, -1), float("-inf"))
    out = torch.where(sees_any, torch.softmax(s, -1), 0.0) @ v
    return out.to(q.dtype), lse.float() if dtype == torch.float32 else lse


def _kernel():
    return FlexKernel(attend=dense_flex_attention, tile=TILE)


def _flex_errors(rank, world_size, layout):
    _with_kernel(_kernel())
    return _max_errors(rank, world_size, layout)


@pytest.mark.parametrize("world_size, layout", [(1, "zigzag"), (2, "zigzag"), (2, "contiguous"), (3, "striped"),
                                               (3, "contiguous")])
def test_ring_on_the_flex_kernel_matches_single_process(world_size, layout):
    """Every case of the matrix, forward and backward (the backward recomputes each hop and
    weights its output and LSE gradients by the merge): global positions through tensors,
    block masks from ringflex's tiles, blocks kept whole where the mask allows."""
    failures = [f"rank {rank} {name} {dtype}: out/dq/dk/dv errors {errs}"
                for rank, errors in enumerate(run_world(world_size, _flex_errors, layout))
                for (name, dtype), errs in errors.items()
                if max(errs) > TOLERANCE[getattr(torch, dtype.split(".")[1])]]
    assert not failures, "\n".join(failures)


def _flex_lse_errors(rank, world_size, layout):
    _with_kernel(_kernel())
    return _lse_gradient_errors(rank, world_size, layout)


def test_lse_gradients_on_the_flex_kernel():
    failures = [f"rank {rank} {name} {dtype} lse only {lse_only}: errors {errs}"
                for rank, errors in enumerate(run_world(2, _flex_lse_errors, "zigzag"))
                for (name, dtype, lse_only), errs in errors.items()
                if max(errs) > TOLERANCE[getattr(torch, dtype.split(".")[1])]]
    assert not failures, "\n".join(failures)


def _flex_tensor_errors(rank, world_size, layout):
    _with_kernel(_kernel())
    return _tensor_gradient_errors(rank, world_size, layout)


@pytest.mark.parametrize("world_size", [1, 2])
def test_learnable_tensors_get_their_gradients_on_the_flex_kernel(world_size):
    """What cuDNN cannot give: gradients of tensors the score_mod reads (learnable biases)."""
    failures = [f"rank {rank} {name} (reads the LSE: {reads_lse}): errors {errs}"
                for rank, errors in enumerate(run_world(world_size, _flex_tensor_errors, "zigzag"))
                for (name, reads_lse), errs in errors.items() if max(errs) > 1e-10]
    assert not failures, "\n".join(failures)


def _flex_score_ignoring_errors(rank, world_size):
    _with_kernel(_kernel())
    return _score_ignoring_errors(rank, world_size)


def test_score_mods_that_ignore_the_score_on_the_flex_kernel():
    """dq = dk = 0 where the score is ignored, though the dense stand-in's LSE then has no gradient."""
    for rank, errors in enumerate(run_world(2, _flex_score_ignoring_errors)):
        failures = {name: errs for name, errs in errors.items() if max(errs) > 1e-10}
        assert not failures, f"rank {rank}: out/dq/dk/dv/dbias errors {failures}"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("tile", [4, 128])
@pytest.mark.parametrize("name", ["causal", "documents", "alibi", "image_2d", "head_dependent", "gqa_softcap_alibi",
                                  "late_queries"])
def test_torchs_flex_attention_runs_a_hop_at_global_positions(name, tile):
    """torch's flex_attention itself (uncompiled, forward) on a hop in the middle of the
    sequence, against the definition on the whole sequence's rows and keys of that hop."""
    seq_len, q_seg, kv_seg = 40, Segment(17, 1, 13), Segment(3, 2, 15)
    case = cases(seq_len)[name]
    q, k, v, _ = make_inputs(case, seq_len, dtype=torch.float64)
    rows, keys = q_seg.positions().long(), kv_seg.positions().long()
    q, k, v = q[:, :, rows], k[:, :, keys], v[:, :, keys]
    out, lse, _ = FlexKernel(attend=_flex_attention, tile=tile).forward(
        q, k, v, q_seg, kv_seg, Mods(case.score_mod, case.mask_mod), q.shape[-1] ** -0.5, masked=True)
    score_mod = case.score_mod and (lambda s, b, h, qi, ki: case.score_mod(s, b, h, rows[qi], keys[ki]))
    mask_mod = case.mask_mod and (lambda b, h, qi, ki: case.mask_mod(b, h, rows[qi], keys[ki]))
    want_out, want_lse = attention(q, k, v, score_mod, mask_mod, return_lse=True)
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    torch.testing.assert_close(lse.nan_to_num(0.0, neginf=0.0), want_lse.nan_to_num(0.0, neginf=0.0))
    torch.testing.assert_close(out, want_out)


def test_choosing_the_flex_kernel():
    q = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="backend='flex' cannot run this call: inputs are not on a CUDA device"):
        select_kernel("flex", q, q, q, Mods())
    assert select_kernel("auto", q, q, q, Mods()).name == "reference"  # on CPU, silently: nothing faster exists


def test_backend_flex_is_rejected_on_cpu_by_every_rank():
    q = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="backend='flex'"):
        ringflex.ring_flex_attention(q, q, q, backend="flex")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_each_pair_of_mod_codes_compiles_a_function_of_its_own(monkeypatch):
    """torch keeps compiled graphs per code object: mods of one code (new tables, new hop
    offsets) share a compiled function, mods of another code get their own copy of it."""
    from ringflex.kernels import flex

    compiled = []
    real_compile = torch.compile

    def compile(fn, **kwargs):  # ringflex's functions are recorded and run as they are
        if fn.__module__ != flex.__name__:
            return real_compile(fn, **kwargs)  # torch's own uses inside flex_attention
        compiled.append(fn)
        return fn
    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setattr(flex, "_COMPILED", type(flex._COMPILED)())
    q = torch.randn(1, 2, 8, 16)
    kernel = FlexKernel(tile=4)
    seg, later = Segment(0, 1, 8), Segment(8, 1, 8)
    alibi = [ringflex.mods.alibi(torch.rand(2)) for _ in range(2)]
    with torch.no_grad():
        for score_mod, mask_mod, q_seg in [(alibi[0], ringflex.mods.causal, seg), (alibi[1], ringflex.mods.causal, later),
                                           (ringflex.mods.softcap(2.0), ringflex.mods.causal, seg),
                                           (ringflex.mods.softcap(3.0), None, seg)]:
            out, lse, _ = kernel.forward(q, q, q, q_seg, seg, Mods(score_mod, mask_mod), 0.25, masked=True)
            want_out, want_lse, _ = ReferenceKernel().forward(q, q, q, q_seg, seg, Mods(score_mod, mask_mod), 0.25,
                                                              True)
            torch.testing.assert_close(out, want_out)
    assert len(compiled) == 3 and len({fn.__code__ for fn in compiled}) == 3


def test_kernels_short_of_shared_memory_compile_with_fewer_pipeline_stages(monkeypatch):
    """A GPU whose shared memory holds only 2 stages of the forward and 1 of the backward:
    each pass steps down torch's default pipeline once, says so once, and later calls start
    at the depth that fitted. Numbers are the same; other compilation errors pass through."""
    from ringflex import config
    from ringflex.kernels import flex

    options_seen = []

    def tight(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options=None):
        options = kernel_options or {}
        options_seen.append((torch.is_grad_enabled(), dict(options)))
        depth = options.get("bwd_num_stages" if torch.is_grad_enabled() else "fwd_num_stages", 3)
        if depth > (1 if torch.is_grad_enabled() else 2):
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_"
                               "attention_0 Required: 245760 Hardware limit:232448")
        return dense_flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options)

    monkeypatch.setattr(flex, "_FITTING_STAGES", {})
    monkeypatch.setattr(config, "_WARNED", set())
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3))
    seg, mods = Segment(0, 1, 8), Mods(ringflex.mods.softcap(2.0), ringflex.mods.causal)
    want = FlexKernel(attend=dense_flex_attention, tile=4)
    want_out, want_lse, _ = want.forward(q, k, v, seg, seg, mods, 0.25, True)
    want_grads = want.backward(q, k, v, want_out, want_lse, q, seg, seg, mods, 0.25, True)
    with pytest.warns(UserWarning) as warned:
        for _ in range(2):
            kernel = FlexKernel(attend=tight, tile=4)  # a new kernel each call, as select_kernel gives
            out, lse, _ = kernel.forward(q, k, v, seg, seg, mods, 0.25, True)
            grads = kernel.backward(q, k, v, out, lse, q, seg, seg, mods, 0.25, True)
            torch.testing.assert_close((out, lse, *grads), (want_out, want_lse, *want_grads))
    assert [str(w.message).split(" kernels")[0] for w in warned] == [
        "ringflex: flex_attention's forward", "ringflex: flex_attention's backward"]
    depths = [(grad, options.get("fwd_num_stages"), options.get("bwd_num_stages")) for grad, options in options_seen]
    first_call = [(False, None, None), (False, 2, 2), (True, None, None), (True, 2, 2), (True, 1, 1)]
    assert depths == first_call + [(False, 2, 2), (True, 1, 1)]

    def broken(*args, **kwargs):
        raise RuntimeError("an unsupported op in the score_mod")
    with pytest.raises(RuntimeError, match="unsupported op"):
        FlexKernel(attend=broken, tile=4).forward(q, k, v, seg, seg, mods, 0.25, True)


def test_hops_torch_cannot_compile_run_on_the_reference_kernel(monkeypatch):
    """torch failing to compile a hop's kernels (it did at small, odd hop lengths) must not
    break the ring: the hop runs on the reference kernel, which says so once per pass, and
    hops of the same shapes do not try to compile again."""
    from torch._inductor.exc import InductorError

    from ringflex import config
    from ringflex.kernels import flex

    attempts = []

    def failing(q, *args, **kwargs):
        attempts.append(torch.is_grad_enabled())
        raise InductorError(RuntimeError("LoweringException: NoValidChoicesError: No choices to select"), None)

    monkeypatch.setattr(flex, "_UNCOMPILED", set())
    monkeypatch.setattr(config, "_WARNED", set())
    q, k, v = (torch.randn(1, 2, 7, 16) for _ in range(3))
    seg, mods = Segment(0, 1, 7), Mods(ringflex.mods.softcap(2.0), ringflex.mods.causal)
    reference = ReferenceKernel()
    want_out, want_lse, _ = reference.forward(q, k, v, seg, seg, mods, 0.25, True)
    want_grads = reference.backward(q, k, v, want_out, want_lse, q, seg, seg, mods, 0.25, True)
    with pytest.warns(UserWarning) as warned:
        for _ in range(2):
            kernel = FlexKernel(attend=failing, tile=4)
            out, lse, _ = kernel.forward(q, k, v, seg, seg, mods, 0.25, True)
            grads = kernel.backward(q, k, v, out, lse, q, seg, seg, mods, 0.25, True)
            torch.testing.assert_close((out, lse, *grads), (want_out, want_lse, *want_grads))
    assert [str(w.message).split(" kernels")[0] for w in warned] == [
        "ringflex: torch could not compile flex_attention's forward",
        "ringflex: torch could not compile flex_attention's backward"]
    assert attempts == [False, True]  # once per pass: the second call went to the reference kernel at once
