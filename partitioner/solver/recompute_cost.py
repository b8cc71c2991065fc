"""What recomputing a region costs a microbatch: the one place that prices it (Note [recompute fixed cost]).

Note [recompute fixed cost]
    A recomputed region costs its forward again plus a checkpoint cost nearly independent of its
    size (Note [cheap checkpointing] in runtime/execute/recompute.py: ~0.37 ms per region per
    microbatch for GPT blocks of width 32 and 128 alike here, benchmarks/recompute_overhead.py),
    and on small microbatches the rerun's per-op dispatch adds as much again, which a FLOP-priced
    forward does not see. So recompute_s = forward_s + ``recompute_fixed_s(device)``: what the
    device's time model leaves unpriced, from a calibrated profile (beyond its fitted forward) or
    the kind's preset (beyond the FLOP-priced forward, dispatch included; it over-prices large
    regions by about the dispatch, ~0.3 ms), else 0. Every pricer (``evaluate``, the ILP, the
    chain DP, the bounds, the fair baselines) goes through ``recompute_s``, so a dearer recompute
    makes the solver recompute fewer regions where memory allows.

Note [recompute a user pins]
    ``--recompute`` says who decides: "auto" (the solver, where memory binds); "none" (a plan that
    does not fit without it is refused, naming --recompute); "full" (every region whose recompute
    saves memory, as Megatron's full activation recomputation; the solver chooses the rest with
    that priced). "full" leaves out the regions recomputing cannot help: one that updates a buffer
    (Note [recompute never updates twice] in partitioner/codegen/split.py: never checkpointed, so
    pinning it would price what the program does not run) and one whose kept inputs are as large
    as what it saves. The pin holds everywhere a plan is made (the ILP, its hints, the chain DP,
    the fair baselines: like for like); the lower bounds stay those of "auto", since the pinned
    plans are a subset. "selective": Note [selective recompute]; no region is recomputed whole.

Note [selective recompute]
    "selective" (Korthikanti et al. 2022, arXiv 2205.05198) recomputes each attention core (Note
    [the attention core] in passes/attention_core.py) and keeps the rest of its region's
    activations. It is priced on the problem, before any solve (``selective_problem``): a region
    with cores saves what only they save (passes/attention_core.py ``core_costs``, exact by
    storage) less the inputs they keep that nothing kept before; its backward runs their forward
    again (their FLOPs, or their share of a measured forward, plus one checkpoint's fixed cost
    each where the kind is measured), and its backward transient holds the rebuilt core once.
    Every pricer then sees that problem (the ILP, evaluate, the baselines, inspect), with whole
    regions pinned off, so the plan is priced as the program runs. Not built: selective under
    tensor parallelism (the core is on DTensors) and "auto" choosing it per region; both refused.
"""

from __future__ import annotations

import dataclasses

from partitioner.config.cluster import DeviceSpec
from partitioner.solver.problem import PartitionProblem, RegionCost, measured_or_preset, region_times_s


def saves_memory(region: RegionCost) -> bool:
    """Whether recomputing ``region`` frees memory: what "full" recomputes (Note [recompute a user pins])."""
    return region.activation_bytes_per_sample > region.recompute_activation_bytes_per_sample


def pinned_recompute(problem: PartitionProblem, mode: str) -> tuple[bool, ...] | None:
    """The recompute ``mode`` fixes for every region, or None where the solver chooses ("auto")
    (Note [recompute a user pins])."""
    if mode == "auto":
        return None
    return tuple(mode == "full" and saves_memory(r) for r in problem.regions)  # selective: cores, no region


def selective_problem(problem: PartitionProblem, gm, mode: str, batch_size: int) -> tuple[PartitionProblem, dict]:
    """The problem a compile with recompute ``mode`` plans over, and the attention cores it recomputes
    by region id (passes.attention_core.CoreCost; none unless "selective"), or ValueError when
    "selective" finds no core to recompute: it would run as "none"."""
    if mode != "selective":
        return problem, {}
    # lazy: the passes package loads networkx, which a solve alone never needs
    from passes.attention_core import core_costs

    costs = core_costs(gm)
    if not costs:
        raise ValueError("--recompute selective: no attention core (q kᵀ -> softmax -> [dropout] -> @ v in one "
                         "region, or scaled_dot_product_attention; Note [the attention core] in "
                         "passes/attention_core.py) in this model at this granularity: use --recompute full or auto")
    return priced_selective(problem, costs, batch_size), costs


def cores_record(problem: PartitionProblem, costs, batch_size: int) -> dict:
    """plan.json's ``solver.attention_cores``: per region with cores, how many, and the activation
    bytes per sample selective recompute saves there (inspect says it; tests hold it to a run)."""
    return {problem.regions[r].name: {"cores": c.cores, "saved_bytes_per_sample": (c.dropped_bytes - c.kept_bytes)
                                      // batch_size} for r, c in sorted(costs.items())}


def priced_selective(problem: PartitionProblem, costs, batch_size: int) -> PartitionProblem:
    """``problem`` with each region's attention cores recomputed (Note [selective recompute]):
    ``costs`` maps region id to passes.attention_core.CoreCost for a traced batch of
    ``batch_size``. Rounded the safe way: savings down, costs up."""
    regions = list(problem.regions)
    for r, cost in costs.items():
        region = regions[r]
        dropped, kept = cost.dropped_bytes // batch_size, -(-cost.kept_bytes // batch_size)
        share = cost.fwd_flops / region.fwd_flops_per_sample / batch_size if region.fwd_flops_per_sample else 0.0
        measured = region.bwd_s_per_sample_by_kind
        fixed = {kind: cost.cores * measured_or_preset(problem.recompute_fixed_s_by_kind, kind, "recompute_fixed_s")
                 for kind in measured or {}}
        regions[r] = dataclasses.replace(
            region,
            activation_bytes_per_sample=max(0, region.activation_bytes_per_sample - dropped + kept),
            bwd_flops_per_sample=region.bwd_flops_per_sample + cost.fwd_flops / batch_size,
            transient_bytes_per_sample=region.transient_bytes_per_sample + -(-cost.dropped_bytes // batch_size),
            bwd_s_per_sample_by_kind=None if measured is None else {
                kind: s + share * (region.fwd_s_per_sample_by_kind or {}).get(kind, 0.0) for kind, s in measured.items()},
            bwd_s_per_microbatch_by_kind=None if measured is None else {
                kind: (region.bwd_s_per_microbatch_by_kind or {}).get(kind, 0.0) + fixed[kind] for kind in measured})
    return dataclasses.replace(problem, regions=tuple(regions))


def recompute_fixed_s(problem: PartitionProblem, device: DeviceSpec) -> float:
    """Seconds a recomputed region costs a microbatch on ``device`` beyond its forward: the
    problem's measured figure for the kind, else the kind's preset, else 0."""
    return measured_or_preset(problem.recompute_fixed_s_by_kind, device.kind, "recompute_fixed_s")


def recompute_s(problem: PartitionProblem, region: RegionCost, device: DeviceSpec, microbatch_size: int) -> float:
    """Seconds recomputing ``region`` adds to one microbatch on ``device``: its forward again plus
    the checkpoint's fixed cost (Note [recompute fixed cost])."""
    return region_times_s(region, device, microbatch_size)[0] + recompute_fixed_s(problem, device)
