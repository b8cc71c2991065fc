"""What a user hands the compiler: a model, one microbatch of example inputs, a loss and data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Workload:
    """A model and how to train it (DESIGN section 11).

    ``example_args`` is one microbatch; its leading dimension is the microbatch size the cost passes
    see, and costs are scaled per sample from it. ``loss_fn(output, target)`` returns a scalar, or is
    None when the model returns the loss itself. ``make_batch(step, batch_size)`` returns
    ``(args, target)`` and must be deterministic in ``step``: every rank calls it and takes its own
    slice, which is what makes a partitioned run equal to the one-process run.
    """

    model: torch.nn.Module
    example_args: tuple
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    make_batch: Callable[[int, int], tuple[tuple, Any]] | None = None
    example_kwargs: dict = field(default_factory=dict)
    name: str = "model"
    # Where generated programs find make_batch, loss_fn and the model builder ("module:function");
    # built-ins point into `runtime` so generated programs import only torch and runtime.
    source: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.model, torch.nn.Module):
            raise ValueError(f"Workload.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.example_args, tuple):
            raise ValueError(
                f"Workload.example_args must be a tuple of the forward's positional inputs, got "
                f"{type(self.example_args).__name__}: wrap a single tensor as (tensor,)"
            )

    @property
    def example_batch_size(self) -> int:
        for value in list(self.example_args) + list(self.example_kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
        return 1
