"""The float cost model (``evaluate``) and the independent checker (``check_assignment``).

``evaluate`` is the single source of truth for what a plan costs; baselines, the chain DP and
the checker all use it, and the ILP (model.py) is its integer-scaled transcription.

Note [cost model]
    For p stages, d replicas, m microbatches of b samples:
    * compute_s  = sum over the stage's regions of (fwd + bwd) time, + fwd again if recomputed.
    * cut[k]     = sum of bytes_per_sample of edges (u -> v) with stage(u) <= k < stage(v): an
                   edge skipping stages is forwarded through each boundary it crosses.
    * comm_s     = per microbatch, the stage's sends: activations over boundary s (if s < p-1)
                   and gradients over boundary s-1 (if s > 0), each latency + b*cut/bandwidth.
    * overhead_s = the stage's fixed cost per microbatch (Note [whole-step terms] in problem.py).
    * T_s        = compute_s + comm_s + overhead_s;  pipeline = (m - 1) * max_s T_s + sum_s T_s.
    * dp_allreduce = max_s ring all-reduce of stage s's gradients among its d replicas:
                   2 (d-1)/d * grad_bytes_s / bw + 2 (d-1) * latency (0 when d = 1).
    * tie cost   = (k - 1) * (latency + tie grad bytes / bw) for a tie spread over k stages
                   (a reduce-then-broadcast chain; equals the ring all-reduce for k = 2).
    * step_time  = pipeline + dp_allreduce + sum of tie costs.
    * every time term above is multiplied by the candidate's core-sharing factor (ranks per CPU
                   core on the most crowded node, at least 1; Note [whole-step terms]).
    * memory_s   = see Note [memory model].
    Links: boundary s uses the slowest link between stage s and s+1 over the replicas; the
    all-reduce of stage s the slowest link among its replicas; ties the slowest link within a
    replica's pipeline.

Note [memory model]
    Memory is predicted conservatively (DESIGN section 12): the solver fills a device to the
    prediction, so every term is what the runtime (runtime/train.py over torch.distributed.
    pipelining's PipelineStage) actually holds, rounded up where it is uncertain. Stage s of p,
    d replicas, m microbatches of b samples, k_s = in-flight microbatches (m for GPipe,
    min(p - s, m) for 1F1B), cut_in = cut[s - 1] (0 on stage 0), cut_out = cut[s] (0 last):
    * static      = params + grads + optimizer state (+ tie replicas). Gradients are freed by
                    zero_grad(set_to_none) after the step, but all exist from the first backward
                    on, so they count at the peak.
    * activations = k_s * b * (sum of saved activations [a recomputed region: only its inputs]
                    + cut_out). cut_out: the stage's outputs, which PipelineStage keeps in
                    fwd_cache until their backward even when no op saves them. On the last
                    stage the graph outputs (logits) and, when the loss is applied outside the
                    graph, its float copy (log-softmax of the logits) are the output node's saved
                    activations (Note [the loss on the last stage] in passes/memory.py).
    * buffers     = m * b * (cut_in + cut_out) + b * cut_in + d * m * b * (input + target).
                    PipelineStage allocates an activation receive buffer for every microbatch
                    (cut_in) and a gradient receive buffer for every microbatch (cut_out) once,
                    at its first step, and keeps them; the input gradient it sends back (cut_in)
                    lives until the send completes. Every rank builds the whole global batch
                    (d * m * b samples of inputs and targets) before narrowing to its rows.
    * transient   = max over the stage's regions of transient_bytes(b, recompute): the
                    gradients alive during one region's backward (the gradient frontier of the
                    graph, the op's own input/output/weight gradients; a recomputed region adds
                    its rerun forward's saved activations). One region runs backward at a time,
                    so the stage pays the largest, not the sum.
    * step        = (after the schedule, activations freed) tie gradient copies summed in
                    sync_gradients + for d > 1 the all-reduce's flat bucket, min(grads,
                    allreduce_bucket_bytes). AdamW runs fused (no temporaries at steady state:
                    measured 0 bytes; its state is allocated once, already in static).
    * peak        = static + buffers + max(activations + transient, step).
    The capacity compared with it is the device's usable memory (Note [usable memory] in
    cluster.py): what the allocator and the runtime reserve is left out there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partitioner.cluster import ClusterSpec, LinkSpec
from partitioner.solver.problem import (
    SCHEDULES,
    Assignment,
    PartitionProblem,
    core_sharing_factor,
    in_flight_microbatches,
    microbatch_overhead_s,
    place_stages,
    region_times_s,
    schedule_refusal,
)

__all__ = [
    "AssignmentError",
    "StageCost",
    "TieCost",
    "CostBreakdown",
    "evaluate",
    "check_assignment",
    "lower_bound_step_time_s",
    "candidate_lower_bound_s",
    "allreduce_lower_bound_s",
    "core_sharing_lower_bound",
    "structural_violations",
    "plan_links",
    "stage_memory",
]


class AssignmentError(ValueError):
    """A solution violates constraints; ``violations`` lists every one found."""

    def __init__(self, violations: list[str]):
        self.violations = tuple(violations)
        super().__init__(
            f"{len(violations)} violated constraint(s):\n" + "\n".join(f"  - {v}" for v in violations)
        )


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

    @property
    def fits_memory(self) -> bool:
        return all(s.memory_bytes <= s.capacity_bytes for s in self.stages)


def _slowest(cluster: ClusterSpec, devices) -> LinkSpec | None:
    return cluster.slowest_link(list(devices))


def plan_links(
    cluster: ClusterSpec, placement: tuple[tuple[int, ...], ...]
) -> tuple[list[LinkSpec], list[LinkSpec | None], LinkSpec | None]:
    """(boundary links, data-parallel link per stage, tie link) of a placement (Note [cost model]).

    Boundary k joins stage k and k + 1: the slowest link between them over the replicas.
    Stage s's all-reduce: the slowest link among its replicas (None when dp = 1). Ties: the
    slowest link within one replica's pipeline, worst over replicas (None for one stage).
    """
    num_stages, dp = len(placement), len(placement[0])
    boundary = [
        max(
            (cluster.link_between(placement[k][r], placement[k + 1][r]) for r in range(dp)),
            key=lambda link: (1.0 / link.bandwidth_bytes_per_s, link.latency_s),
        )
        for k in range(num_stages - 1)
    ]
    dp_links = [_slowest(cluster, row) for row in placement]
    tie_link = None
    for r in range(dp):
        link = _slowest(cluster, [placement[s][r] for s in range(num_stages)])
        if link is not None and (tie_link is None or link.bandwidth_bytes_per_s < tie_link.bandwidth_bytes_per_s):
            tie_link = link
    return boundary, dp_links, tie_link


def lower_bound_step_time_s(
    problem: PartitionProblem,
    cluster: ClusterSpec,
    *,
    num_stages: int,
    dp: int,
    num_microbatches: int,
    microbatch_size: int,
    stage_devices: list[int] | None = None,
) -> float:
    """The step time of the best perfectly divisible model: a lower bound for any partition.

    W_s is the per-microbatch work of the whole model on stage s's device. Stage s takes a
    fraction f_s of it (sum f_s = 1) in T_s >= f_s * W_s, so the pipeline (m - 1) * B + sum_s T_s
    with B = max_s T_s is at least the optimum of that linear program: convex and piecewise
    linear in B, its minimum sits where the k fastest stages are exactly full, B_k =
    1 / sum_{i < k} (1 / W_(i)) (fastest first), giving min_k (m - 1 + k) * B_k. Homogeneous:
    (m + p - 1) * W / p, the bound of perfectly balanced stages; heterogeneous with m large:
    balanced stages too, (m + p - 1) * B_p. Without ``stage_devices`` (one device per stage) the
    fastest stage slots the cluster offers are used.
    """
    b = microbatch_size
    work_by_class: dict[tuple, float] = {}
    for device in cluster.devices:
        if device.device_class not in work_by_class:
            work_by_class[device.device_class] = sum(
                sum(region_times_s(r, device, b)) for r in problem.regions
            )
    if stage_devices is not None:
        works = [work_by_class[cluster.devices[i].device_class] for i in stage_devices]
    else:
        counts: dict[tuple, int] = {}
        for device in cluster.devices:
            counts[device.device_class] = counts.get(device.device_class, 0) + 1
        slots = sorted(w for c, w in work_by_class.items() for _ in range(counts[c] // dp))
        works = slots[:num_stages]
        if len(works) < num_stages:
            return math.inf
    best = math.inf
    inverse = 0.0
    for k, w in enumerate(sorted(works), start=1):
        if w <= 0:
            return 0.0
        inverse += 1.0 / w
        best = min(best, (num_microbatches - 1 + k) / inverse)
    return best


def candidate_lower_bound_s(
    problem: PartitionProblem,
    cluster: ClusterSpec,
    *,
    num_stages: int,
    dp: int,
    num_microbatches: int,
    microbatch_size: int,
    schedule: str,
    allow_recompute: bool = True,
) -> float:
    """A lower bound on ``evaluate``'s step time over every plan of one candidate (p, d, m, b),
    for pruning the enumeration (Note [candidate pruning] in solve.py); inf when no plan fits.

    * Forced recompute (fluid): stage s holds static_s + k_s * b * saved_s <= capacity - (the
      global batch + the smallest backward transient, which every stage holds) with
      k_s = in-flight microbatches, so sum_s saved_s <= max over static splits of
      sum_s (capacity - static_s) / (k_s * b) (static goes to the largest k_s first). The excess
      of sum_r activation bytes over that budget must be saved by recomputing; the cheapest
      fractional way (fwd seconds per saved byte) costs R seconds per microbatch.
    * Time: sum_s T_s >= W + R + the boundaries' latencies (both directions); homogeneous
      B >= sum_s T_s / p, so the pipeline is >= (m + p - 1) / p * sum_s T_s. Heterogeneous:
      ``lower_bound_step_time_s`` + R.
    * All-reduce (d > 1): some stage holds >= 1/p of the gradients: 2 (d - 1) (G / (p d bw) + lat)
      with the fastest data-parallel link.
    """
    p, d, m, b = num_stages, dp, num_microbatches, microbatch_size
    homogeneous = cluster.is_homogeneous
    fastest = max(cluster.devices, key=lambda dev: dev.flops_per_s)
    # Every stage holds the global batch and at least the smallest region's backward transient
    # (Note [memory model]); the receive buffers and held outputs (>= 0) are left out.
    floor = (d * m * b * (problem.input_bytes_per_sample + problem.target_bytes_per_sample)
             + min(r.transient_bytes(b, False) for r in problem.regions))
    capacity = max(dev.usable_memory_bytes for dev in cluster.devices) - floor
    if capacity < 0:
        return math.inf
    in_flight = sorted((in_flight_microbatches(schedule, s, p, m) for s in range(p)), reverse=True)
    static_left = float(sum(r.static_bytes for r in problem.regions))
    budget = 0.0  # saved activation bytes per sample the stages can hold at best
    for k in in_flight:
        static = min(capacity, static_left)
        static_left -= static
        budget += (capacity - static) / (k * b)
    if static_left > 0:
        return math.inf
    excess = sum(r.activation_bytes_per_sample for r in problem.regions) - budget
    recompute_s = 0.0
    if excess > 0:
        if not allow_recompute:
            return math.inf
        options = []
        for r in problem.regions:
            saving = r.activation_bytes_per_sample - r.recompute_activation_bytes_per_sample
            if saving > 0:
                options.append((region_times_s(r, fastest, b)[0] / saving, saving))
        for per_byte, saving in sorted(options):
            take = min(saving, excess)
            recompute_s += per_byte * take
            excess -= take
            if excess <= 0:
                break
        if excess > 0:
            return math.inf
    bound = lower_bound_step_time_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                    microbatch_size=b) + recompute_s
    if homogeneous:
        placement = place_stages(cluster, p, d)
        boundary, _, _ = plan_links(cluster, placement)
        work = sum(sum(region_times_s(r, fastest, b)) for r in problem.regions)
        total = (work + recompute_s + 2 * sum(link.latency_s for link in boundary)
                 + p * microbatch_overhead_s(problem, fastest))
        bound = max(bound, (m + p - 1) / p * total)
    return (bound + allreduce_lower_bound_s(problem, cluster, num_stages=p, dp=d)) * core_sharing_lower_bound(
        cluster, num_stages=p, dp=d)


def core_sharing_lower_bound(cluster: ClusterSpec, *, num_stages: int, dp: int) -> float:
    """The smallest core-sharing factor any placement of p * d ranks can get (Note [whole-step
    terms]): exact on a homogeneous cluster (its placement is fixed) or on one node, else 1."""
    if cluster.is_homogeneous:
        return core_sharing_factor(cluster, place_stages(cluster, num_stages, dp))
    if len({device.node for device in cluster.devices}) == 1:
        return core_sharing_factor(cluster, num_ranks=num_stages * dp)
    return 1.0


def allreduce_lower_bound_s(problem: PartitionProblem, cluster: ClusterSpec, *, num_stages: int, dp: int) -> float:
    """Some stage holds >= 1/p of the gradients: 2 (d - 1) (G / (p d bw) + latency) with the
    fastest data-parallel link of the candidate (any link on a heterogeneous cluster)."""
    p, d = num_stages, dp
    if d == 1:
        return 0.0
    if cluster.is_homogeneous:
        links = [link for link in plan_links(cluster, place_stages(cluster, p, d))[1] if link is not None]
    else:
        links = [cluster.intra_node_link, cluster.inter_node_link]
    if not links:
        return 0.0
    grads = sum(r.grad_bytes for r in problem.regions)
    bandwidth = max(link.bandwidth_bytes_per_s for link in links)
    latency = min(link.latency_s for link in links)
    return 2 * (d - 1) * (grads / (p * d * bandwidth) + latency)


def evaluate(
    problem: PartitionProblem, cluster: ClusterSpec, assignment: Assignment
) -> CostBreakdown:
    """Cost of ``assignment`` in floats (Note [cost model]). Assumes it is structurally valid
    (see ``structural_violations``)."""
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
    for s in range(p):
        stage_devices = a.device_of_stage_replica[s]
        device = devices[stage_devices[0]]
        compute = 0.0
        params = grads = optimizer = 0.0
        for r in regions_of[s]:
            region = problem.regions[r]
            fwd, bwd = region_times_s(region, device, b)
            compute += fwd + bwd + (fwd if a.recompute[r] else 0.0)
            params += region.param_bytes
            grads += region.grad_bytes
            optimizer += region.optimizer_bytes
        params += tie_extra[s][0]
        grads += tie_extra[s][1]
        optimizer += tie_extra[s][2]
        comm = 0.0
        if s < p - 1:
            comm += boundary_link[s].transfer_s(b * cut[s])
        if s > 0:
            comm += boundary_link[s - 1].transfer_s(b * cut[s - 1])
        memory = stage_memory(problem, a, s, regions_of[s], cut, grads, tie_grad_held[s])
        dp_link = dp_links[s]
        allreduce = 0.0 if dp_link is None else 2 * (d - 1) * (grads / d / dp_link.bandwidth_bytes_per_s + dp_link.latency_s)
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
                capacity_bytes=min(devices[i].usable_memory_bytes for i in stage_devices),
                send_bytes=b * cut[s] if s < p - 1 else 0.0,
                dp_allreduce_s=scale * allreduce,
                transient_bytes=memory["transient"],
                step_buffers_bytes=memory["step"],
            )
        )
    bottleneck = max(st.time_s for st in stage_costs)
    total = sum(st.time_s for st in stage_costs)
    pipeline = (m - 1) * bottleneck + total
    dp_allreduce = max(st.dp_allreduce_s for st in stage_costs)
    step = pipeline + dp_allreduce + sum(t.cost_s for t in tie_costs)
    bubble = 1.0 - m * total / (p * pipeline) if pipeline > 0 else 0.0
    return CostBreakdown(
        stages=tuple(stage_costs),
        cut_bytes_per_sample=tuple(cut),
        bottleneck_s=bottleneck,
        pipeline_s=pipeline,
        dp_allreduce_s=dp_allreduce,
        ties=tuple(tie_costs),
        step_time_s=step,
        bubble_fraction=bubble,
        lower_bound_step_time_s=scale * lower_bound_step_time_s(
            problem, cluster, num_stages=p, dp=d, num_microbatches=m, microbatch_size=b,
            stage_devices=[row[0] for row in a.device_of_stage_replica],
        ),
    )


def stage_memory(problem: PartitionProblem, a: Assignment, s: int, regions: list[int], cut: list[float],
                 grads_bytes: float, tie_grads_bytes: float) -> dict[str, float]:
    """The memory terms of stage s other than model state (Note [memory model]): activations,
    buffers, transient and step, in bytes. ``cut[k]``: bytes per sample over boundary k;
    ``grads_bytes``: the stage's gradients (tie replicas included); ``tie_grads_bytes``: those of
    the ties it holds."""
    p, d, m, b = a.num_stages, a.dp, a.num_microbatches, a.microbatch_size
    cut_in = cut[s - 1] if s > 0 else 0.0
    cut_out = cut[s] if s < p - 1 else 0.0
    saved = sum(problem.regions[r].recompute_activation_bytes_per_sample if a.recompute[r]
                else problem.regions[r].activation_bytes_per_sample for r in regions)
    in_flight = in_flight_microbatches(a.schedule, s, p, m)
    batch = problem.input_bytes_per_sample + problem.target_bytes_per_sample
    transient = max((problem.regions[r].transient_bytes(b, a.recompute[r]) for r in regions), default=0)
    bucket = min(grads_bytes, float(problem.allreduce_bucket_bytes)) if d > 1 else 0.0
    return {
        "activations": float(in_flight * b * (saved + cut_out)),
        "buffers": float(m * b * (cut_in + cut_out) + b * cut_in + d * m * b * batch),
        "transient": float(transient),
        "step": float(tie_grads_bytes + bucket),
    }


def structural_violations(
    problem: PartitionProblem, cluster: ClusterSpec, assignment: Assignment, *, global_batch: int | None = None
) -> list[str]:
    """Every violated structural constraint (everything but memory and figures)."""
    a = assignment
    n, p, d = problem.num_regions, a.num_stages, a.dp
    out: list[str] = []
    if p < 1 or d < 1 or a.num_microbatches < 1 or a.microbatch_size < 1:
        out.append(f"num_stages={p}, dp={d}, num_microbatches={a.num_microbatches}, "
                   f"microbatch_size={a.microbatch_size} must all be >= 1")
        return out
    if a.schedule not in SCHEDULES:
        out.append(f"schedule={a.schedule!r} is not one of {SCHEDULES}")
    elif (refusal := schedule_refusal(a.schedule, p, a.num_microbatches)) is not None:
        out.append(refusal)
    if global_batch is not None and a.microbatch_size * d * a.num_microbatches != global_batch:
        out.append(f"microbatch_size * dp * num_microbatches = {a.microbatch_size} * {d} * "
                   f"{a.num_microbatches} != global_batch {global_batch}")
    if len(a.stage_of_region) != n:
        out.append(f"stage_of_region has {len(a.stage_of_region)} entries, the problem has {n} regions")
        return out
    if len(a.recompute) != n:
        out.append(f"recompute has {len(a.recompute)} entries, the problem has {n} regions")
        return out
    bad = [(r, s) for r, s in enumerate(a.stage_of_region) if not 0 <= s < p]
    if bad:
        out.append(f"regions on a stage outside 0..{p - 1} (wrong stage count): {bad[:5]}")
        return out
    for e in problem.edges:
        su, sv = a.stage_of_region[e.src], a.stage_of_region[e.dst]
        if su > sv:
            out.append(f"dependency backwards: edge {e.src}->{e.dst} goes from stage {su} to stage {sv}")
    used = set(a.stage_of_region)
    for s in range(p):
        if s not in used:
            out.append(f"stage {s} is empty")
    if len(a.device_of_stage_replica) != p or any(len(row) != d for row in a.device_of_stage_replica):
        out.append(f"device_of_stage_replica must be {p} rows of {d} devices, got "
                   f"{[len(row) for row in a.device_of_stage_replica]}")
        return out
    flat = [i for row in a.device_of_stage_replica for i in row]
    outside = [i for i in flat if not 0 <= i < cluster.num_devices]
    if outside:
        out.append(f"device indices {outside} outside 0..{cluster.num_devices - 1}")
        return out
    twice = sorted({i for i in flat if flat.count(i) > 1})
    if twice:
        out.append(f"devices used twice: {twice}")
    for s, row in enumerate(a.device_of_stage_replica):
        kinds = {cluster.devices[i].device_class for i in row}
        if len(kinds) > 1:
            out.append(f"stage {s}'s replicas run on different device classes {sorted(kinds)}")
    return out


def check_assignment(
    problem: PartitionProblem, cluster: ClusterSpec, solution, *, rel_tol: float = 1e-6
) -> CostBreakdown:
    """Re-verify ``solution`` (a Solution) from scratch in floats, without CP-SAT.

    Raises AssignmentError listing every violation: structure (stage count, empty stages,
    backwards dependencies, devices used twice or mixed), memory over capacity, predicted
    figures that differ from ``evaluate``, and an ILP objective that differs from the recomputed
    step time by more than the integer rounding allows. Returns the recomputed breakdown.
    """
    a = solution.assignment
    violations = structural_violations(problem, cluster, a, global_batch=solution.global_batch)
    if violations:
        raise AssignmentError(violations)
    cost = evaluate(problem, cluster, a)
    for s, st in enumerate(cost.stages):
        if st.memory_bytes > st.capacity_bytes:
            violations.append(f"memory over capacity: stage {s} needs {st.memory_bytes / 2**30:.3f} GiB, "
                              f"its device holds {st.capacity_bytes / 2**30:.3f} GiB")

    def close(x: float, y: float, tol: float) -> bool:
        return abs(x - y) <= tol + rel_tol * max(abs(x), abs(y))

    if not close(solution.step_time_s, cost.step_time_s, 0.0):
        violations.append(f"predicted step_time_s {solution.step_time_s!r} != recomputed {cost.step_time_s!r}")
    if len(solution.stages) != a.num_stages:
        violations.append(f"{len(solution.stages)} predicted stages for num_stages={a.num_stages}")
    else:
        for s, (claimed, actual) in enumerate(zip(solution.stages, cost.stages)):
            for field_name in ("compute_s", "comm_s", "overhead_s", "params_bytes", "grads_bytes", "optimizer_bytes",
                               "activations_bytes", "buffers_bytes", "transient_bytes", "step_buffers_bytes",
                               "capacity_bytes", "send_bytes"):
                x, y = getattr(claimed, field_name), getattr(actual, field_name)
                if not close(x, y, 0.0):
                    violations.append(f"stage {s} predicted {field_name}={x!r}, recomputed {y!r}")
    # The ILP objective is in integer time units, each coefficient rounded to the nearest unit.
    unit = solution.time_unit_s
    if solution.objective is not None and unit:
        objective_s = solution.objective * unit
        slack = solution.rounding_slack_units * unit
        if solution.exact_links:
            if abs(objective_s - cost.step_time_s) > slack + rel_tol * cost.step_time_s:
                violations.append(f"objective mismatch: ILP objective {objective_s!r} s vs recomputed "
                                  f"{cost.step_time_s!r} s (rounding allows {slack!r} s)")
        elif objective_s < cost.step_time_s - slack - rel_tol * cost.step_time_s:
            violations.append(f"objective mismatch: ILP objective {objective_s!r} s below recomputed "
                              f"{cost.step_time_s!r} s although its links are conservative")
        if solution.bound is not None and solution.bound > solution.objective:
            violations.append(f"solver bound {solution.bound} exceeds objective {solution.objective}")
    if violations:
        raise AssignmentError(violations)
    return cost
