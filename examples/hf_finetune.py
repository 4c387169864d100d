"""Fine-tune a Hugging Face Llama with transformers' Trainer, its attention a ringflex ring.

Each rank of a ring holds a share of every sequence: the Trainer runs unchanged but for two
overrides (a data loader whose ranks of one ring read the same batches, and the document mask
of each batch handed to the wrapper). The sequences are packed documents: each token sees the
earlier tokens of its own document, and RoPE restarts at every document.

    torchrun --nproc_per_node=2 examples/hf_finetune.py                # CPU: one ring of 2 (gloo)
    torchrun --nproc_per_node=4 examples/hf_finetune.py --cp 2         # 2 replicas x a ring of 2
    python examples/hf_finetune.py                                     # one process, transformers' own
                                                                       # attention: the reference
    torchrun --nproc_per_node=8 examples/hf_finetune.py --device cuda --bf16 --dtype float32 --cp 4 \\
        --seq-len 65536 --hidden 1024 --layers 8 --heads 16 --kv-heads 4 --vocab 32000   # (not yet run on GPUs)

The model is a tiny Llama built from its config (nothing is downloaded); to fine-tune a real
one, load it with ``from_pretrained(..., attn_implementation="ringflex")`` instead. The data is
synthetic: documents whose second half repeats the first, so the loss falls as attention
learns to copy. After training, every rank evaluates the trained model on a held-out packed
sequence; its loss, printed in full, matches the one-process run.

How the pieces fit:

- ``ringflex.integrations.hf.register()`` and ``attn_implementation="ringflex"``: every
  attention layer calls ``ring_flex_attention`` on the wrapper's group (the ``cp`` dimension of
  a ``(dp, cp)`` device mesh) and layout.
- The collator builds each rank's shard of the packed sequence, in the sharding
  ``ringflex.PackedSequences`` chooses for its documents (``shard_by_mask``: contiguous runs
  that keep documents together, where zigzag would split every document over every rank):
  ``input_ids``, the position ids of the documents (global positions in the sequence,
  restarting per document), ``shift_labels`` (the next token of the FULL sequence, shifted
  before sharding: a token's successor may live on another rank), and the row's
  ``PackedSequences``, whose document ``mask_mod`` and ``layout`` the trainer sets on the
  wrapper before the forward.
- Trainer computes the loss as transformers does (``shift_labels``, summed and divided by the
  number of labelled tokens of all ranks, ``average_tokens_across_devices``), and its DDP
  averages the gradients over all ranks, which the loss's scaling by the world size turns into
  the sum the ring needs (``ringflex.training`` explains the convention).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import ringflex
import ringflex.integrations.hf as ringflex_hf
from ringflex.training import destroy_process_group, next_token_labels, shard_batch, sharded_cross_entropy


# ----------------------------------------------------------------------------- data

class PackedDocuments(Dataset):
    """Row ``i``: documents of random length packed end to end into ``seq_len`` tokens (the last
    one cut), as a packing step of a data pipeline writes them; a document's second half repeats
    its first."""

    def __init__(self, rows: int, args, seed: int):
        self.rows, self.args, self.seed = rows, args, seed

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        lengths, tokens, left = [], [], self.args.seq_len
        while left:
            n = min(int(torch.randint(self.args.min_doc, self.args.max_doc + 1, (), generator=g)), left)
            first = torch.randint(0, self.args.vocab, ((n + 1) // 2,), generator=g)
            tokens.append(torch.cat([first, first])[:n])
            lengths.append(n)
            left -= n
        return {"tokens": torch.cat(tokens), "lengths": lengths}


class ShardPackedRow:
    """The collator: this rank's shard of one packed row (a batch of one sequence per ring, the
    usual batch of long-context training) in ``layout`` (None: the sharding chosen for the row's
    documents), and the row's ``PackedSequences``, whose document ids live on the model's device
    (the ring evaluates the mask where the attention runs)."""

    def __init__(self, group, layout, device):
        self.group, self.layout, self.device = group, layout, device

    def __call__(self, items):
        if len(items) != 1:
            raise ValueError("one packed sequence per batch: set per_device_train_batch_size=1")
        tokens, lengths = items[0]["tokens"].unsqueeze(0), items[0]["lengths"]
        packed = ringflex.PackedSequences(lengths, group=self.group, layout=self.layout)
        if packed.padded_len != tokens.shape[1]:
            raise ValueError(f"--seq-len {tokens.shape[1]} does not split over the ring: use a multiple of "
                             f"{packed.padded_len - packed.total + tokens.shape[1]}")
        full = {"input_ids": tokens, "position_ids": packed.position_ids().unsqueeze(0),
                "shift_labels": next_token_labels(tokens, doc_ids=packed.doc_ids)}
        local = shard_batch(full, dim=1, group=self.group, layout=packed.layout)
        # ``labels`` makes the model compute its loss; with ``shift_labels`` it does not shift them again
        on_device = ringflex.PackedSequences(lengths, group=self.group, layout=packed.layout, device=self.device)
        return {**local, "labels": local["shift_labels"], "packed": on_device}


# ----------------------------------------------------------------------------- the Trainer

def use_packed(ring, packed) -> None:
    """Sets a row's document mask and sharding on the wrapper (None: one process, no ring)."""
    if ring is not None:
        ring.mask_mod, ring.layout = packed.mask_mod(), packed.layout


class ContextParallelTrainer(Trainer):
    """transformers' Trainer, but the ranks of a ring read the same batches: a sampler over the
    data-parallel replicas only (accelerate's loader would give every rank batches of its own),
    and each batch's document mask and sharding set on the ringflex wrapper before the forward."""

    def __init__(self, *args, ring: ringflex.RingFlexAttention, dp_rank: int, dp_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.ring, self.dp_rank, self.dp_size = ring, dp_rank, dp_size

    def get_train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=True,
                                     seed=self.args.seed)
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, sampler=sampler,
                          collate_fn=self.data_collator)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        use_packed(self.ring, inputs.pop("packed"))
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class PrintLosses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step}/{state.max_steps}  loss={logs['loss']:.4f}", flush=True)


# ----------------------------------------------------------------------------- set-up and evaluation

def setup(args):
    """(mesh or None, dp rank, dp size, device): under torchrun a (dp, cp) mesh whose ``cp``
    dimension is the ring; one process, no mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if world_size == 1:
        return None, 0, 1, device
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    cp = args.cp or world_size
    if world_size % cp:
        sys.exit(f"--cp {cp} must divide the world size {world_size}")
    mesh = torch.distributed.device_mesh.init_device_mesh(args.device, (world_size // cp, cp),
                                                          mesh_dim_names=("dp", "cp"))
    return mesh, mesh.get_local_rank("dp"), world_size // cp, device


def build_model(args, ring: bool):
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len,
                         use_cache=False)  # training: no cache (a ring's would hold one rank's keys only)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    if ring:
        ringflex_hf.register()
    # transformers 5 sets it on the model; 4.x reads the config's at every call
    name = "ringflex" if ring else "sdpa"
    model.set_attn_implementation(name) if hasattr(model, "set_attn_implementation") else \
        setattr(model.config, "_attn_implementation", name)
    return model


@torch.no_grad()
def evaluate(model, ring, group, layout, args, device) -> float:
    """The loss of the model on a held-out packed sequence: one forward over the ring (or the
    plain model), exact in the model's dtype (``sharded_cross_entropy``)."""
    item = PackedDocuments(1, args, seed=args.seed + 1)[0]
    batch = ShardPackedRow(group, layout, device)([item])
    use_packed(ring, batch.pop("packed"))
    logits = (ring if ring is not None else model)(input_ids=batch["input_ids"].to(device),
                                                   position_ids=batch["position_ids"].to(device)).logits
    return sharded_cross_entropy(logits, batch["shift_labels"].to(device), group=group).item()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda: a GPU per rank, NCCL)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"],
                   help="the model's dtype (bfloat16: weights and optimizer state too; for a long run prefer "
                        "float32 weights with --bf16 autocast, Trainer's mixed precision)")
    p.add_argument("--bf16", action="store_true", help="Trainer's bf16 mixed precision (GPU)")
    p.add_argument("--cp", type=int, default=None, help="ranks per ring (default: all ranks, one ring)")
    p.add_argument("--layout", default=None, choices=ringflex.LAYOUTS,
                   help="how a sequence is split over a ring (default: the sharding ringflex.PackedSequences "
                        "chooses for each row's documents)")
    p.add_argument("--backend", default="auto", choices=["auto", "cudnn", "flex", "reference"],
                   help="the kernel of each hop: auto takes cudnn where it can run the call, else flex on a GPU, "
                        "else reference")
    p.add_argument("--steps", type=int, default=30,
                   help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=1,
                   help="Trainer's gradient_accumulation_steps (one process with --accumulate N reads the rows N "
                        "replicas read in a step)")
    p.add_argument("--rows", type=int, default=64, help="packed rows in the training set")
    p.add_argument("--seq-len", type=int, default=128,
                   help="tokens per sequence (the whole sequence: each rank of a ring holds seq-len / cp)")
    p.add_argument("--min-doc", type=int, default=8,
                   help="shortest document")
    p.add_argument("--max-doc", type=int, default=48,
                   help="longest document (the last of a row is cut to fit)")
    p.add_argument("--vocab", type=int, default=32,
                   help="vocabulary size")
    p.add_argument("--hidden", type=int, default=64,
                   help="model width")
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers")
    p.add_argument("--heads", type=int, default=4,
                   help="query heads")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads (grouped-query attention)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and the data (every rank alike)")
    p.add_argument("--output-dir", default=None, help="Trainer's output directory (None: a temporary one)")
    args = p.parse_args(argv)
    if not 1 <= args.min_doc <= args.max_doc:
        p.error("need 1 <= --min-doc <= --max-doc")
    return args


def main(argv=None):
    args = parse_args(argv)
    mesh, dp_rank, dp_size, device = setup(args)
    group = mesh["cp"] if mesh is not None else None
    model = build_model(args, ring=mesh is not None)
    # One process: transformers' own attention (its packed-sequence mask read from the position ids).
    ring = ringflex.RingFlexAttention(model, group=group, layout=args.layout, backend=args.backend) \
        if mesh is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp, max_steps=args.steps, per_device_train_batch_size=1,
            learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            gradient_accumulation_steps=args.accumulate, ddp_find_unused_parameters=False,
            logging_steps=1, save_strategy="no", report_to="none", seed=args.seed, data_seed=args.seed,
            remove_unused_columns=False,  # the wrapper's forward takes **kwargs: keep every column
            use_cpu=args.device == "cpu", bf16=args.bf16, dataloader_pin_memory=False, disable_tqdm=True,
            average_tokens_across_devices=True)
        trainer = ContextParallelTrainer(
            model=ring if ring is not None else model, args=training_args,
            train_dataset=PackedDocuments(args.rows, args, seed=args.seed),
            data_collator=ShardPackedRow(group, args.layout, device), callbacks=[PrintLosses()],
            ring=ring, dp_rank=dp_rank, dp_size=dp_size)
        trainer.remove_callback(transformers.PrinterCallback)  # PrintLosses prints them, one line a step
        trainer.train()
    loss = evaluate(model, ring, group, args.layout, args, device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"done: {args.steps} steps, {world} process{'es' if world > 1 else ''} "
              f"({dp_size} x a ring of {world // dp_size}), transformers {transformers.__version__}, "
              f"held-out loss {loss:.12e}", flush=True)
    if dist.is_initialized():
        destroy_process_group()
    return loss


if __name__ == "__main__":
    main()
