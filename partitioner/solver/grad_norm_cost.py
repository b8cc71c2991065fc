"""What the global gradient norm costs a step, when the program computes it (Note [global gradient
norm] in runtime/execute/grad_norm.py): with clipping on, or under fp16 loss scaling (its overflow test).
Otherwise the program makes no norm pass and no norm collective, and the term is 0.

Every rank takes the 2-norm of each gradient it owns (one foreach kernel: a read of its gradient
bytes, memory-bound), then one all-reduce of 8 bytes over the world:

    norm_s = max over stages of grad_bytes / norm rate + 2 (world - 1) * link latency

(the latency term is a ring all-reduce of a tiny tensor, as Note [cost model] prices the
data-parallel one). It does not depend on where the cuts are, beyond which stage holds the most
gradient bytes, so it stays out of the ILP's objective (it would change no choice); ``evaluate``
adds it to the plan's step time when the plan's training settings make the program compute the
norm (``computes_global_norm``), and plan.json keeps it as ``predicted.grad_norm_s_per_step``.
"""

from __future__ import annotations

from runtime.program.parts import Precision

# Gradient bytes per second one rank's norm pass reads: torch._foreach_norm over the 3.7 MB of fp32
# gradients of the step_time_accuracy GPT took 0.27 ms on one thread here (~14 GB/s, fastest of 200
# on a loaded 2-core machine); 10 GB/s keeps it on the safe side. An accelerator reads HBM at TB/s.
NORM_BYTES_PER_S = {"cpu": 10e9}
DEFAULT_ACCELERATOR_NORM_BYTES_PER_S = 1e12


def computes_global_norm(clip_grad_norm: float | None, precision: Precision) -> bool:
    """Whether a program that clips at ``clip_grad_norm`` (None: no clipping) under ``precision``
    computes the global norm each step (the runtime's ``needs_global_norm``: clipping, or loss scaling)."""
    return clip_grad_norm is not None or precision.loss_scaling


def global_norm_s(grad_bytes_per_stage: list[float], device_kinds: list[str], *, world_size: int,
                  latency_s: float) -> float:
    """Seconds the norm adds to a step (the slowest stage's pass, then the world's all-reduce)."""
    passes = (b / NORM_BYTES_PER_S.get(kind, DEFAULT_ACCELERATOR_NORM_BYTES_PER_S)
              for b, kind in zip(grad_bytes_per_stage, device_kinds))
    return max(passes, default=0.0) + 2 * max(0, world_size - 1) * latency_s
