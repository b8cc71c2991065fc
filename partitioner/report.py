"""Plans as text and JSON for people: the table `partitioner inspect` and `Plan.summary()` print."""

from __future__ import annotations

from partitioner.plan import Plan

GIB = 2**30


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.3f}" if num_bytes < 10 * GIB else f"{num_bytes / GIB:.1f}"


def _si(value: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def table(plan: Plan) -> str:
    p = plan.predicted
    lines = [
        f"plan {plan.content_hash()}  {plan.workload}",
        f"{plan.num_stages} stage(s) x {plan.dp} data-parallel = {plan.world_size} ranks; "
        f"{plan.num_microbatches} microbatches of {plan.microbatch_size} (global batch {plan.global_batch}); "
        f"schedule {plan.schedule}",
        "",
        f"{'stage':>5} {'ranks':<9} {'device':<8} {'regions':<22} {'params':>8} {'fwd FLOP':>9} {'bwd FLOP':>9} "
        f"{'time ms':>8} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'buffers':>8} {'peak GiB':>9} "
        f"{'cap GiB':>8} {'send':>8}",
    ]
    for s in plan.stages:
        names = s.region_names
        held = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
        m = s.memory
        lines.append(
            f"{s.index:>5} {','.join(map(str, s.ranks)):<9} {s.device:<8} {held[:22]:<22} {_si(s.params):>8} "
            f"{_si(s.flops_fwd):>9} {_si(s.flops_bwd):>9} {s.predicted_time_s * 1e3:>8.3f} "
            f"{_gib(m.params_bytes):>8} {_gib(m.grads_bytes):>8} {_gib(m.optimizer_bytes):>8} "
            f"{_gib(m.activations_bytes):>8} {_gib(m.buffers_bytes):>8} {_gib(s.peak_memory_bytes):>9} "
            f"{_gib(s.memory_capacity_bytes):>8} {_si(s.send_bytes) + 'B':>8}"
        )
    times = [s.predicted_time_s for s in plan.stages]
    mems = [s.peak_memory_bytes for s in plan.stages]
    lines += [
        "",
        f"balance: max/mean stage time {max(times) / (sum(times) / len(times)):.3f}, "
        f"max/mean memory {max(mems) / max(1e-9, sum(mems) / len(mems)):.3f}",
        f"predicted step {p['step_time_s'] * 1e3:.3f} ms, {p.get('samples_per_s', 0):.1f} samples/s, "
        f"bubble {p['bubble_fraction'] * 100:.1f}%, lower bound {p['lower_bound_step_time_s'] * 1e3:.3f} ms",
        f"solver {plan.solver['status']} objective {plan.solver['objective']:.6g} bound {plan.solver['bound']:.6g} "
        f"gap {plan.solver.get('gap', 0) * 100:.2f}% in {plan.solver['solve_time_s']:.2f} s",
    ]
    base = plan.baselines
    if base:
        ours = p["step_time_s"]
        parts = [f"ours {ours * 1e3:.3f} ms"]
        for name in ("uniform", "param_balanced"):
            if name in base and base[name].get("step_time_s"):
                t = base[name]["step_time_s"]
                parts.append(f"{name} {t * 1e3:.3f} ms ({t / ours:.2f}x)")
        lines.append("baselines: " + ", ".join(parts))
    if plan.cut_edges:
        lines.append("")
        lines.append("cut edges (tensor, shape, bytes per microbatch, boundaries):")
        for e in plan.cut_edges:
            for name, shape in zip(e.tensors, e.shapes):
                lines.append(f"  {name:<24} {str(list(shape)):<18} {_si(e.bytes_per_microbatch)}B  {list(e.boundaries)}")
    for t in plan.ties:
        lines.append(f"tied parameter {t.param}: {t.placement} on stages {list(t.stages)}, costs {t.cost_s * 1e3:.3f} ms/step")
    return "\n".join(lines)


def inspect_json(plan: Plan) -> dict:
    """The fields DESIGN section 11 promises, plus the whole plan under "plan"."""
    return {
        "plan_hash": plan.content_hash(),
        "num_stages": plan.num_stages,
        "dp": plan.dp,
        "microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "predicted": {k: plan.predicted[k] for k in ("step_time_s", "bubble_fraction", "lower_bound_step_time_s")},
        "solver": {k: plan.solver[k] for k in ("status", "objective", "bound", "solve_time_s")},
        "stages": [
            {"index": s.index, "ranks": list(s.ranks), "device": s.device, "regions": list(s.region_names),
             "params": s.params, "flops_fwd": s.flops_fwd, "flops_bwd": s.flops_bwd,
             "predicted_time_s": s.predicted_time_s, "peak_memory_bytes": s.peak_memory_bytes,
             "memory_capacity_bytes": s.memory_capacity_bytes, "send_bytes": s.send_bytes}
            for s in plan.stages
        ],
        "baselines": {name: {"step_time_s": b.get("step_time_s")} for name, b in plan.baselines.items()},
    }
