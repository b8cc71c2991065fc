"""Exact dynamic program over contiguous splits of the regions' topological order.

Note [chain DP]
    The objective (m - 1) * max_s T_s + sum_s T_s is not a min-max nor a min-sum, so one DP does
    not optimize it. But for a fixed cap C on every stage time, min sum_s T_s subject to
    T_s <= C *is* a plain DP over (stage, prefix) — a stage's time and memory depend only on its
    segment [i, j) and its index s (cut bytes at a position, links at a boundary, in-flight
    microbatches). So: for every candidate cap C in the set of achievable segment times, in
    increasing order, solve that DP and score (m - 1) * C + S(C); the optimum's own bottleneck
    is one of the candidates, where the score equals the optimum, and every other score is an
    achievable plan's upper bound. Stop once (m - 1) * C + S(inf) cannot beat the best.
    Exact for chains (every valid split is contiguous) with dp = 1, no ties and a fixed recompute
    choice; for other problems it is a heuristic (a hint for the ILP), costed by ``evaluate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.evaluate import evaluate
from partitioner.solver.problem import (
    Assignment,
    PartitionProblem,
    core_sharing_factor,
    microbatch_overhead_s,
    region_times_s,
)
from partitioner.solver.device_layout import plan_links
from partitioner.solver.recompute_cost import recompute_s
from partitioner.solver.schedules import priced_schedule

__all__ = ["ChainDPResult", "solve_chain_dp", "chain_lower_bound_s", "has_chain_backbone"]


@dataclass(frozen=True)
class ChainDPResult:
    stage_of_region: tuple[int, ...]
    pipeline_s: float          # the DP's objective: (m - 1) * max T + sum T
    step_time_s: float         # evaluate() of the split (adds all-reduce and tie costs)
    assignment: Assignment


def _cut_bytes(problem: PartitionProblem) -> np.ndarray:
    """cut_at[j]: bytes per sample crossing a cut placed before region j (skip edges included)."""
    cut_at = np.zeros(problem.num_regions + 1)
    for e in problem.edges:
        cut_at[e.src + 1 : e.dst + 1] += e.bytes_per_sample
    return cut_at


def _segment_comm(problem, boundary, cut_at, s, p, b, device):
    """Send/receive seconds of stage s holding regions i..j-1, plus the stage's per-microbatch
    overhead (Note [whole-step terms] in problem.py), [i, j]: it receives over boundary s-1 at its
    start and sends over boundary s at its end (Note [cost model] in evaluate.py)."""
    n = problem.num_regions
    comm = np.full((n + 1, n + 1), microbatch_overhead_s(problem, device))
    if s > 0:
        comm += (boundary[s - 1].latency_s + b * cut_at / boundary[s - 1].bandwidth_bytes_per_s)[:, None]
    if s < p - 1:
        comm += (boundary[s].latency_s + b * cut_at / boundary[s].bandwidth_bytes_per_s)[None, :]
    return comm


def _range_max(values) -> np.ndarray:
    """out[i, j] = max(values[i:j]) for i < j (0 elsewhere)."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    values = np.asarray(values, dtype=float)
    for i in range(n):
        out[i, i + 1:] = np.maximum.accumulate(values[i:])
    return out


def _segment_memory(problem, placement, s, *, num_microbatches, microbatch_size, schedule, cut_at,
                    saved_prefix, transient_max):
    """Memory of stage s holding regions i..j-1 as [i, j] matrices (Note [memory model] in
    evaluate.py): (held = static + buffers, active = activations + transient, held + step). The
    stage fits when held + active and held + step both fit. ``saved_prefix``: prefix sums of
    the saved activation bytes per sample; ``transient_max``: range maxima of the transients
    (bytes of one microbatch)."""
    n, p, b, m = problem.num_regions, len(placement), microbatch_size, num_microbatches
    d = len(placement[0])
    static = np.concatenate([[0.0], np.cumsum([r.static_bytes for r in problem.regions])])
    grads = np.concatenate([[0.0], np.cumsum([r.grad_bytes for r in problem.regions])])
    h = problem.boundary_holders  # Note [boundary holders] in partitioner/solver/tensor_groups.py
    cut_in = h * cut_at[:, None] if s > 0 else np.zeros((n + 1, 1))
    cut_out = h * cut_at[None, :] if s < p - 1 else np.zeros((1, n + 1))
    batch = problem.input_bytes_per_sample + problem.target_bytes_per_sample
    held = (static[None, :] - static[:, None] + 2 * b * (cut_in + cut_out) + d * m * b * batch)
    k = priced_schedule(schedule).in_flight(s, p, m)
    active = k * b * (saved_prefix[None, :] - saved_prefix[:, None] + cut_out + cut_in) + transient_max
    step = np.minimum(grads[None, :] - grads[:, None], problem.allreduce_bucket_bytes) if d > 1 else 0.0
    return held, active, held + step


def _segment_tables(problem, cluster, placement, *, num_microbatches, microbatch_size, schedule, recompute):
    """time[s][i, j] and fits[s][i, j] for stage s holding regions i..j-1 (inf / False when i >= j)."""
    n, p, b, m = problem.num_regions, len(placement), microbatch_size, num_microbatches
    boundary, _, _ = plan_links(cluster, placement)
    scale = core_sharing_factor(cluster, placement)
    cut_at = _cut_bytes(problem)
    saved = np.concatenate([[0.0], np.cumsum([
        r.recompute_activation_bytes_per_sample if rc else r.activation_bytes_per_sample
        for r, rc in zip(problem.regions, recompute)])])
    transient = _range_max([r.transient_bytes(microbatch_size, rc) for r, rc in zip(problem.regions, recompute)])
    times, fits = [], []
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)  # i < j
    for s in range(p):
        device = cluster.devices[placement[s][0]]
        capacity = cluster.least_usable_memory_bytes(placement[s])
        per_region = []
        for r, rc in zip(problem.regions, recompute):
            fwd, bwd = region_times_s(r, device, b)
            per_region.append(fwd + bwd + (recompute_s(problem, r, device, b) if rc else 0.0))
        compute = np.concatenate([[0.0], np.cumsum(per_region)])
        t = compute[None, :] - compute[:, None]
        comm = _segment_comm(problem, boundary, cut_at, s, p, b, device)
        t += comm
        held, active, step = _segment_memory(problem, placement, s, num_microbatches=m, microbatch_size=b,
                                             schedule=schedule, cut_at=cut_at, saved_prefix=saved,
                                             transient_max=transient)
        ok = upper & (held + active <= capacity) & (step <= capacity)
        if s == 0:
            ok[1:, :] = False  # the first stage starts at region 0
        if s == p - 1:
            ok[:, :n] = False  # the last stage ends at region n
        times.append(np.where(ok, scale * t, np.inf))  # Note [whole-step terms]
        fits.append(ok)
    return times


def _recompute_groups(problem, device, b):
    """Regions that recomputing saves bytes on, grouped by (recompute seconds, saved bytes per
    sample), cheapest per byte first: [(recompute_s, saving, region ids)]."""
    groups: dict[tuple[float, int], list[int]] = {}
    for r, region in enumerate(problem.regions):
        saving = region.activation_bytes_per_sample - region.recompute_activation_bytes_per_sample
        if saving > 0:
            groups.setdefault((recompute_s(problem, region, device, b), saving), []).append(r)
    return sorted(((f, sv, ids) for (f, sv), ids in groups.items()), key=lambda g: g[0] / g[1])


def _greedy_tables(problem, cluster, placement, *, num_microbatches, microbatch_size, schedule):
    """Like ``_segment_tables``, each segment recomputing the fewest, cheapest-per-byte regions
    that make it fit (Note [greedy recompute]): time[s][i, j], and take[s][g][i, j], the number of
    regions of group g recomputed."""
    n, p, b, m = problem.num_regions, len(placement), microbatch_size, num_microbatches
    boundary, _, _ = plan_links(cluster, placement)
    scale = core_sharing_factor(cluster, placement)
    cut_at = _cut_bytes(problem)
    act = np.concatenate([[0.0], np.cumsum([r.activation_bytes_per_sample for r in problem.regions])])
    transient = _range_max([r.transient_bytes(b, False) for r in problem.regions])
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    times, takes, groups_of = [], [], []
    for s in range(p):
        device = cluster.devices[placement[s][0]]
        capacity = cluster.least_usable_memory_bytes(placement[s])
        compute = np.concatenate([[0.0], np.cumsum([sum(region_times_s(r, device, b)) for r in problem.regions])])
        comm = _segment_comm(problem, boundary, cut_at, s, p, b, device)
        k = priced_schedule(schedule).in_flight(s, p, m)
        held, active, step = _segment_memory(problem, placement, s, num_microbatches=m, microbatch_size=b,
                                             schedule=schedule, cut_at=cut_at, saved_prefix=act,
                                             transient_max=np.zeros((n + 1, n + 1)))
        groups = _recompute_groups(problem, device, b)
        # A recomputed region's backward holds its rerun activations (Note [memory model]): the
        # stage's transient grows with the groups it recomputes, which may make it recompute
        # more. Iterate to the fixpoint (the transient only grows, at most once per group),
        # charging a group its largest member's transient.
        group_transient = [max(problem.regions[r].transient_bytes(b, True) for r in ids) for _, _, ids in groups]
        extra = np.zeros((n + 1, n + 1))
        for _ in range(len(groups) + 1):
            t = compute[None, :] - compute[:, None] + comm
            over = held + active + np.maximum(transient, extra) - capacity
            remaining = np.maximum(over, 0.0) / (k * b)  # saved bytes per sample still to free
            take_s = []
            for rec_s, saving, ids in groups:
                member = np.zeros(n + 1)
                member[np.array(ids) + 1] = 1.0
                prefix = np.cumsum(member)
                count = prefix[None, :] - prefix[:, None]
                take = np.clip(np.ceil(remaining / saving - 1e-9), 0.0, np.maximum(count, 0.0))
                t = t + take * rec_s
                remaining = remaining - take * saving
                take_s.append(take)
            grown = extra
            for take, g_transient in zip(take_s, group_transient):
                grown = np.maximum(grown, np.where(take > 0, g_transient, 0.0))
            if np.array_equal(grown, extra):
                break
            extra = grown
        ok = upper & (remaining <= 0) & (step <= capacity)
        if s == 0:
            ok[1:, :] = False
        if s == p - 1:
            ok[:, :n] = False
        times.append(np.where(ok, scale * t, np.inf))  # Note [whole-step terms]
        takes.append(take_s)
        groups_of.append(groups)
    return times, takes, groups_of


def _feasible_caps(times, n):
    """(smallest sum of stage times, the achievable stage times from the smallest feasible cap
    up, ascending) or None when no split fits. Feasibility is monotone in the cap, so the
    smallest feasible one (the min-max split's bottleneck) is found by bisection."""
    sum_floor, stages = _min_sum_under_cap(times, np.inf, n)
    if stages is None:
        return None
    caps = np.unique(np.concatenate([t[np.isfinite(t)] for t in times]))
    lo, hi = 0, len(caps) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_sum_under_cap(times, caps[mid], n)[1] is not None:
            hi = mid
        else:
            lo = mid + 1
    return float(sum_floor), caps[lo:]


def _min_sum_under_cap(times, cap, n):
    """min sum_s T_s with every T_s <= cap: (value, stage_of_region) or (inf, None)."""
    p = len(times)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = []
    for s in range(p):
        t = np.where(times[s] <= cap, times[s], np.inf)
        total = best[:, None] + t  # from prefix i to prefix j
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(n + 1)]
        choice.append(arg)
    if not np.isfinite(best[n]):
        return np.inf, None
    stages = [0] * n
    j = n
    for s in range(p - 1, -1, -1):
        i = int(choice[s][j])
        for r in range(i, j):
            stages[r] = s
        j = i
    return float(best[n]), tuple(stages)


def solve_chain_dp(
    problem: PartitionProblem,
    cluster: ClusterSpec,
    *,
    num_stages: int,
    num_microbatches: int,
    microbatch_size: int,
    schedule: str = "1f1b",
    placement: tuple[tuple[int, ...], ...] | None = None,
    recompute: tuple[bool, ...] | str | None = None,
    max_caps: int | None = None,
) -> ChainDPResult | None:
    """Best contiguous split for fixed p, m (Note [chain DP]); None if none fits memory.

    ``placement`` defaults to one pipeline on devices 0..p-1. ``max_caps`` stops after that many
    candidate caps (then the result is a heuristic, used for ILP hints on large problems).
    ``recompute``: a fixed choice per region (default none), or "greedy": each stage recomputes
    what it needs to fit (Note [greedy recompute]).

    Note [greedy recompute]: a segment over its memory recomputes regions cheapest per saved
    byte first (recompute seconds / bytes saved, regions of equal cost as a group), as many as
    it takes. That is the fractional knapsack's order rounded up to whole regions, so not always the
    cheapest set; the plans it gives are hints, and on layered models (a few region shapes
    repeated) they are usually the optimum, which lets CP-SAT prove it in a fraction of the time.
    """
    n, p, m = problem.num_regions, num_stages, num_microbatches
    if n < p:
        return None
    placement = placement or tuple((s,) for s in range(p))
    greedy = recompute == "greedy"
    if greedy:
        times, takes, groups_of = _greedy_tables(problem, cluster, placement, num_microbatches=m,
                                                 microbatch_size=microbatch_size, schedule=schedule)
    else:
        recompute = recompute or (False,) * n
        times = _segment_tables(problem, cluster, placement, num_microbatches=m,
                                microbatch_size=microbatch_size, schedule=schedule, recompute=recompute)
    found = _feasible_caps(times, n)
    if found is None:
        return None
    sum_floor, caps = found
    best_value, best_stages = np.inf, None
    tried = 0
    for cap in caps:
        if (m - 1) * cap + sum_floor >= best_value:
            break
        if max_caps is not None and tried >= max_caps and best_stages is not None:
            break
        tried += 1
        value, stages = _min_sum_under_cap(times, cap, n)
        if stages is not None and (m - 1) * cap + value < best_value:
            best_value, best_stages = (m - 1) * cap + value, stages
    if best_stages is None:
        return None
    if greedy:
        chosen = [False] * n
        for st in range(p):
            segment = [r for r in range(n) if best_stages[r] == st]
            i, j = segment[0], segment[-1] + 1
            for (_, _, ids), take in zip(groups_of[st], takes[st]):
                for r in [r for r in ids if i <= r < j][:int(take[i, j])]:
                    chosen[r] = True
        recompute = tuple(chosen)
    assignment = Assignment(
        stage_of_region=best_stages, recompute=recompute, device_of_stage_replica=placement,
        num_stages=p, dp=len(placement[0]), num_microbatches=m, microbatch_size=microbatch_size,
        schedule=schedule,
    )
    cost = evaluate(problem, cluster, assignment)
    return ChainDPResult(best_stages, cost.pipeline_s, cost.step_time_s, assignment)


def chain_lower_bound_s(
    problem: PartitionProblem,
    cluster: ClusterSpec,
    *,
    num_stages: int,
    num_microbatches: int,
    microbatch_size: int,
    schedule: str,
    placement: tuple[tuple[int, ...], ...],
    allow_recompute: bool = True,
) -> float:
    """A lower bound on the pipeline time (m - 1) * max_s T_s + sum_s T_s of every plan, valid when
    every plan is a contiguous split (the regions form a chain backbone r -> r + 1; inf otherwise
    is *not* returned: callers check ``has_chain_backbone``). Note [candidate pruning] in solve.py.

    Stage s holding regions i..j-1 costs at least its compute and comm (exact for contiguous
    splits) plus fractional recompute: N = (memory over capacity) / (in-flight * b) saved bytes
    per sample are needed (inf when recomputing the whole segment does not save them); by LP
    duality the cheapest fractional choice costs max over prices tau of
    tau * N - sum_{r in segment, rate_r < tau} (tau - rate_r) * saving_r, rate_r = recompute
    seconds (``recompute_s``, Note [recompute fixed cost]) per saved byte; any set of tau gives a
    bound (we use the regions' distinct rates). Then B* = the smallest achievable bottleneck
    (bisection over the DP) and S = the smallest achievable sum give (m - 1) * B* + S.
    """
    n, p, b, m = problem.num_regions, num_stages, microbatch_size, num_microbatches
    if n < p:
        return np.inf
    boundary, _, _ = plan_links(cluster, placement)
    scale = core_sharing_factor(cluster, placement)
    cut_at = _cut_bytes(problem)
    act = np.concatenate([[0.0], np.cumsum([r.activation_bytes_per_sample for r in problem.regions])])
    saving = np.concatenate([[0.0], np.cumsum([
        max(r.activation_bytes_per_sample - r.recompute_activation_bytes_per_sample, 0) if allow_recompute else 0
        for r in problem.regions])])
    transient = _range_max([r.transient_bytes(b, False) for r in problem.regions])
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    times = []
    savings = np.diff(saving)
    by_class: dict[tuple, tuple] = {}  # a stage's region times depend on its device's class alone
    for s in range(p):
        device = cluster.devices[placement[s][0]]
        capacity = cluster.least_usable_memory_bytes(placement[s])
        if device.device_class not in by_class:
            per_region = [region_times_s(r, device, b) for r in problem.regions]
            rates = np.array([recompute_s(problem, r, device, b) / sv if sv > 0 else np.inf
                              for r, sv in zip(problem.regions, savings)])
            taus = sorted({float(x) for x in rates if np.isfinite(x) and x > 0})
            if len(taus) > 16:  # any subset of prices is still a bound
                taus = taus[:: math.ceil(len(taus) / 16)] + taus[-1:]
            compute = np.concatenate([[0.0], np.cumsum([f + w for f, w in per_region])])
            by_class[device.device_class] = (rates, taus, compute[None, :] - compute[:, None])
        rates, taus, region_t = by_class[device.device_class]
        t = region_t.copy()
        comm = _segment_comm(problem, boundary, cut_at, s, p, b, device)
        t += comm
        k = priced_schedule(schedule).in_flight(s, p, m)
        # Transients without recompute: recomputing only raises them, so this stays a bound.
        held, active, step = _segment_memory(problem, placement, s, num_microbatches=m, microbatch_size=b,
                                             schedule=schedule, cut_at=cut_at, saved_prefix=act,
                                             transient_max=transient)
        over = held + active - capacity
        savable = k * b * (saving[None, :] - saving[:, None])
        ok = upper & (over <= savable) & (step <= capacity)
        if s == 0:
            ok[1:, :] = False
        if s == p - 1:
            ok[:, :n] = False
        needed = np.maximum(over, 0.0) / (k * b)
        forced_s = np.zeros_like(needed)
        for tau in taus:
            discount = np.concatenate([[0.0], np.cumsum(np.where(rates < tau, tau - rates, 0.0) * savings)])
            forced_s = np.maximum(forced_s, tau * needed - (discount[None, :] - discount[:, None]))
        t = t + forced_s
        times.append(np.where(ok, scale * t, np.inf))  # Note [whole-step terms]
    found = _feasible_caps(times, n)
    if found is None:
        return np.inf
    sum_floor, caps = found
    return float((m - 1) * caps[0] + sum_floor)


def has_chain_backbone(problem: PartitionProblem) -> bool:
    """True when edges r -> r + 1 join every consecutive pair: every valid plan is contiguous."""
    pairs = {(e.src, e.dst) for e in problem.edges}
    return all((r, r + 1) in pairs for r in range(problem.num_regions - 1))
