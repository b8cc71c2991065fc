"""A stranger's model: straight-through rounding, a custom torch.autograd.Function (the forward
rounds to a grid of 1/scale, the backward passes the gradient on unchanged), as quantisation-aware
training writes it. Autograd's own gradient of round is zero: a program that traced through the
forward would leave `inp` untrained (Note [autograd Functions run as themselves] in
partitioner/frontend/autograd_functions.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import Workload


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        return (x * scale).round() / scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Quantised(nn.Module):
    def __init__(self, features=8, width=16, outputs=4):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = RoundSTE.apply(torch.tanh(self.inp(x)), 4.0)
        return self.head(torch.tanh(self.mid(x)))


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
