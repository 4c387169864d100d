"""Training helpers: a sharded batch, global positions, next-token labels, and a loss whose value
and (summed) parameter gradients equal the single-process ones, however unevenly the
labelled tokens fall on the ranks."""
import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ringflex
from support.harness import run_world
from ringflex.module import RingFlexAttention
from ringflex.plan import layout as layouts
from ringflex.training import (next_token_labels, position_ids, reduce_gradients, shard_batch,
                               sharded_cross_entropy)

VOCAB, DIM, HEADS = 11, 8, 2


def test_next_token_labels():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert next_token_labels(tokens).tolist() == [[6, 7, 8, 9, 10, -100]]
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 2])
    assert next_token_labels(tokens, doc_ids=doc_ids, ignore_index=-1).tolist() == [[6, 7, -1, 9, -1, -1]]
    with pytest.raises(ValueError, match="one id per token"):
        next_token_labels(tokens, doc_ids=doc_ids[:5])


def test_shard_batch_keeps_structure_and_shape_errors():
    batch = {"input_ids": torch.arange(8).view(1, 8), "labels": [torch.arange(8).view(1, 8)], "name": "x"}
    assert shard_batch(batch)["name"] == "x"
    assert torch.equal(shard_batch(batch)["labels"][0], batch["labels"][0])  # one rank: everything
    Batch = collections.namedtuple("Batch", "tokens labels")
    sharded = shard_batch(Batch(torch.arange(8).view(1, 8), torch.arange(8).view(1, 8)))
    assert type(sharded) is Batch and torch.equal(sharded.labels, torch.arange(8).view(1, 8))
    defaulting = shard_batch(collections.defaultdict(list, batch))  # could not be built from its items alone
    assert type(defaulting) is collections.defaultdict and defaulting.default_factory is list
    assert position_ids(8).tolist() == list(range(8))
    with pytest.raises(ValueError, match=r"logits \[..., vocab\] and labels"):
        sharded_cross_entropy(torch.zeros(2, 3, VOCAB), torch.zeros(2, 4, dtype=torch.long))


class TinyLM(nn.Module):
    """Embedding, one causal self-attention (plain SDPA) with a learned position bias, a head."""

    def __init__(self, seq_len):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.pos = nn.Embedding(seq_len, DIM, dtype=torch.float64)
        self.qkv = nn.Linear(DIM, 3 * DIM, dtype=torch.float64)
        self.head = nn.Linear(DIM, VOCAB, dtype=torch.float64)

    def forward(self, tokens, positions):
        x = self.embed(tokens) + self.pos(positions)
        q, k, v = self.qkv(x).unflatten(-1, (3 * HEADS, DIM // HEADS)).transpose(1, 2).chunk(3, dim=1)
        return self.head(x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def _batch(seq_len):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, seq_len), generator=g)
    labels = next_token_labels(tokens)
    labels[:, : seq_len * 2 // 5] = -100  # the labelled tokens fall unevenly on the ranks
    return tokens, labels


def _step(rank, world_size, layout):
    seq_len = 8 * world_size
    torch.manual_seed(0)
    model = TinyLM(seq_len)
    tokens, labels = _batch(seq_len)
    positions = torch.arange(seq_len).expand(2, -1)
    want = F.cross_entropy(model(tokens, positions).flatten(0, 1), labels.flatten())
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    local = shard_batch({"tokens": tokens, "labels": labels}, layout=layout)
    assert torch.equal(position_ids(seq_len, layout=layout), layouts.positions(layout, seq_len, world_size, rank))
    logits = RingFlexAttention(model, layout=layout, backend="reference")(
        local["tokens"], position_ids(seq_len, layout=layout).expand(2, -1))
    loss = sharded_cross_entropy(logits, local["labels"])
    loss.backward()
    reduce_gradients(model.parameters())
    local_count = int((local["labels"] != -100).sum())
    return (abs(loss.item() - want.item()), max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), want_grads)),
            local_count, ringflex.unshard(logits.detach(), 1, layout=layout).shape)


@pytest.mark.parametrize("world_size,layout", [(2, "contiguous"), (3, "zigzag")])
def test_sharded_loss_and_gradients_match_single_process(world_size, layout):
    results = run_world(world_size, _step, layout)
    counts = [r[2] for r in results]
    assert len(set(counts)) > 1  # uneven: a per-rank mean would be wrong
    for loss_error, grad_error, _, shape in results:
        assert loss_error < 1e-12 and grad_error < 1e-12, (loss_error, grad_error)
        assert shape == (2, 8 * world_size, VOCAB)


def _reduce_partly_used(rank, world_size):
    """Rank 1's tokens skip a branch: its ``skipped`` weight gets no gradient there."""
    torch.manual_seed(0)
    used, skipped, unused = (nn.Parameter(torch.randn(3, dtype=torch.float64)) for _ in range(3))
    x = torch.full((3,), float(rank + 1), dtype=torch.float64)
    loss = (used * x).sum() + ((skipped * x).sum() if rank == 0 else 0.0)
    loss.backward()
    reduce_gradients([used, skipped, unused])
    return used.grad.tolist(), skipped.grad.tolist(), unused.grad


def test_reduce_gradients_sums_grads_a_rank_did_not_make():
    for used, skipped, unused in run_world(2, _reduce_partly_used):
        assert used == [3.0] * 3  # 1 + 2
        assert skipped == [1.0] * 3  # rank 0's alone
        assert unused is None  # no gradient anywhere: still none


def _reduce_different_models(rank, world_size):
    params = [nn.Parameter(torch.zeros(2)) for _ in range(2 + rank)]
    for p in params:
        p.grad = torch.ones(2)
    try:
        reduce_gradients(params)
    except ValueError as e:
        return str(e)
    return "no error"


def test_reduce_gradients_of_different_parameters_raises_on_every_rank():
    messages = run_world(2, _reduce_different_models, timeout=60)
    assert messages[0] == messages[1]
    assert "rank 0: 2 parameters" in messages[0] and "rank 1: 3 parameters" in messages[0]


def _bad_labels_on_one_rank(rank, world_size):
    logits, labels = torch.randn(1, 8, 5, dtype=torch.float64), torch.randint(0, 5, (1, 8))
    if rank == 0:
        labels[0, 0] = 7  # past the vocabulary
    with pytest.raises(ValueError) as raised:
        sharded_cross_entropy(logits, labels)
    return str(raised.value)


def test_a_loss_refused_on_one_rank_raises_on_every_rank():
    """The other ranks waited in the all-reduce of the labelled tokens' count."""
    for message in run_world(2, _bad_labels_on_one_rank):
        assert message == "rank 0: sharded_cross_entropy: IndexError: Target 7 is out of bounds."
