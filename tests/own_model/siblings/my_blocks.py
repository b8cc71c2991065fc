"""The model's blocks, in a file of their own next to the model file."""
import torch
import torch.nn as nn

from layers.mix import Mix  # a package of the same folder: it travels too


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = Mix(width)

    def forward(self, x):
        return x + torch.tanh(self.mix(self.norm(x)))
