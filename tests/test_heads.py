"""Heads x ring: ``group=mesh``, a 2-D DeviceMesh of dimensions ("heads", "ring"), on 4 gloo
ranks (meshes 2x2, 4x1 and 1x4) against the float64 single-process truth: every layout,
masks and score mods that read the head (captured per-head tensors at the GLOBAL head), GQA
and MQA, sinks and a learnable score_mod tensor, the LSE; forward and dq, dk, dv. Bad head
counts and calls the ranks disagree on raise the same error on every rank before any
transfer; a rank that raises inside the ring (forward or backward) fails the other ranks of
the mesh promptly; shard / unshard / position_ids follow the mesh's order; the wrapper and
the training helpers take the mesh."""
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import ringflex
from support.harness import run_world
from support.models import TinyModel
from support.oracle import attention
from ringflex import mods, training
from ringflex.parallel import mesh as meshes
from ringflex.plan import layout as layouts

WORLD = 4
MESHES = [(2, 2), (4, 1), (1, 4)]
S, D = 32, 8  # global tokens (8 per rank), head dim


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("heads", "ring"))


def _cases():
    """name -> (query heads, kv heads, score_mod, mask_mod, learnable, global kv length):
    head-dependent mods read per-head tensors of ALL heads by the global head index."""
    doc_ids = mods.document_ids([5, 1, 9, 3, 14])
    windows4, windows8 = torch.tensor([1, 3, 6, 40]), torch.arange(8) * 3 + 1
    slopes4, slopes8 = mods.alibi_slopes(4).double(), mods.alibi_slopes(8).double()

    def window_of(windows):
        def head_window(b, h, q_idx, kv_idx):  # a window per head, from a captured tensor
            return (q_idx >= kv_idx) & (q_idx - kv_idx < windows[h])
        return head_window

    def head_dependent(b, h, q_idx, kv_idx):  # even heads causal, odd heads a window of 3
        return (kv_idx <= q_idx) & ((h % 2 == 0) | (q_idx - kv_idx < 3))

    softcap = mods.softcap(2.0)
    alibi8 = mods.alibi(slopes8)

    def softcap_alibi(score, b, h, q_idx, kv_idx):
        return alibi8(softcap(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return {
        "causal": (4, 4, None, mods.causal, False, S),
        "documents": (4, 4, None, mods.document(doc_ids), False, S),
        "head_window": (4, 4, None, window_of(windows4), False, S),
        "alibi": (4, 4, mods.alibi(slopes4), mods.causal, False, S),
        "softcap": (4, 4, softcap, None, False, S),
        "head_dependent": (4, 4, None, head_dependent, False, S),
        "cross_alibi": (4, 4, mods.alibi(slopes4), None, False, S // 2),
        "gqa_softcap_alibi_window": (8, 2, softcap_alibi, window_of(windows8), False, S),
        "mqa_documents_softcap": (4, 1, softcap, mods.document(doc_ids, causal_within=False), False, S),
        "gqa_sinks_learnable_alibi_lse": (4, 2, None, mods.causal, True, S),
    }


def _inputs(hq, hkv, seed, kv_len=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, n, D, generator=g, dtype=torch.float64) for h, n in ((hq, S), (hkv, kv_len),
                                                                                    (hkv, kv_len), (hq, S))]


def _worst(got, want):
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def _matrix(rank, world_size, shape, layouts_, names):
    """Per (layout, case): the worst error of the output and dq, dk, dv (and, where learnable,
    the LSE and the gradients of the sinks and the slopes, summed over the mesh)."""
    mesh = _mesh(shape)
    cases, errors = _cases(), {}
    for layout in layouts_:
        for name in names:
            hq, hkv, score_mod, mask_mod, learnable, kv_len = cases[name]
            q, k, v, dout = _inputs(hq, hkv, seed=len(errors), kv_len=kv_len)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            local = [ringflex.shard(t, 2, group=mesh, layout=layout).requires_grad_() for t in (q, k, v)]
            dlocal = ringflex.shard(dout, 2, group=mesh, layout=layout)
            if not learnable:
                want = attention(*full, score_mod, mask_mod)
                want.backward(dout)
                out = ringflex.ring_flex_attention(*local, score_mod=score_mod, mask_mod=mask_mod, group=mesh,
                                                   layout=layout, enable_gqa=hq != hkv, backend="reference")
                out.backward(dlocal)
                extra_got, extra_want = [], []
            else:  # sinks, slopes that learn, and a loss that reads the LSE
                params = [torch.linspace(-1, 1, hq, dtype=torch.float64), mods.alibi_slopes(hq).double()]
                mine, theirs = ([nn.Parameter(p.clone()) for p in params] for _ in range(2))
                want, want_lse = attention(*full, mods.alibi(theirs[1]), mask_mod, return_lse=True, sinks=theirs[0])
                ((want * dout).sum() + want_lse.square().sum()).backward()
                out, lse = ringflex.ring_flex_attention(*local, score_mod=mods.alibi(mine[1]), mask_mod=mask_mod,
                                                        group=mesh, layout=layout, enable_gqa=True, return_lse=True,
                                                        backend="reference", sinks=mine[0])
                ((out * dlocal).sum() + lse.square().sum()).backward()
                training.reduce_gradients(mine, group=mesh)  # each rank holds its share: summed over the mesh
                extra_got = [ringflex.unshard(lse.detach(), 2, group=mesh, layout=layout)] + [p.grad for p in mine]
                extra_want = [want_lse.detach()] + [p.grad for p in theirs]
            got = [ringflex.unshard(t.detach(), 2, group=mesh, layout=layout) for t in [out] + [t.grad for t in local]]
            errors[layout, name] = _worst(got + extra_got, [want.detach()] + [t.grad for t in full] + extra_want)
    return errors


@pytest.mark.parametrize("shape", MESHES, ids=[f"{a}x{r}" for a, r in MESHES])
def test_mesh_matches_single_process(shape):
    """Every layout and case on the 2x2 mesh; the 4x1 and 1x4 meshes (all heads ranks, or a
    pure ring) every layout and the cases that read heads."""
    names = list(_cases())
    if shape != (2, 2):
        names = ["documents", "head_window", "alibi", "cross_alibi", "gqa_softcap_alibi_window",
                 "mqa_documents_softcap", "gqa_sinks_learnable_alibi_lse"]
    results = run_world(WORLD, _matrix, shape, layouts.LAYOUTS, names, timeout=200)
    for key, error in results[0].items():
        assert error < 1e-10, f"{shape} {key}: {error}"
    assert all(r == results[0] for r in results)  # every rank gathers the same


def _order(rank, world_size, shape):
    """Per layout: this rank's shard positions and what unshard, position_ids and the mesh with
    its dimensions in the other order give."""
    mesh = _mesh(shape)
    other = init_device_mesh("cpu", shape[::-1], mesh_dim_names=("ring", "heads"))  # the same, dims swapped
    heads, ring = mesh.get_local_rank("heads"), mesh.get_local_rank("ring")
    found = {}
    for layout in layouts.LAYOUTS:
        x = torch.arange(S, dtype=torch.float64).view(1, S, 1).expand(2, S, 3).contiguous().requires_grad_()
        mine = ringflex.shard(x, 1, group=mesh, layout=layout)
        whole = ringflex.unshard(mine, 1, group=mesh, layout=layout)
        whole.backward(torch.ones_like(whole))
        swapped = ringflex.shard(x.detach(), 1, group=other, layout=layout)
        ring_segment = layouts.positions(layout, S, shape[1], ring).tolist()
        piece = len(ring_segment) // shape[0]
        found[layout] = dict(
            positions=mine[0, :, 0].long().tolist(), whole=torch.equal(whole, x), grad=x.grad.sum().item(),
            position_ids=training.position_ids(S, group=mesh, layout=layout).tolist(),
            piece=ring_segment[heads * piece:(heads + 1) * piece],
            swapped=swapped[0, :, 0].long().tolist() == layouts.positions(layout, S, shape[1], other.get_local_rank(
                "ring")).tolist()[other.get_local_rank("heads") * piece:(other.get_local_rank("heads") + 1) * piece],
            swapped_whole=torch.equal(ringflex.unshard(swapped, 1, group=other, layout=layout), x.detach()))
    return found


@pytest.mark.parametrize("shape", MESHES, ids=[f"{a}x{r}" for a, r in MESHES])
def test_shard_unshard_and_positions_follow_the_ring_layout_then_the_heads(shape):
    """A rank's shard is piece ``heads`` of the ring layout's segment for its ring coordinate,
    so the heads all-to-all gives each rank that segment; unshard restores the sequence and
    sends each rank the gradient of its own tokens; position_ids are the shard's positions; a
    mesh named ("ring", "heads") orders its tokens by the same coordinates."""
    results = run_world(WORLD, _order, shape)
    for layout in layouts.LAYOUTS:
        seen = []
        for r in (per_rank[layout] for per_rank in results):
            assert r["positions"] == r["piece"] == r["position_ids"], layout
            assert r["whole"] and r["grad"] == 2 * 3 * S // WORLD, layout
            assert r["swapped"] and r["swapped_whole"], layout
            seen += r["positions"]
        assert sorted(seen) == list(range(S)), layout


def _refusals(rank, world_size):
    """Calls that must raise the same error on every rank before any transfer; and after them,
    a good call on the same mesh."""
    said = []
    for shape, hq, hkv, extra in (((4, 1), 6, 6, {}),  # 6 query heads over 4 heads ranks
                                  ((2, 2), 4, 3, {"enable_gqa": True}),  # 4 query heads, 3 kv heads
                                  ((2, 2), 4, 4, {"sinks": torch.zeros(2)}),  # sinks of the local heads
                                  ((2, 2), 4, 4, {"score_mod": mods.alibi(torch.ones(2))}),  # 2 slopes for 4 heads
                                  ((2, 2), 4, 4, {"layout": "contiguous" if rank == 3 else "zigzag"}),
                                  ((2, 2), 4, 4, {"score_mod": mods.softcap(2.0) if rank == 0 else None})):
        mesh = _mesh(shape)
        q, k, v, _ = _inputs(hq, hkv, seed=0)
        local = [ringflex.shard(t, 2, group=mesh) for t in (q, k, v)]
        with pytest.raises(ringflex.CallRejected) as caught:
            ringflex.ring_flex_attention(*local, group=mesh, backend="reference", **extra)
        said.append(str(caught.value))
    q, k, v, _ = _inputs(4, 4, seed=0)
    out = ringflex.ring_flex_attention(*(ringflex.shard(t, 2, group=mesh) for t in (q, k, v)), group=mesh,
                                       mask_mod=mods.causal, backend="reference")
    said.append(_worst([ringflex.unshard(out, 2, group=mesh)], [attention(q, k, v, mask_mod=mods.causal)]))
    return said


def test_bad_head_counts_and_mismatched_calls_raise_on_every_rank():
    results = run_world(WORLD, _refusals)
    assert all(r[:-1] == results[0][:-1] for r in results)  # the same text on every rank
    said = results[0]
    assert "q has 6 heads, which the mesh's \"heads\" dimension of 4 ranks cannot split" in said[0]
    assert "query heads (4) must be a multiple of key/value heads (3): k has 3 heads" in said[1]
    assert "sinks must be a floating-point tensor of one logit per query head, [4] on cpu, got torch.float32 of shape (2,) on cpu" in said[2]
    assert "rank 2: " in said[3] and "score_mod" in said[3]  # heads 2 and 3 read past the 2 slopes: heads rank 1
    assert "disagree on the layout" in said[4]
    assert "disagree on the score_mod" in said[5]
    assert results[0][-1] < 1e-12  # the mesh is still usable


_ARMED = threading.Event()  # set for the backward: the mods' trace before the ring must not raise


def _fault_in_forward(score, b, h, q_idx, kv_idx):
    """Raises on rank 1 inside the ring's forward (its hops run without grad)."""
    if dist.get_rank() == 1 and not torch.is_grad_enabled():
        raise RuntimeError("injected fault")
    return score


def _fault_in_backward(score, b, h, q_idx, kv_idx):
    """Raises on rank 2 inside the ring's backward."""
    if dist.get_rank() == 2 and _ARMED.is_set():
        raise RuntimeError("injected fault")
    return score


def _faults(rank, world_size):
    sync = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for shape, name, score_mod in (((2, 2), "forward", _fault_in_forward), ((2, 2), "backward", _fault_in_backward),
                                   ((4, 1), "backward", _fault_in_backward)):
        mesh = _mesh(shape)
        q, k, v = (torch.randn(1, 4, 8, D, requires_grad=True) for _ in range(3))
        start = time.monotonic()
        try:
            out = ringflex.ring_flex_attention(q, k, v, score_mod=score_mod, group=mesh, layout="contiguous",
                                               backend="reference")
            _ARMED.set()
            out.sum().backward()
            error = None
        except Exception as e:  # noqa: BLE001 (the test inspects the text)
            error = f"{type(e).__name__}: {e}"
        _ARMED.clear()
        took = time.monotonic() - start
        try:
            ringflex.ring_flex_attention(q, k, v, group=mesh, backend="reference")
            again = None
        except Exception as e:  # noqa: BLE001
            again = f"{type(e).__name__}: {e}"
        results[f"{shape} {name}"] = (error, took, again)
        dist.barrier(group=sync)  # the raising rank waits here, alive
    return results


def test_a_rank_raising_inside_the_ring_fails_every_rank_of_the_mesh():
    """Forward on a 2x2 mesh; backward on a 2x2 mesh and on a 4x1 mesh (rings of one rank,
    whose failure only the mesh's own guard reports): the raising rank raises its error, the
    others RingFailure promptly, and the mesh stays failed."""
    per_rank = run_world(WORLD, _faults, timeout=120)
    for key, culprit in (("(2, 2) forward", 1), ("(2, 2) backward", 2), ("(4, 1) backward", 2)):
        for rank, results in enumerate(per_rank):
            error, took, again = results[key]
            assert error is not None and took < 15, (key, rank, error, took)
            if rank == culprit:
                assert error.startswith("RuntimeError: injected fault"), (key, rank, error)
            else:
                assert error.startswith("RingFailure"), (key, rank, error)
                assert "injected fault" in error, (key, rank, error)
            assert again is not None and again.startswith("RingFailure"), (key, rank, again)


def _training_step(rank, world_size, shape):
    """RingFlexAttention on the mesh, sharded batch, position ids, loss and summed gradients,
    against one process; and packed sequences over the mesh."""
    mesh = _mesh(shape)
    tokens = torch.randint(0, 11, (1, S), generator=torch.Generator().manual_seed(0))
    labels = training.next_token_labels(tokens)
    single = TinyModel(heads=4, length=S)
    loss = F.cross_entropy(single(tokens, torch.arange(S)).flatten(0, 1), labels.flatten())
    loss.backward()
    model = TinyModel(heads=4, length=S)
    wrapped = ringflex.RingFlexAttention(model, group=mesh, layout="zigzag", backend="reference")
    local = training.shard_batch({"tokens": tokens, "labels": labels}, group=mesh)
    positions = training.position_ids(S, group=mesh)
    got = training.sharded_cross_entropy(wrapped(local["tokens"], positions), local["labels"], group=mesh)
    got.backward()
    training.reduce_gradients(model.parameters(), group=mesh)
    grad_error = max((p.grad - w.grad).abs().max().item() for p, w in zip(model.parameters(), single.parameters()))
    # packed sequences, padded to what the mesh's order takes (2x2, zigzag: a multiple of 4)
    packed = ringflex.PackedSequences([5, 11, 13], group=mesh)
    q, k, v = (torch.randn(29, 4, D, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
               for i in range(3))
    out = ringflex.varlen_attention(*(packed.shard(t) for t in (q, k, v)), packed, backend="reference")
    want = attention(*(packed.pad(t).transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                     mask_mod=packed.mask_mod()).squeeze(0).transpose(0, 1)[:29]
    return abs(got.item() - loss.item()), grad_error, packed.padded_len, _worst([packed.unshard(out)], [want])


def test_the_wrapper_and_the_training_helpers_take_the_mesh():
    for loss_error, grad_error, padded, packed_error in run_world(WORLD, _training_step, (2, 2)):
        assert loss_error < 1e-12 and grad_error < 1e-12
        assert padded == 32 and packed_error < 1e-12


def test_a_one_dimensional_group_is_not_a_heads_x_ring_mesh():
    assert meshes.describe(None) is None
