"""`partitioner inspect --json`: the fields docs/design.md §11 promises, and strict JSON text."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from partitioner.inspect.layout import layout_json
from partitioner.inspect.table import balance, samples_per_s

if TYPE_CHECKING:  # annotations only
    from partitioner.solver.plan import Plan


def inspect_json(plan: Plan) -> dict:
    """The fields docs/design.md §11 promises, and more beside them (never fewer, never renamed)."""
    stages = []
    for s in plan.stages:
        m = s.memory
        stages.append({
            # DESIGN 11
            "index": s.index, "ranks": list(s.ranks), "device": s.device, "regions": list(s.region_names),
            "params": s.params, "flops_fwd": s.fwd_flops, "flops_bwd": s.bwd_flops,
            "predicted_time_s": s.predicted_time_s, "peak_memory_bytes": s.peak_memory_bytes,
            "memory_capacity_bytes": s.memory_capacity_bytes, "send_bytes": s.send_bytes,
            # extensions
            "region_ids": list(s.regions), "compute_time_s": s.compute_time_s, "comm_time_s": s.comm_time_s,
            "memory": {"params_bytes": m.params_bytes, "grads_bytes": m.grads_bytes,
                       "optimizer_bytes": m.optimizer_bytes, "activations_bytes": m.activations_bytes,
                       "buffers_bytes": m.buffers_bytes, "transient_bytes": m.transient_bytes,
                       "step_buffers_bytes": m.step_buffers_bytes},
        })
    predicted = {k: plan.predicted[k] for k in ("step_time_s", "bubble_fraction", "lower_bound_step_time_s")}
    predicted["samples_per_s"] = samples_per_s(plan)
    if "sdc_check_s_per_step" in plan.predicted:  # Note [replica digests]: part of step_time_s
        predicted["sdc_check_s_per_step"] = plan.predicted["sdc_check_s_per_step"]
    for key in ("sdc_canary_s_per_step", "sdc_canary_bubble_s"):  # Note [canary price]: the first in step_time_s
        if key in plan.predicted:
            predicted[key] = plan.predicted[key]
    if "grad_norm_s_per_step" in plan.predicted:  # Note [global gradient norm]: part of step_time_s
        predicted["grad_norm_s_per_step"] = plan.predicted["grad_norm_s_per_step"]
    if "cpu_time_model" in plan.predicted:  # Note [machine profile]: what priced the cpu devices
        predicted["cpu_time_model"] = plan.predicted["cpu_time_model"]
    if "unpriced_flops" in plan.predicted:  # Note [experts priced at 0] in passes/flops.py: not in step_time_s
        predicted["unpriced_flops"] = plan.predicted["unpriced_flops"]
    solver = {k: plan.solver.get(k) for k in ("status", "objective", "bound", "solve_time_s")}
    solver["gap"] = plan.solver.get("gap", 0.0)
    return {
        "plan_hash": plan.content_hash(),
        "workload": plan.workload,
        "num_stages": plan.num_stages,
        "dp": plan.dp,
        "microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "global_batch": plan.global_batch,
        "schedule": plan.schedule,
        "world_size": plan.world_size,
        "layout": layout_json(plan),  # tensor groups x stages x replicas (inspect/layout.py)
        "precision": plan.decisions.precision.value,
        "shard_optimizer": plan.decisions.shard_optimizer,
        "clip_grad_norm": plan.training.clip_grad_norm,
        "recompute": plan.training.recompute,  # auto | none | full (Note [recompute a user pins])
        "sdc_every": plan.decisions.sdc_every,
        "predicted": predicted,
        "balance": balance(plan),
        "solver": solver,
        "stages": stages,
        "cut_edges": [{"src_region": e.src_region, "dst_region": e.dst_region, "tensors": list(e.tensors),
                       "shapes": [list(x) for x in e.shapes], "bytes_per_microbatch": e.bytes_per_microbatch,
                       "boundaries": list(e.boundaries)} for e in plan.cut_edges],
        "ties": [{"param": t.param, "stages": list(t.stages), "placement": t.placement, "cost_s": t.cost_s}
                 for t in plan.ties],
        "regions": [{"id": r.id, "name": r.name, "stage": r.stage, "layer": r.layer, "recompute": r.recompute,
                     "flops_fwd_per_sample": r.fwd_flops, "flops_bwd_per_sample": r.bwd_flops,
                     "param_bytes": r.param_bytes, "activation_bytes_per_sample": r.activation_bytes,
                     "nodes": list(r.nodes)} for r in plan.regions],
        "baselines": {name: {"step_time_s": b.get("step_time_s")} for name, b in plan.baselines.items()},
        **({"memory_tier": plan.decisions.memory_tier} if plan.decisions.memory_tier else {}),
    }


def to_json_text(value) -> str:
    return json.dumps(value, indent=1, allow_nan=False, default=lambda v: None if isinstance(v, float) and
                      not math.isfinite(v) else str(v))

