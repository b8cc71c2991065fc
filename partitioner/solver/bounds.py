"""Lower bounds on a plan's step time, without solving: the whole problem's, one candidate's (p, d,
m)'s, and their parts (the all-reduce, core sharing). The solver prunes candidates with them
(Note [candidate pruning] in solve.py) and reports the bound beside the plan."""

from __future__ import annotations

import math

from partitioner.config.cluster import ClusterSpec, LinkSpec
from partitioner.solver.problem import (
    PartitionProblem,
    core_sharing_factor,
    microbatch_overhead_s,
    region_times_s,
)
from partitioner.solver.device_layout import place_stages, plan_links
from partitioner.solver.recompute_cost import recompute_s
from partitioner.solver.schedules import priced_schedule

__all__ = ["lower_bound_step_time_s", "candidate_lower_bound_s", "allreduce_lower_bound_s",
           "core_sharing_lower_bound"]


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
    work_by_class = _per_problem(cluster, problem, "work_by_class", b, lambda: {  # one device a class
        c: sum(sum(region_times_s(r, first, b)) for r in problem.regions)
        for c, (first, _last, _n) in cluster.device_classes.items()
    })
    if stage_devices is not None:
        works = [work_by_class[cluster.devices[i].device_class] for i in stage_devices]
    else:  # the fastest num_stages slots, counts[c] // dp per class: O(stages), not O(devices / dp)
        counts = {c: n for c, (_first, _last, n) in cluster.device_classes.items()}
        works = []
        for c, w in sorted(work_by_class.items(), key=lambda item: item[1]):
            works += [w] * min(counts[c] // dp, num_stages - len(works))
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
    local_stages: int = 1,
) -> float:
    """A lower bound on ``evaluate``'s step time over every plan of one candidate (p, d, m, b),
    for pruning the enumeration (Note [candidate pruning] in solve.py); inf when no plan fits.

    * Forced recompute (fluid): stage s holds static_s + k_s * b * saved_s <= capacity - (the
      global batch + the smallest backward transient, which every stage holds) with
      k_s = in-flight microbatches, so sum_s saved_s <= max over static splits of
      sum_s (capacity - static_s) / (k_s * b) (static goes to the largest k_s first). The excess
      of sum_r activation bytes over that budget must be saved by recomputing; the cheapest
      fractional way (recompute seconds per saved byte, the cheapest device's: Note [recompute
      fixed cost]) costs R seconds per microbatch.
    * Time: sum_s T_s >= W + R + the boundaries' latencies (both directions); homogeneous
      B >= sum_s T_s / p, so the pipeline is >= (m + p - 1) / p * sum_s T_s. Heterogeneous:
      ``lower_bound_step_time_s`` + R.
    * All-reduce (d > 1): some stage holds >= 1/p of the gradients: 2 (d - 1) (G / (p d bw) + lat)
      with the fastest data-parallel link.
    """
    p, d, m, b = num_stages, dp, num_microbatches, microbatch_size
    priced = priced_schedule(schedule, local_stages)  # Note [one class per schedule]
    own = priced.lower_bound_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m, microbatch_size=b,
                               allow_recompute=allow_recompute)
    if own is not None:
        return own
    homogeneous = cluster.is_homogeneous
    fastest = cluster.fastest_device
    # Every stage holds the global batch and at least the smallest region's backward transient
    # (Note [memory model]); the receive buffers and held outputs (>= 0) are left out.
    floor = (d * m * b * (problem.input_bytes_per_sample + problem.target_bytes_per_sample)
             + min(r.transient_bytes(b, False) for r in problem.regions))
    capacity = cluster.most_usable_memory_bytes - floor
    if capacity < 0:
        return math.inf
    in_flight = sorted((priced.in_flight(s, p, m) for s in range(p)), reverse=True)
    static_left = float(sum(r.static_bytes for r in problem.regions))
    budget = 0.0  # saved activation bytes per sample the stages can hold at best
    for k in in_flight:
        static = min(capacity, static_left)
        static_left -= static
        budget += (capacity - static) / (k * b)
    if static_left > 0:
        return math.inf
    excess = sum(r.activation_bytes_per_sample for r in problem.regions) - budget
    forced_s = 0.0
    if excess > 0:
        if not allow_recompute:
            return math.inf
        for per_byte, saving in _per_problem(cluster, problem, "recompute_options", b,
                                             lambda: _recompute_options(problem, cluster, b)):
            take = min(saving, excess)
            forced_s += per_byte * take
            excess -= take
            if excess <= 0:
                break
        if excess > 0:
            return math.inf
    bound = lower_bound_step_time_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                    microbatch_size=b) + forced_s
    if homogeneous:
        boundary = _cluster_order(cluster, p, d)[0]
        work = _per_problem(cluster, problem, "fastest_work", b,
                            lambda: sum(sum(region_times_s(r, fastest, b)) for r in problem.regions))
        total = (work + forced_s + 2 * sum(link.latency_s for link in boundary)
                 + p * microbatch_overhead_s(problem, fastest))
        bound = max(bound, (m + p - 1) / p * total)
    return (bound + allreduce_lower_bound_s(problem, cluster, num_stages=p, dp=d)) * core_sharing_lower_bound(
        cluster, num_stages=p, dp=d)


def core_sharing_lower_bound(cluster: ClusterSpec, *, num_stages: int, dp: int) -> float:
    """The smallest core-sharing factor any placement of p * d ranks can get (Note [whole-step
    terms]): exact on a homogeneous cluster (its placement is fixed) or on one node, else 1."""
    if cluster.is_homogeneous:
        return _cluster_order(cluster, num_stages, dp)[2]
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
        links = [link for link in _cluster_order(cluster, p, d)[1] if link is not None]
    else:
        lanes = cluster.collective_lanes  # Note [collectives as NCCL runs them]
        links = [LinkSpec(link.bandwidth_bytes_per_s * lanes, link.latency_s)
                 for link in (cluster.intra_node_link, cluster.inter_node_link)]
    if not links:
        return 0.0
    grads = sum(r.grad_bytes for r in problem.regions)
    bandwidth = max(link.bandwidth_bytes_per_s for link in links)
    latency = min(link.latency_s for link in links)
    return 2 * (d - 1) * (grads / (p * d * bandwidth) + latency)


# Note [bounds priced per candidate shape]: the cheap bound is asked of every candidate (11,208 at
# 16,384 devices), and its parts depend on less than the candidate: the cluster-order layout's links
# and core sharing on (p, d) only (a pass over p * d ranks), the model's work and recompute prices on
# the microbatch size only (a pass over the regions). Each is computed once per cluster spec and
# kept in its memo (Note [cluster queries are cached] in partitioner/config/cluster.py), the same
# floats in the same order as before; the problem's are keyed by its identity and hold it, so a
# recycled id never answers for another problem. Guarded by tests/unit/test_compile_scaling.py.
def _cluster_order(cluster: ClusterSpec, p: int, d: int) -> tuple:
    """(boundary links, data-parallel links, core-sharing factor) of ``place_stages(cluster, p, d)``."""
    key = ("bounds.cluster_order", p, d)
    known = cluster.memo.get(key)
    if known is None:
        placement = place_stages(cluster, p, d)
        boundary, dp_links, _ = plan_links(cluster, placement)
        known = cluster.memo[key] = (tuple(boundary), tuple(dp_links), core_sharing_factor(cluster, placement))
    return known


def _per_problem(cluster: ClusterSpec, problem: PartitionProblem, name: str, b: int, compute):
    """``compute()``, once per (cluster, problem, name, b) (Note [bounds priced per candidate shape])."""
    key = ("bounds." + name, id(problem), b)
    known = cluster.memo.get(key)
    if known is None or known[0] is not problem:
        known = cluster.memo[key] = (problem, compute())
    return known[1]


def _recompute_options(problem: PartitionProblem, cluster: ClusterSpec, b: int) -> list[tuple[float, float]]:
    """(recompute seconds per saved byte on the cheapest device class, bytes saved) per region, cheapest first."""
    options = []
    kinds = [last for _first, last, _n in cluster.device_classes.values()]  # one device per class
    for r in problem.regions:
        saving = r.activation_bytes_per_sample - r.recompute_activation_bytes_per_sample
        if saving > 0:
            options.append((min(recompute_s(problem, r, dev, b) for dev in kinds) / saving, saving))
    return sorted(options)
