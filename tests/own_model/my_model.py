"""A model of my own: two blocks and a head, trained on synthetic regression data."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import Workload


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class MyModel(nn.Module):
    def __init__(self, features=16, width=32, depth=4, outputs=4):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(step, batch_size):
    """Deterministic in step: every rank builds the same global batch and takes its slice."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 16, generator=g)
    return (x,), x[:, :4].sin()


def loss(output, target):
    return F.mse_loss(output, target)


def build():
    torch.manual_seed(0)
    return Workload(model=MyModel(), example_args=make_batch(0, 4)[0], loss_fn=loss, make_batch=make_batch,
                    name="my-model")
