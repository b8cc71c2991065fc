"""An ALBERT-style model: one block applied four times (shared weights), written the natural way."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import Workload


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Reused(nn.Module):
    def __init__(self, features=16, width=64, repeats=4, outputs=4):
        super().__init__()
        self.repeats = repeats
        self.inp = nn.Linear(features, width)
        self.block = Block(width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.inp(x)
        for _ in range(self.repeats):
            x = self.block(x)
        return self.head(x)


def make_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 16, generator=g)
    return (x,), x[:, :4].sin()


def loss(output, target):
    return F.mse_loss(output, target)


def build():
    torch.manual_seed(0)
    return Workload(model=Reused(), example_args=make_batch(0, 4)[0], loss_fn=loss, make_batch=make_batch,
                    name="reused-block")
