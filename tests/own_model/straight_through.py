"""A stranger's model: straight-through rounding, a custom torch.autograd.Function (the forward
rounds, the backward passes the gradient on unchanged), as quantisation-aware training writes it."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import Workload


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantised(nn.Module):
    def __init__(self, features=8, width=16, outputs=4):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        return self.head(RoundSTE.apply(self.inp(x) * 4) / 4)


def make_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 8, generator=g)
    return (x,), x[:, :4].sin()


def loss(output, target):
    return F.mse_loss(output, target)


def build():
    torch.manual_seed(0)
    return Workload(model=Quantised(), example_args=make_batch(0, 4)[0], loss_fn=loss, make_batch=make_batch,
                    name="straight-through")
