"""A model split over files the natural way: the model file imports its blocks from a sibling
module, which imports a mixing layer from a package of the same folder. Nothing is installed."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from my_blocks import Block  # a sibling file: it travels with the program (Note [user code travels])

from partitioner import Workload

FEATURES = 12


class MyModel(nn.Module):
    def __init__(self, width=24, depth=4, outputs=3):
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, FEATURES, generator=g)
    return (x,), x[:, :3].cos()


def loss(output, target):
    return F.mse_loss(output, target)


def build():
    torch.manual_seed(0)
    return Workload(model=MyModel(), example_args=make_batch(0, 4)[0], loss_fn=loss, make_batch=make_batch,
                    name="siblings")
