"""A Hugging Face causal LM whose batches are dicts of keyword inputs, input_ids + attention_mask +
labels, and which computes its own loss from the labels (the model's first output)."""
import torch
import transformers

from partitioner import Workload

VOCAB, SEQ = 64, 16


def make_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    mask = torch.ones(batch_size, SEQ, dtype=torch.long)
    mask[:, -3:] = 0  # padding at the end of every row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, labels


def loss(output, target):
    return output[0]  # the model's own loss, computed from the labels it was given


def build():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    return Workload(model=transformers.GPT2LMHeadModel(config), example_args=(),
                    example_kwargs=make_batch(0, 2)[0], loss_fn=loss, make_batch=make_batch, name="hf-labels")
