"""What a user hands the compiler: a model, one microbatch of example inputs, a loss and data."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from runtime.data.synthetic import constant_inputs, holds_tensor, same_constant


@dataclass(frozen=True)
class Workload:
    """A model and how to train it (docs/design.md §11).

    ``example_args`` is one microbatch; its leading dimension is the microbatch size the cost passes
    see, and costs are scaled per sample from it. ``loss_fn(output, target)`` returns a scalar, or is
    None when the model returns the loss itself. ``make_batch(step, batch_size)`` returns
    ``(args, target)`` and must be deterministic in ``step``: every rank calls it and takes its own
    slice, which is what makes a partitioned run equal to the one-process run. ``args`` may be a
    tuple of the forward's positional inputs or a dict of its keyword inputs (``input_ids``,
    ``attention_mask``, ...; then give the example as ``example_kwargs`` with ``example_args=()``,
    Note [keyword inputs] in runtime/data/synthetic.py).

    ``source`` is optional: generated programs find module-level ``make_batch`` and ``loss_fn``
    from the functions themselves (Note [user code travels] in partitioner/frontend/user_source.py).
    """

    model: torch.nn.Module
    example_args: tuple
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    make_batch: Callable[[int, int], tuple[tuple, Any]] | None = None
    example_kwargs: dict = field(default_factory=dict)
    name: str = "model"
    # Where generated programs find make_batch and loss_fn ("module:function" or (spec, kwargs)),
    # where given; else derived from the functions (partitioner/frontend/user_source.py). "init": a
    # function(names) -> {name: tensor} every rank makes its weights with (runtime/execute/pretrained.py).
    source: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.model, torch.nn.Module):
            raise ValueError(f"Workload.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.example_args, tuple):
            raise ValueError(
                f"Workload.example_args must be a tuple of the forward's positional inputs, got "
                f"{type(self.example_args).__name__}: wrap a single tensor as (tensor,), and give "
                f"keyword inputs as example_kwargs={{'input_ids': ...}}"
            )
        if not isinstance(self.example_kwargs, dict):
            raise ValueError(f"Workload.example_kwargs must be a dict of keyword inputs, got "
                             f"{type(self.example_kwargs).__name__}")
        if self.example_args and self.example_kwargs:
            raise ValueError("Workload has both example_args and example_kwargs: give the forward's "
                             "inputs one way, a tuple (positional) or a dict (keyword inputs), as make_batch returns them")
        for key, value in self.constants:  # Note [constant inputs] in runtime/data/synthetic.py: refused before the trace
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                what = f"the keyword input {key!r}" if isinstance(key, str) else f"positional input {key}"
                raise ValueError(
                    f"workload {self.name!r}: {what} is {type(value).__name__} {value!r}, not a tensor: the trace "
                    "bakes such a value into the graph, and the program must check that make_batch keeps giving it, "
                    "which it can only for plain values (str, int, float, bool, None, lists and dicts of them): make "
                    f"it an attribute of the model that forward reads, or bind it with functools.partial, and drop it "
                    "from the inputs") from None

    @property
    def keywords(self) -> tuple[str, ...]:
        """The keyword inputs that are tensors, in the order the trace makes them stage 0's inputs
        (the others are constants: Note [constant inputs] in runtime/data/synthetic.py)."""
        return tuple(k for k, v in self.example_kwargs.items() if holds_tensor(v))

    @property
    def constants(self) -> list[list]:
        """[[position or keyword, value]] of the example inputs that hold no tensor: baked into the
        graph by the trace (Note [constant inputs] in runtime/data/synthetic.py)."""
        return constant_inputs(self.example_args, self.example_kwargs)

    def _same_constants(self, args, kwargs, microbatch_size: int) -> None:
        """make_batch's constant inputs must be the example's: the retrace at the microbatch size
        bakes make_batch's, the program checks every batch against them."""
        got = dict((k, v) for k, v in constant_inputs(args, kwargs))
        for key, value in self.constants:
            if key in got and not same_constant(got[key], value):
                name = key if isinstance(key, str) else f"input {key}"
                raise ValueError(f"workload {self.name!r}: make_batch(0, {microbatch_size}) returns {name}={got[key]!r} "
                                 f"but the example inputs have {name}={value!r}: the trace bakes a non-tensor input "
                                 "into the graph (Note [constant inputs] in runtime/data/synthetic.py); give both the same value")

    @property
    def example_batch_size(self) -> int:
        for value in list(self.example_args) + list(self.example_kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
        return 1

    def example_args_at(self, microbatch_size: int) -> tuple:
        """Example inputs of exactly one microbatch of ``microbatch_size``: a traced graph's shapes
        are static, so the program's stages are traced at the plan's microbatch size."""
        if microbatch_size == self.example_batch_size:
            return self.example_args
        if self.make_batch is None:
            raise ValueError(
                f"the plan's microbatch size is {microbatch_size} but the example inputs have batch "
                f"{self.example_batch_size} and the workload has no make_batch: give make_batch, or "
                f"fix --microbatches so that global_batch / (dp * microbatches) = {self.example_batch_size}"
            )
        if self.example_kwargs:
            return ()
        args, _target = self.make_batch(0, microbatch_size)
        if isinstance(args, dict):
            raise ValueError(f"workload {self.name!r}: make_batch returns a dict of keyword inputs "
                             f"{sorted(args)} but example_args is a tuple: give the example as "
                             "example_kwargs={...} with example_args=()")
        self._same_constants(tuple(args), {}, microbatch_size)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)

    def example_kwargs_at(self, microbatch_size: int) -> dict:
        """Keyword example inputs of one microbatch, in ``keywords`` order (see example_args_at)."""
        if not self.example_kwargs or microbatch_size == self.example_batch_size:
            return self.example_kwargs
        self.example_args_at(microbatch_size)  # the errors when there is no make_batch
        args, _target = self.make_batch(0, microbatch_size)
        if not isinstance(args, dict) or set(args) != set(self.example_kwargs):
            got = sorted(args) if isinstance(args, dict) else type(args).__name__
            raise ValueError(f"workload {self.name!r}: make_batch returns inputs {got} but example_kwargs has "
                             f"{sorted(self.example_kwargs)}: return a dict with the same keys")
        self._same_constants((), args, microbatch_size)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return {k: (args[k].to(device) if isinstance(args[k], torch.Tensor) else args[k]) for k in self.example_kwargs}
