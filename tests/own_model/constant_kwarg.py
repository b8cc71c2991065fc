"""A model with a non-tensor keyword input, as a stranger writes it: `pool` picks how the sequence
is pooled, and make_batch returns it in the batch dict next to the tensor. The trace bakes the
value into the graph (Note [constant inputs] in runtime/data/synthetic.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import Workload


class Pooled(nn.Module):
    def __init__(self, features=8, width=16, outputs=4):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, outputs)

    def forward(self, x, pool="mean"):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        h = h[:, 0] if pool == "first" else h.mean(dim=1)
        return self.head(h)


def make_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, 5, 8, generator=g)
    return {"x": x, "pool": "first"}, x[:, 0, :4].sin()


def switching_batch(step, batch_size):
    """`pool` as if it were a run-time switch: "first" at step 0, "mean" after."""
    inputs, target = make_batch(step, batch_size)
    return {**inputs, "pool": "first" if step == 0 else "mean"}, target


def loss(output, target):
    return F.mse_loss(output, target)


def build(batches=make_batch):
    torch.manual_seed(0)
    return Workload(model=Pooled(), example_args=(), example_kwargs=batches(0, 4)[0], loss_fn=loss,
                    make_batch=batches, name="constant-kwarg")


def build_switching():
    return build(switching_batch)
