"""The float cost model: ``evaluate`` prices a plan, term by term, stage by stage.

``evaluate`` is the single source of truth for what a plan costs; baselines, the chain DP and
the checker (check.py) all use it, and the ILP (model.py) is its integer-scaled transcription.

Note [cost model]
    A stage's time per microbatch is T_s = compute (fwd + bwd, + the recomputed forward and its
    fixed cost: Note [recompute fixed cost]) + its sends (latency + bytes / bandwidth, activations
    forward and gradients back; an edge that skips stages is forwarded through every boundary it
    crosses) + its fixed overhead (Note [whole-step terms] in problem.py). The step is the pipeline,
    (m - 1) * max_s T_s + sum_s T_s (interleaved: Note [interleaved pricing] in interleaved.py),
    plus the slowest stage's ring all-reduce over its d replicas with its other per-step seconds
    (Note [tensor-parallel pricing]), plus each tie's reduce-then-broadcast chain, plus the
    amortised replica digest check and the global gradient norm when the program runs them
    (sdc_cost.py, grad_norm_cost.py; the ILP leaves these two out). Every time term is multiplied
    by the core-sharing factor. Each transfer is priced on the slowest link it may take (across
    replicas for a boundary, among replicas for the all-reduce): the replicas meet at the
    all-reduce, so the slowest one sets the step. Memory: Note [memory model].

Note [memory model]
    Memory is predicted conservatively (docs/design.md §12): the solver fills a device to the
    prediction, so every term is what the runtime actually holds, rounded up where uncertain.
    peak = static + buffers + max(activations + transient, step), where static is parameters,
    gradients (all alive from the first backward on) and optimizer state; activations are the
    in-flight microbatches' (m for GPipe, min(p - s, m) for 1F1B) saved tensors, stage outputs and
    received inputs (PipelineStage keeps them until their backward; on the last stage the loss's
    copy of the logits: Note [the loss on the last stage] in passes/memory.py), each boundary tensor
    times the devices that hold it (Note [boundary holders] in tensor_groups.py); buffers are two
    receive buffers each way (Note [receive buffers in flight] in runtime/execute/recv_buffers.py)
    and the whole global batch every rank builds before taking its rows; transient is the largest
    one region's backward needs; step is the tie copies and the all-reduce bucket (fused AdamW
    measured 0 bytes of temporaries). The capacity is the device's usable memory (Note [usable
    memory] in partitioner/config/device_presets.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.bounds import lower_bound_step_time_s
from partitioner.solver.schedules import priced_schedule
from partitioner.solver.problem import (
    Assignment,
    PartitionProblem,
    core_sharing_factor,
    microbatch_overhead_s,
    region_step_s,
    region_times_s,
)
from partitioner.solver.device_layout import plan_links
from partitioner.solver.grad_norm_cost import global_norm_s
from partitioner.solver.recompute_cost import recompute_s
from partitioner.solver.sdc_cost import replica_check_s

__all__ = ["StageCost", "TieCost", "CostBreakdown", "evaluate", "stage_memory"]


@dataclass(frozen=True)
class StageCost:
    regions: tuple[int, ...]
    compute_s: float
    comm_s: float
    time_s: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    capacity_bytes: int
    send_bytes: float  # per microbatch, forward activations sent to the next stage
    dp_allreduce_s: float
    transient_bytes: float = 0.0     # Note [memory model]
    step_buffers_bytes: float = 0.0
    overhead_s: float = 0.0  # per microbatch, besides regions and sends (Note [whole-step terms])
    forward_s: float = 0.0  # per microbatch, the part of time_s before the backward: f_s of Note [interleaved pricing]
    step_s: float = 0.0  # per step, the part of dp_allreduce_s that is not the data-parallel all-reduce
    weight_s: float = 0.0  # per microbatch, the weight-gradient part of the backward (Note [weight-gradient flops])

    @property
    def memory_bytes(self) -> float:
        """The predicted peak (Note [memory model])."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.buffers_bytes
                + max(self.activations_bytes + self.transient_bytes, self.step_buffers_bytes))


@dataclass(frozen=True)
class TieCost:
    regions: tuple[int, ...]
    status: str  # "colocated" (one stage) or "replicated"
    stages: tuple[int, ...]
    cost_s: float


@dataclass(frozen=True)
class CostBreakdown:
    stages: tuple[StageCost, ...]
    cut_bytes_per_sample: tuple[float, ...]  # per boundary k (between stage k and k + 1)
    bottleneck_s: float
    pipeline_s: float
    dp_allreduce_s: float
    ties: tuple[TieCost, ...]
    step_time_s: float
    bubble_fraction: float
    lower_bound_step_time_s: float
    sdc_check_s: float = 0.0  # per step (Note [cost model])
    grad_norm_s: float = 0.0  # per step (Note [cost model])
    # Interleaved only (else empty): per pipeline position, the rank's peak and its device's capacity
    rank_memory_bytes: tuple[float, ...] = ()
    rank_capacity_bytes: tuple[int, ...] = ()

    @property
    def fits_memory(self) -> bool:
        if self.rank_memory_bytes:
            return all(x <= c for x, c in zip(self.rank_memory_bytes, self.rank_capacity_bytes))
        return all(s.memory_bytes <= s.capacity_bytes for s in self.stages)


def evaluate(
    problem: PartitionProblem, cluster: ClusterSpec, assignment: Assignment, *, sdc_every: int = 0,
    global_norm: bool = False,
) -> CostBreakdown:
    """Cost of ``assignment`` in floats (Note [cost model]). Assumes it is structurally valid
    (see ``structural_violations``). ``sdc_every``: the plan's replica check interval (0: none);
    ``global_norm``: the program computes the global gradient norm (clipping or fp16)."""
    a = assignment
    p, d, m, b = a.num_stages, a.dp, a.num_microbatches, a.microbatch_size
    devices = cluster.devices
    regions_of = [[] for _ in range(p)]
    for r, s in enumerate(a.stage_of_region):
        regions_of[s].append(r)

    cut = [0.0] * max(p - 1, 0)
    for e in problem.edges:
        for k in range(a.stage_of_region[e.src], a.stage_of_region[e.dst]):
            cut[k] += e.bytes_per_sample
    boundary_link, dp_links, tie_link = plan_links(cluster, a.device_of_stage_replica)
    scale = core_sharing_factor(cluster, a.device_of_stage_replica)  # Note [whole-step terms]

    # Tie replicas: every stage holding a tie region other than the first region's stage.
    tie_costs = []
    tie_extra = [[0.0, 0.0, 0.0] for _ in range(p)]
    tie_grad_held = [0.0] * p  # gradient bytes of the ties each stage holds (sync_gradients copies them)
    for tie in problem.ties:
        stages = tuple(sorted({a.stage_of_region[r] for r in tie.regions}))
        param, grad, opt = problem.tie_bytes(tie)
        for s in stages:
            tie_grad_held[s] += grad
        home = a.stage_of_region[tie.regions[0]]
        for s in stages:
            if s != home:
                tie_extra[s][0] += param
                tie_extra[s][1] += grad
                tie_extra[s][2] += opt
        if len(stages) == 1:
            tie_costs.append(TieCost(tie.regions, "colocated", stages, 0.0))
        else:
            assert tie_link is not None
            # A held buffer (no gradient) costs its holders memory only: nothing is summed.
            cost = scale * (len(stages) - 1) * tie_link.transfer_s(grad) if grad else 0.0
            tie_costs.append(TieCost(tie.regions, "replicated", stages, cost))

    stage_costs = []
    fwd_part = [0.0] * p  # f_s of Note [interleaved pricing], unscaled
    wgt_part = [0.0] * p  # w_s of Note [zero-bubble pricing], unscaled
    for s in range(p):
        stage_devices = a.device_of_stage_replica[s]
        device = devices[stage_devices[0]]
        compute, fwd_part[s], wgt_part[s], params, grads, optimizer, step_s, saved, transient = _stage_terms(
            problem, cluster, device, b, regions_of[s], a.recompute)
        params += tie_extra[s][0]
        grads += tie_extra[s][1]
        optimizer += tie_extra[s][2]
        comm = 0.0
        if s < p - 1:
            comm += boundary_link[s].transfer_s(b * cut[s])
            fwd_part[s] += boundary_link[s].transfer_s(b * cut[s])
        if s > 0:
            comm += boundary_link[s - 1].transfer_s(b * cut[s - 1])
        memory = _stage_memory(problem, a, s, cut, grads, tie_grad_held[s], saved, transient)
        dp_link = dp_links[s]
        allreduce = 0.0 if dp_link is None else 2 * (d - 1) * (grads / d / dp_link.bandwidth_bytes_per_s + dp_link.latency_s)
        allreduce += step_s
        overhead = microbatch_overhead_s(problem, device)
        stage_costs.append(
            StageCost(
                regions=tuple(regions_of[s]),
                compute_s=scale * compute,
                comm_s=scale * comm,
                overhead_s=scale * overhead,
                time_s=scale * (compute + comm + overhead),
                params_bytes=params,
                grads_bytes=grads,
                optimizer_bytes=optimizer,
                activations_bytes=memory["activations"],
                buffers_bytes=memory["buffers"],
                capacity_bytes=cluster.least_usable_memory_bytes(stage_devices),
                send_bytes=b * cut[s] if s < p - 1 else 0.0,
                dp_allreduce_s=scale * allreduce,
                transient_bytes=memory["transient"],
                step_buffers_bytes=memory["step"],
                forward_s=scale * fwd_part[s],
                step_s=scale * step_s,
                weight_s=scale * wgt_part[s],
            )
        )
    bottleneck = max(st.time_s for st in stage_costs)
    total = sum(st.time_s for st in stage_costs)
    pp = a.pipeline_ranks
    # Note [one class per schedule] in runtime/program/schedules.py
    pipeline, dp_allreduce, rank_memory, rank_capacity = priced_schedule(a.schedule, a.local_stages).pipeline_terms(
        problem, a, stage_costs, dp_links, scale)
    state_bytes = [st.params_bytes + st.optimizer_bytes for st in stage_costs]
    state_bytes = [sum(state_bytes[s] for s in a.stages_at(pos)) for pos in range(pp)]  # per rank: its stages
    sdc_check = 0.0
    if sdc_every > 0 and d > 1:
        sdc_check = scale * replica_check_s(
            state_bytes, [devices[row[0]].kind for row in a.device_of_stage_replica[:pp]], world_size=pp * d,
            latency_s=max(link.latency_s for link in dp_links if link is not None)) / sdc_every
    grad_norm = 0.0
    if global_norm:  # per rank: an interleaved rank's pass reads all its stages' gradients
        latency = max((link.latency_s for link in (*boundary_link, *dp_links) if link is not None), default=0.0)
        grad_norm = scale * global_norm_s(
            [sum(stage_costs[s].grads_bytes for s in a.stages_at(pos)) for pos in range(pp)],
            [devices[a.device_of_stage_replica[pos][0]].kind for pos in range(pp)],
            world_size=pp * d, latency_s=latency)
    step = pipeline + dp_allreduce + sdc_check + grad_norm + sum(t.cost_s for t in tie_costs)
    bubble = 1.0 - m * total / (pp * pipeline) if pipeline > 0 else 0.0
    return CostBreakdown(
        stages=tuple(stage_costs),
        cut_bytes_per_sample=tuple(cut),
        bottleneck_s=bottleneck,
        pipeline_s=pipeline,
        dp_allreduce_s=dp_allreduce,
        ties=tuple(tie_costs),
        step_time_s=step,
        sdc_check_s=sdc_check,
        grad_norm_s=grad_norm,
        bubble_fraction=bubble,
        lower_bound_step_time_s=scale * lower_bound_step_time_s(
            problem, cluster, num_stages=p, dp=d, num_microbatches=m, microbatch_size=b,
            stage_devices=[row[0] for row in a.device_of_stage_replica],
        ),
        rank_memory_bytes=rank_memory,
        rank_capacity_bytes=rank_capacity,
    )


def stage_memory(problem: PartitionProblem, a: Assignment, s: int, regions: list[int], cut: list[float],
                 grads_bytes: float, tie_grads_bytes: float) -> dict[str, float]:
    """The memory terms of stage s other than model state (Note [memory model]): activations,
    buffers, transient and step, in bytes. ``cut[k]``: bytes per sample over boundary k;
    ``grads_bytes``: the stage's gradients (tie replicas included); ``tie_grads_bytes``: those of
    the ties it holds."""
    b = a.microbatch_size
    saved = sum(problem.regions[r].recompute_activation_bytes_per_sample if a.recompute[r]
                else problem.regions[r].activation_bytes_per_sample for r in regions)
    transient = max((problem.regions[r].transient_bytes(b, a.recompute[r]) for r in regions), default=0)
    return _stage_memory(problem, a, s, cut, grads_bytes, tie_grads_bytes, saved, transient)


def _stage_memory(problem: PartitionProblem, a: Assignment, s: int, cut: list[float], grads_bytes: float,
                  tie_grads_bytes: float, saved: float, transient: int) -> dict[str, float]:
    """``stage_memory`` from the stage's regions' saved activation bytes per sample and largest transient."""
    p, d, m, b = a.num_stages, a.dp, a.num_microbatches, a.microbatch_size
    holders = problem.boundary_holders  # Note [boundary holders] in tensor_groups.py
    cut_in = holders * cut[s - 1] if s > 0 else 0.0
    cut_out = holders * cut[s] if s < p - 1 else 0.0
    in_flight = priced_schedule(a.schedule, a.local_stages).in_flight(s, p, m)
    batch = problem.input_bytes_per_sample + problem.target_bytes_per_sample
    bucket = min(grads_bytes, float(problem.allreduce_bucket_bytes)) if d > 1 else 0.0
    return {
        "activations": float(in_flight * b * (saved + cut_out + cut_in)),
        "buffers": float(2 * b * (cut_in + cut_out) + d * m * b * batch),
        "transient": float(transient),
        "step": float(tie_grads_bytes + bucket),
    }


# Note [stage terms are kept]: the fair baselines evaluate every candidate (p, d, m) with the same
# two splits per p (11,176 evaluations at 16,384 devices), so one stage's regions, recompute flags,
# device speed and microbatch size recur across the d and m that share its b; their sums (compute,
# forward, weight gradient, state bytes, step, saved activations, largest transient) are kept per
# cluster spec (Note [cluster queries are cached] in partitioner/config/cluster.py), summed in the
# same order as before (the same floats), keyed by the problem's identity and holding it.
def _stage_terms(problem: PartitionProblem, cluster: ClusterSpec, device, b: int, regions: list[int],
                 recompute: tuple[bool, ...]) -> tuple:
    flags = tuple(recompute[r] for r in regions)
    key = ("evaluate.stage_terms", id(problem), device.kind, device.flops_per_s, b, tuple(regions), flags)
    known = cluster.memo.get(key)
    if known is None or known[0] is not problem:
        known = cluster.memo[key] = (problem, _sum_stage_terms(problem, device, b, regions, recompute))
    return known[1]


def _sum_stage_terms(problem: PartitionProblem, device, b: int, regions: list[int], recompute) -> tuple:
    compute = fwd_part = wgt_part = 0.0
    params = grads = optimizer = 0.0
    for r in regions:
        region = problem.regions[r]
        fwd, bwd = region_times_s(region, device, b)
        compute += fwd + bwd + (recompute_s(problem, region, device, b) if recompute[r] else 0.0)
        fwd_part += fwd
        wgt_part += bwd * region.weight_fraction
        params += region.param_bytes
        grads += region.grad_bytes
        optimizer += region.optimizer_bytes
    step_s = sum(region_step_s(problem.regions[r], device) for r in regions)
    saved = sum(problem.regions[r].recompute_activation_bytes_per_sample if recompute[r]
                else problem.regions[r].activation_bytes_per_sample for r in regions)
    transient = max((problem.regions[r].transient_bytes(b, recompute[r]) for r in regions), default=0)
    return compute, fwd_part, wgt_part, params, grads, optimizer, step_s, saved, transient
