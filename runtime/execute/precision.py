"""Precision policies: what dtype the forward and backward compute in, what the optimizer keeps,
and fp16's dynamic loss scale. Shared by the runtime and the one-process oracle
(runtime/execute/reference.py), so the two differ only in where things run.

Note [mixed precision]: ``bf16-mixed`` and ``fp16-mixed`` run every stage's forward (and so its
backward) under ``torch.autocast`` with fp32 parameters; the parameters are the master weights,
gradients and AdamW state are fp32. Chosen over bf16 parameters with a separate fp32 master copy
because:
- the oracle is the same module under the same autocast, so ``verify`` compares like for like,
  and a checkpoint, a reshard and ``final/`` stay fp32 by original name (no second copy to keep
  in step, no rounding at save);
- the static memory is the same 16 bytes per parameter either way (4 fp32 weights + 4 fp32
  gradients + 8 AdamW, against 2 bf16 weights + 2 bf16 gradients + 4 master + 8 AdamW); autocast
  adds a transient bf16 copy of each weight it casts (its cast cache, 2 bytes per parameter) and
  halves the activations that matmuls save, which is where mixed precision saves memory on
  activation-bound models. What bf16 parameters would save more of is ZeRO-sharded state (12 of
  16 bytes shardable instead of 8): a later step, not this one.
The weight copies are cached for the whole step (``step_context``), not per microbatch.
Tensors crossing a stage boundary keep the dtype autocast made them in, which the plan declares
for them (Note [boundaries in the autocast dtype] in partitioner/codegen/boundary_dtypes.py), so a
cut never changes what is computed; PipelineStage's receive buffers are allocated from the plan,
and ``cast_outputs`` only guards a run on another device type than the one compiled for.

Note [loss scaling]: fp16 has 5 exponent bits, so small gradients underflow; ``fp16-mixed``
multiplies every microbatch's loss by a scale (2**16 at the start) before backward, and unscales
the gradients before clipping and the optimizer step. A step whose gradients hold an inf or NaN
anywhere (any stage, any replica: the check is the global gradient norm, one all-reduce over the
world, so every rank decides alike) is skipped: no optimizer step, the scale halves. After
``growth_interval`` clean steps in a row the scale doubles. The learning-rate schedule advances on
a skipped step too (as with torch's GradScaler), and the step is recorded in metrics.jsonl
(``skipped``, ``loss_scale``). The scale is part of a checkpoint (meta ``loss_scale``), so a
resumed run skips the steps the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from runtime.program.parts import Precision


def autocast(precision: Precision, device_type: str):
    """The forward's context under ``precision``: torch.autocast for the mixed policies."""
    if not precision.is_mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=precision.autocast_dtype)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, str(name).removeprefix("torch."))


def step_context(precision: Precision, device_type: str):
    """Around a whole step's schedule under a mixed policy: an autocast region that is *off*
    (backward runs outside autocast, as torch recommends) but keeps autocast's nesting above
    zero, so the low-precision copy autocast makes of each weight is cached for the whole step
    instead of remade (and saved again for backward) by every microbatch's forward: one copy per
    weight, 2 bytes per parameter, for the step (the cost model's ``weight_copy_bytes``)."""
    if not precision.is_mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def cast_outputs(output, dtypes: list[torch.dtype]):
    """A stage's floating outputs cast to the plan's boundary dtypes (Note [mixed precision]): a
    no-op on the device type compiled for; another device type's autocast may pick another dtype,
    and the next stage's receive buffer holds the plan's."""
    single = not isinstance(output, tuple)
    outs = (output,) if single else output
    cast = tuple(o.to(d) if torch.is_tensor(o) and o.is_floating_point() and o.dtype != d else o
                 for o, d in zip(outs, dtypes))
    cast = cast + tuple(outs[len(cast):])
    return cast[0] if single else cast


def wrap_forward(module: torch.nn.Module, precision: Precision, device_type: str, outputs) -> None:
    """Run ``module``'s forward under the policy's autocast and cast its outputs to the plan's
    dtypes (``outputs``: the stage's TensorSpecs, or dtypes). Nothing changes under fp32. Forward
    hooks, not a replaced ``forward``: they get the module as an argument, so a deep copy of the
    module (the oracle trains copies) keeps working on its own parameters."""
    if not precision.is_mixed:
        return
    dtypes = [o if isinstance(o, torch.dtype) else _dtype(o.dtype) for o in outputs]
    open_contexts: list = []

    def enter(module, args):
        ctx = autocast(precision, device_type)
        ctx.__enter__()
        open_contexts.append(ctx)

    def leave(module, args, output):
        if open_contexts:
            open_contexts.pop().__exit__(None, None, None)
        return cast_outputs(output, dtypes)

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)


@dataclass
class LossScaler:
    """Dynamic loss scale of fp16-mixed (Note [loss scaling]); inert (scale 1) otherwise."""

    enabled: bool
    scale: float = 2.0 ** 16
    growth_interval: int = 2000
    clean_steps: int = 0

    @staticmethod
    def for_policy(precision: Precision) -> "LossScaler":
        on = precision.loss_scaling
        return LossScaler(on, 2.0 ** 16 if on else 1.0)

    def update(self, finite: bool) -> bool:
        """After a step's gradients are known: returns whether to take the optimizer step."""
        if not self.enabled:
            return True
        if not finite:
            self.scale /= 2.0
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self.clean_steps = 0
        return True

    def state(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load(self, state: dict | None) -> None:
        if self.enabled and state:
            self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if max_norm is None or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, float(max_norm) / (total_norm + 1e-6))
