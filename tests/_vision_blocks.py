"""The random layers of modern vision models in one small token model: timm's ``DropPath``
(``x.new_empty(shape).bernoulli_(keep)``, ``div_``) and torchvision's ``stochastic_depth``
(``torch.empty(size).bernoulli_(survival)``), both as tests/_zoo.py copies them, and a
mobilenet_v3-style head with ``nn.Dropout(inplace=True)`` (Note [in-place random ops] in
runtime/execute/randomness.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from _zoo import DropPath, stochastic_depth
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data

VOCAB, SEQ, WIDTH = 32, 6, 16


class Block(nn.Module):
    """A pre-norm MLP block with a drop-path residual (ViT/ConvNeXt's shape)."""

    def __init__(self, width: int, drop: float, torchvision_style: bool):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.drop, self.torchvision_style = drop, torchvision_style
        self.drop_path = DropPath(drop)

    def forward(self, x):
        y = self.mlp(self.norm(x))
        y = stochastic_depth(y, self.drop, "row", self.training) if self.torchvision_style else self.drop_path(y)
        return x + y


class TinyVisionNet(nn.Module):
    def __init__(self, drop: float = 0.1, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(Block(WIDTH, drop, torchvision_style=i % 2 == 1) for i in range(layers)))
        self.head = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Hardswish(), nn.Dropout(drop, inplace=True),
                                  nn.Linear(WIDTH, VOCAB))

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def vision_workload(drop: float = 0.1, layers: int = 2) -> Workload:
    torch.manual_seed(0)
    batch = {"vocab": VOCAB, "seq": SEQ, "seed": 0}
    return Workload(
        model=TinyVisionNet(drop, layers), example_args=data.token_batch(0, 2, **batch)[0],
        loss_fn=data.causal_lm_loss, make_batch=lambda step, size: data.token_batch(step, size, **batch),
        name="tiny-vision",
        source={"make_batch": ("runtime.data.synthetic:token_batch", batch),
                "loss_fn": ("runtime.data.synthetic:causal_lm_loss", {})})
