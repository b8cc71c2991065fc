"""A model whose file defines a torch.library custom op with its own backward: straight-through
rounding (the forward rounds, the backward passes the gradient on unchanged; autograd's gradient
of round would be zero). The file and its sibling are named like siblings/my_model.py and
siblings/my_blocks.py on purpose: two programs whose user files share names train one after the
other in the same workers (tests), each importing its own."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from my_blocks import WIDTH

from partitioner import Workload


@torch.library.custom_op("own_model::round_ste", mutates_args=())
def round_ste(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


@round_ste.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad


round_ste.register_autograd(_backward)


class Quantised(nn.Module):
    def __init__(self, features=8, width=WIDTH, outputs=4):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        x = round_ste(x * 4) / 4
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
                    name="custom-op")
