"""A small BatchNorm CNN as a workload whose program imports make_batch and the loss from this
file by its absolute path (Workload.source): conv -> BatchNorm2d -> relu, twice, then a linear
head. ``gain`` is a buffer read at the input and again at the head, so under two stages both hold
it; the BatchNorm running statistics are buffers the forward updates in place."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.abspath(__file__)
CHANNELS, SIZE, CLASSES = 3, 8, 4


class BNNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.register_buffer("gain", torch.tensor(0.5))
        self.conv1 = nn.Conv2d(CHANNELS, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width * SIZE * SIZE, CLASSES)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x * self.gain)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.flatten(1)) * self.gain


def make_batch(step: int, batch_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(batch_size, CHANNELS, SIZE, SIZE, generator=gen) * 2.0 + 1.0
    y = torch.randint(0, CLASSES, (batch_size,), generator=gen)
    return (x,), y


def loss_fn(logits, target, noise: float = 0.0):
    """Cross entropy; ``noise`` > 0 scales it by draws from numpy's and Python's global generators,
    so a resume is bit-exact only if their states are restored."""
    loss = F.cross_entropy(logits, target)
    if noise:
        loss = loss * (1.0 + noise * (float(np.random.random()) + random.random()))
    return loss


def workload(*, noise: float = 0.0, name: str = "bn-cnn"):
    from functools import partial

    from partitioner.frontend.workload import Workload

    torch.manual_seed(0)
    return Workload(
        model=BNNet(), example_args=(torch.zeros(2, CHANNELS, SIZE, SIZE),),
        loss_fn=partial(loss_fn, noise=noise), make_batch=make_batch, name=name,
        source={"make_batch": (f"{HERE}:make_batch", {}), "loss_fn": (f"{HERE}:loss_fn", {"noise": noise})})
