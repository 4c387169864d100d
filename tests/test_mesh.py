"""A DeviceMesh as ``group``: the context-parallel dimension of a data x context mesh (as
torch's own ``context_parallel`` takes it) names the same ring as its process group, in every
function that takes a group; a mesh of more dimensions, another object, or a group that leaves
the rank out is refused before any collective."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ringflex
from support.cases import cases, make_inputs
from support.harness import run_world
from support.models import TinyModel
from support.oracle import attention
from ringflex import training


def _mesh_calls(rank, world_size):
    """On a 2 (dp) x 2 (cp) mesh: every function given ``mesh["cp"]``, against the same call
    given its process group, and the ring against the single-process truth of the replica's
    sequence (each data-parallel replica has a sequence of its own)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp, group = mesh["cp"], mesh.get_group("cp")
    replica = mesh.get_local_rank("dp")
    case = cases(16)["documents"]
    q, k, v, dout = make_inputs(case, 16, dtype=torch.float64, seed=replica)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attention(*full, case.score_mod, case.mask_mod)
    expected.backward(dout)
    local = [ringflex.shard(t, 2, group=cp).requires_grad_() for t in (q, k, v)]
    out = ringflex.ring_flex_attention(*local, score_mod=case.score_mod, mask_mod=case.mask_mod, group=cp,
                                       backend="reference")
    out.backward(ringflex.shard(dout, 2, group=cp))
    for got, want in zip([out] + [t.grad for t in local], [expected] + [t.grad for t in full]):
        torch.testing.assert_close(ringflex.unshard(got.detach(), 2, group=cp), want.detach())

    logits, labels = torch.randn(1, 8, 5, dtype=torch.float64), torch.randint(0, 5, (1, 8))
    same = {
        "shard": lambda g: ringflex.shard(q, 2, group=g),
        "unshard": lambda g: ringflex.unshard(q, 2, group=g),
        "shard_batch": lambda g: training.shard_batch({"x": q}, dim=2, group=g)["x"],
        "position_ids": lambda g: training.position_ids(16, group=g),
        "sum_over_ranks": lambda g: training.sum_over_ranks(torch.ones(1), group=g),
        "sharded_cross_entropy": lambda g: training.sharded_cross_entropy(logits, labels, group=g),
        "PackedSequences": lambda g: ringflex.PackedSequences([5, 11], group=g).shard(q[0, 0]),
    }
    for name, fn in same.items():
        torch.testing.assert_close(fn(cp), fn(group), msg=name)
    weights = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for w in weights:
        w.grad = torch.full((3,), float(rank))
    training.reduce_gradients(weights[:1], group=cp)
    training.reduce_gradients(weights[1:], group=group)
    torch.testing.assert_close(weights[0].grad, weights[1].grad)
    mode = ringflex.RingFlexMode(group=cp)
    return mode.group is group


def test_the_context_dimension_of_a_mesh_is_the_ring_of_its_group():
    assert all(run_world(4, _mesh_calls))


def _refused(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    q = torch.randn(1, 1, 4, 8)
    said = []
    outside = dist.new_group([0, 1])  # on ranks 2 and 3: new_group's marker for "not a member"
    for group in (mesh, "cp") + ((outside,) if rank >= 2 else ()):
        for call in (lambda: ringflex.ring_flex_attention(q, q, q, group=group), lambda: ringflex.shard(q, 2, group),
                     lambda: ringflex.RingFlexMode(group=group)):
            with pytest.raises((ValueError, TypeError)) as caught:
                call()
            said.append(str(caught.value))
    return said


def test_a_mesh_of_two_dimensions_and_other_objects_are_refused_before_any_collective():
    results = run_world(4, _refused)
    for said in results:
        assert said[:3] == ["group must be a 1-D DeviceMesh (the ring's dimension, e.g. mesh['cp']), got a 2-D "
                            "DeviceMesh of shape (2, 2) ('dp', 'cp')"] * 3
        assert said[3:6] == ["group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got str"] * 3
    for rank in (2, 3):
        assert results[rank][6:] == [f"group does not include this process (global rank {rank}): only the ranks "
                                     "of the group may call ringflex with it"] * 3


def _fsdp_over_data_ring_over_context(rank, world_size):
    """FSDP2 over ``dp``, the ring over ``cp``: every parameter's gradient against one process
    that averages the two replicas' losses; and FSDP over all ranks, refused."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    tokens = torch.randint(0, 11, (2, 1, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (2, 1, 16), generator=torch.Generator().manual_seed(1))
    single = TinyModel()
    sum(F.cross_entropy(single(t).flatten(0, 1), l.flatten()) for t, l in zip(tokens, labels)).div(2).backward()
    model = TinyModel()
    fully_shard(model, mesh=mesh["dp"])
    wrapped = ringflex.RingFlexAttention(model, group=mesh["cp"], backend="reference")
    replica = mesh.get_local_rank("dp")
    local = training.shard_batch({"t": tokens[replica], "l": labels[replica]}, group=mesh["cp"])
    training.sharded_cross_entropy(wrapped(local["t"]), local["l"], group=mesh["cp"]).backward()
    training.reduce_gradients(model.parameters(), mesh["cp"])
    errors = [(p.grad.full_tensor() - w.grad).abs().max().item() for p, w in zip(model.parameters(), single.parameters())]
    everywhere = TinyModel()
    fully_shard(everywhere, mesh=init_device_mesh("cpu", (4,)))
    everywhere(tokens[0]).sum().backward()
    with pytest.raises(ValueError, match="FSDP shards these parameters over ranks of the ring's group") as refused:
        training.reduce_gradients(everywhere.parameters(), mesh["cp"])
    return max(errors), str(refused.value)


def test_fsdp_over_the_data_dimension_and_the_ring_over_the_context_dimension():
    """reduce_gradients sums each rank's shard of FSDP2's gradients over the ring (it failed on
    them: they are DTensors); where FSDP shards over the ring's ranks it reduces them itself."""
    for error, _ in run_world(4, _fsdp_over_data_ring_over_context):
        assert error < 1e-12
