"""The precision policy in the cost model (Note [mixed precision] in runtime/execute/precision.py).

Note [precision in the cost model]: the passes trace the model in its own dtype; the policy
changes three figures, and this module changes them on the problem and the cluster before the
solve, so the ILP, the chain DP, the checker and the baselines all see them alike:
- compute: each device computes at the FLOP rate of the policy's dtype (``cluster_for_precision``,
  Note [flops per dtype] in partitioner/config/device_presets.py): fp32 -> fp32, bf16-mixed -> bf16,
  fp16-mixed -> fp16;
- weights: under autocast each weight a matmul reads is also held as a low-precision copy for
  the step (runtime/execute/precision.py ``step_context``): the weights term grows by 2 bytes per 4-byte
  parameter (``precision_problem``: every parameter counted, which over-counts norms and
  embeddings that are not cast: memory is predicted conservatively);
- calibration: ``--calibrate`` measures every region with its forward under the policy's
  autocast, and the profile records the policy (meta "precision"); a profile fitted under another
  policy is refused (partitioner/compiler.py), since its seconds are of other kernels;
- tensor parallelism's collectives: a row-parallel linear's output, a column group's input
  gradient and a vocab-split head's logits are autocast's dtype, so ``tp.comm_bytes``,
  ``tp.comm_bwd_bytes`` and ``tp.gather_bytes`` (traced in the model's dtype, passes/tp_roles.py)
  are priced at 2 bytes an element (Note [tensor parallelism under autocast] in
  runtime/parallel/tensor_parallel.py), except the vocab lookup's all-reduce (``tp.lookup_bytes``, part of
  ``tp.comm_bytes``), which stays fp32: an embedding is not autocast. The per-step gathers of split
  gradients (``tp.step_gather_bytes``) move fp32 gradients and keep their traced bytes;
- what stays: gradients and AdamW state are fp32 (the parameters are the master weights), and
  pipeline communication is priced at the traced bytes, although a boundary crosses in the dtype
  autocast made it in (Note [boundaries in the autocast dtype] in partitioner/codegen/boundary_dtypes.py):
  exact for an fp32 residual stream (GPT's embedding sum keeps it fp32), twice the bytes of one
  that autocast turned bf16 (conservative). Saved activations stay at the traced dtype too, which over-counts the
  halves that autocast's matmuls save in bf16/fp16 (conservative, not modelled finer).
"""

from __future__ import annotations

import dataclasses

from partitioner.config.cluster import FLOPS_PER_S_BY_DTYPE, resolve_kind
from runtime.program.parts import Precision

def _default_dtype(kind: str) -> str:
    return "fp32" if kind == "cpu" else "bf16"


def flops_ratio(kind: str, precision: Precision | str) -> float:
    """rate[policy dtype] / rate[kind's default dtype]; 1 for a kind without a table."""
    try:
        table = FLOPS_PER_S_BY_DTYPE[resolve_kind(kind)]
    except ValueError:
        return 1.0
    return table[Precision.of(precision).dtype_name] / table[_default_dtype(resolve_kind(kind))]


def cluster_for_precision(cluster, precision: Precision | str):
    """``cluster`` with each device's flops_per_s at the policy's dtype."""
    devices = tuple(dataclasses.replace(d, flops_per_s=d.flops_per_s * flops_ratio(d.kind, precision))
                    for d in cluster.devices)
    return dataclasses.replace(cluster, devices=devices)


def precision_problem(problem, precision: Precision | str, param_elem_bytes: int):
    """``problem`` with the autocast weight copies in the weights term (Note [precision in the
    cost model]); unchanged under fp32 or for a model already in 2-byte parameters."""
    if not Precision.of(precision).is_mixed or param_elem_bytes <= 2:
        return problem
    ratio = 2 / param_elem_bytes
    ties = []
    for t in problem.ties:
        param, grad, opt = problem.tie_bytes(t)  # explicit before the ratios they default to move
        ties.append(dataclasses.replace(t, param_bytes=int(param * (1 + ratio)), grad_bytes=int(grad),
                                        optimizer_bytes=int(opt)))
    # tensor parallelism's collectives move the compute dtype (Note [tensor parallelism under autocast])
    # the sharded bytes grow with the copies they shard, so tensor parallelism divides the same
    # share of the weights term (tp_param_share) under every policy
    regions = tuple(dataclasses.replace(r, param_bytes=int(r.param_bytes * (1 + ratio)), tp=dataclasses.replace(
        r.tp, sharded_param_bytes=int(r.tp.sharded_param_bytes * (1 + ratio)),
        comm_bytes=int(round((r.tp.comm_bytes - r.tp.lookup_bytes) * ratio)) + r.tp.lookup_bytes,
        comm_bwd_bytes=int(round(r.tp.comm_bwd_bytes * ratio)), gather_bytes=int(round(r.tp.gather_bytes * ratio))))
                    for r in problem.regions)
    return dataclasses.replace(problem, regions=regions, ties=tuple(ties))
