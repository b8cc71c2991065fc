"""Initial parameters of a model compiled on the meta device, made by the rank that holds them.

Note [materialize per rank]: a model given on the meta device has no weights to write, and no
process ever holds all of it. The compiler records for every parameter a recipe (its shape, dtype
and initializer); each rank draws only its own stages' parameters, each from a generator seeded by
(seed, crc32(name)), so the values depend on neither the partition nor the rank layout: a
checkpoint, a resharded resume and another plan all see the same initial model.
"""

from __future__ import annotations

import math
import zlib

import torch

from runtime.program.parts import InitRecipe
from runtime.program.user_code import tensor_dtype

INITIALIZERS = ("normal", "uniform", "zeros", "ones")


def parameter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def materialize(name: str, recipe: InitRecipe, seed: int) -> torch.Tensor:
    """One tensor from its recipe (shape, dtype, init: normal|uniform|zeros|ones, std|bound)."""
    shape, dtype, init = recipe.shape, tensor_dtype(recipe.dtype), recipe.init
    if init == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if init == "ones":
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(parameter_seed(seed, name))
    value = torch.empty(shape, dtype=torch.float32)
    if init == "normal":
        value.normal_(0.0, float(recipe.std), generator=gen)
    elif init == "uniform":
        bound = float(recipe.bound)
        value.uniform_(-bound, bound, generator=gen)
    else:
        raise ValueError(f"parameter {name}: initializer {init!r} is not one of {INITIALIZERS}")
    return value.to(dtype)


def materialize_all(names: list[str], recipes: dict[str, InitRecipe], seed: int) -> dict[str, torch.Tensor]:
    missing = [n for n in names if n not in recipes]
    if missing:
        raise ValueError(f"no weights file and no init recipe for {missing[:3]}: recompile the program")
    return {n: materialize(n, recipes[n], seed) for n in names}


def fan_in_bound(fan_in: int) -> float:
    """nn.Linear's default: kaiming_uniform(a=sqrt(5)) = U(±1/sqrt(fan_in)), its bias likewise."""
    return 1.0 / math.sqrt(max(1, fan_in))
