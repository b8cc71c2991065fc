"""A token model whose batches are dicts of keyword inputs (input_ids + attention_mask)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import Workload

VOCAB, SEQ = 64, 8


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x, mask):
        return x + torch.tanh(self.fc(self.norm(x))) * mask


class TokenModel(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(torch.float32)
        x = self.emb(input_ids) * mask
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def make_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch_size, 1), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths).to(torch.long)
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:]


def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build():
    torch.manual_seed(0)
    return Workload(model=TokenModel(), example_args=(), example_kwargs=make_batch(0, 2)[0], loss_fn=loss,
                    make_batch=make_batch, name="dict-model")
