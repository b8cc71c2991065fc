"""Precision policies: what dtype the forward and backward compute in, what the optimizer keeps,
and fp16's dynamic loss scale. Shared by the runtime and the one-process oracle
(runtime/execute/reference.py), so the two differ only in where things run.

Note [mixed precision]: ``bf16-mixed`` and ``fp16-mixed`` run every stage's forward (and so its
backward) under ``torch.autocast`` with fp32 parameters as the master weights (gradients and AdamW
state fp32), rather than bf16 parameters with a separate fp32 master copy, because the oracle is
then the same module under the same autocast (``verify`` compares like for like) and checkpoints,
reshards and ``final/`` stay fp32 by original name (no second copy to keep in step), at the same
16 bytes of static memory per parameter; autocast's savings are in the activations matmuls save.
(bf16 parameters would shard more under ZeRO: a later step.) The weight casts are cached for the
whole step (``step_context``), not per microbatch. A boundary tensor keeps autocast's dtype,
declared by the plan (Note [boundaries in the autocast dtype] in
partitioner/codegen/boundary_dtypes.py), so a cut never changes what is computed.

Note [loss scaling]: fp16 has 5 exponent bits, so small gradients underflow; ``fp16-mixed``
multiplies every microbatch's loss by a scale (2**16 at the start) before backward, and unscales
the gradients before clipping and the optimizer step. A step whose gradients hold an inf or NaN
anywhere (any stage, any replica: the check is the global gradient norm, one all-reduce over the
world, so every rank decides alike) is skipped: no optimizer step, the scale halves. After
``growth_interval`` clean steps in a row the scale doubles. The learning-rate schedule advances on
a skipped step too (as with torch's GradScaler), and the step is recorded in metrics.jsonl
(``skipped``, ``loss_scale``). The scale is part of a checkpoint (meta ``loss_scale``), so a
resumed run skips the steps the uninterrupted one would.

Note [deterministic kernels on a GPU]: a compute canary, a resume and a lossless checkpoint each
compare bits of two computations. CPU kernels give the same bits every run; CUDA's do not by
default (atomics, split-K reductions, benchmark-picked algorithms), and a false canary alarm
excludes a healthy host. So every CUDA program runs ``device_numerics``: deterministic algorithms
with ``warn_only`` (an op without a deterministic kernel warns, naming itself, rather than stopping
a run that has no canary on; the promises hold for programs without such ops),
``CUBLAS_WORKSPACE_CONFIG`` set before any CUDA work, cuDNN deterministic and not benchmarking.
Always on, not an option: the checkpoint promise holds for every run; the GPU time it costs is
not priced. TF32 is off under every policy: the cost model prices fp32 at the fp32 rate (Note
[flops per dtype] in partitioner/config/device_presets.py) and verify holds fp32 to 1e-5. The
oracle calls ``device_numerics`` too, so both sides run the same kernels. On CPU nothing is set.
"""

from __future__ import annotations

import contextlib
import math
import os
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


# cuBLAS's two deterministic workspace settings (torch refuses a cuBLAS call under deterministic
# algorithms with any other); the larger is the one torch's docs name first.
CUBLAS_WORKSPACE = ":4096:8"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


@dataclass(frozen=True)
class DeviceNumerics:
    """What ``device_numerics`` sets (Note [deterministic kernels on a GPU]); None: left alone."""

    deterministic_algorithms: bool | None = None
    cublas_workspace_config: str | None = None
    cudnn_deterministic: bool | None = None
    cudnn_benchmark: bool | None = None
    matmul_allow_tf32: bool | None = None
    cudnn_allow_tf32: bool | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def numerics_for(device_type: str, precision: Precision | str, environ=None) -> DeviceNumerics:
    """The settings a program on ``device_type`` under ``precision`` runs with (Note [deterministic
    kernels on a GPU]); ``environ``: where CUBLAS_WORKSPACE_CONFIG is read (os.environ). Sets nothing."""
    Precision.of(precision)  # a bad policy is named here, before anything is set
    if device_type != "cuda":
        return DeviceNumerics()
    current = (os.environ if environ is None else environ).get("CUBLAS_WORKSPACE_CONFIG")
    return DeviceNumerics(deterministic_algorithms=True,
                          cublas_workspace_config=current if current in _CUBLAS_DETERMINISTIC else CUBLAS_WORKSPACE,
                          cudnn_deterministic=True, cudnn_benchmark=False,
                          matmul_allow_tf32=False, cudnn_allow_tf32=False)


def device_numerics(device, precision: Precision | str) -> DeviceNumerics:
    """Set the process's kernel choices for a program on ``device`` (a torch.device or its type)
    under ``precision`` (Note [deterministic kernels on a GPU]): the rank calls it at start-up
    before any CUDA work, ``verify``'s oracle before its own. Returns what it set."""
    device_type = device if isinstance(device, str) else device.type
    settings = numerics_for(str(device_type).split(":")[0], precision)
    if settings.cublas_workspace_config is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = settings.cublas_workspace_config
    if settings.deterministic_algorithms is not None:
        torch.use_deterministic_algorithms(settings.deterministic_algorithms, warn_only=True)
    if settings.cudnn_deterministic is not None:
        torch.backends.cudnn.deterministic = settings.cudnn_deterministic
    if settings.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = settings.cudnn_benchmark
    if settings.matmul_allow_tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = settings.matmul_allow_tf32
    if settings.cudnn_allow_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = settings.cudnn_allow_tf32
    return settings
