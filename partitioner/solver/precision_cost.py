"""The precision policy in the cost model (Note [mixed precision] in runtime/execute/precision.py).

Note [precision in the cost model]: the passes trace the model in its own dtype; the policy
changes some figures, and this module changes them on the problem and the cluster before the
solve, so the ILP, the chain DP, the checker and the baselines all see them alike: the FLOP rate
of the policy's dtype (Note [flops per dtype] in partitioner/config/device_presets.py); 2 more
bytes per 4-byte parameter for autocast's weight copies (every parameter counted: conservative);
tensor parallelism's activation collectives at 2 bytes an element (Note [tensor parallelism under
autocast] in runtime/parallel/tensor_parallel.py), but not the vocab lookup's all-reduce or the
split gradients' gathers, which stay fp32. A profile calibrated under another policy is refused:
its seconds are of other kernels. Gradients, AdamW state, pipeline boundaries and saved
activations keep their traced bytes: exact for fp32 ones, an over-count of what autocast halves
(Note [boundaries in the autocast dtype] in partitioner/codegen/boundary_dtypes.py), conservative.
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
