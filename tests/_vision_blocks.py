"""The random layers of modern vision models, written as timm and torchvision write them (neither
can be installed here): timm's ``DropPath`` (``x.new_empty(shape).bernoulli_(keep)``, ``div_``),
torchvision's ``stochastic_depth`` (``torch.empty(size).bernoulli_(survival)``) and a
mobilenet_v3-style head with ``nn.Dropout(inplace=True)``; a small ViT/ConvNeXt-like token model
built of them (Note [in-place random ops] in runtime/execute/randomness.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data

VOCAB, SEQ, WIDTH = 32, 6, 16


def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """timm.layers.drop.drop_path, as timm writes it."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


def stochastic_depth(x, p: float, mode: str, training: bool = True):
    """torchvision.ops.stochastic_depth, as torchvision writes it."""
    if not training or p == 0.0:
        return x
    survival_rate = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return x * noise


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
