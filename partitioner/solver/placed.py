"""One candidate (p, d, m: partitioner/solver/candidate.py) solved over its placements: exactly, one CP-SAT model per placement
(Note [exact placements] in placements.py), or by the class-choice relaxation when there are too
many (Note [heterogeneous devices] in model.py).

Both return a ``PlacedResult``: the best plan in exact figures (``evaluate``), its objective in
the common time unit, and a bound in that unit valid for every plan of every placement.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.baselines import baseline_assignments
from partitioner.solver.bounds import allreduce_lower_bound_s, lower_bound_step_time_s
from partitioner.solver.candidate import Candidate
from partitioner.solver.chain_dp import chain_lower_bound_s, has_chain_backbone, solve_chain_dp
from partitioner.solver.evaluate import CostBreakdown, evaluate
from partitioner.solver.model import CandidateModel, InconsistentBoundError, SolverConfig
from partitioner.solver.placements import is_launchable
from partitioner.solver.problem import (
    Assignment,
    PartitionProblem,
    core_sharing_factor,
    region_times_s,
)
from partitioner.solver.device_layout import place_stages
from partitioner.solver.recompute_cost import pinned_recompute

__all__ = ["PlacedResult", "common_time_unit_s", "solve_placements", "solve_relaxed"]


@dataclass(frozen=True)
class PlacedResult:
    status: str                          # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN
    assignment: Assignment | None
    cost: CostBreakdown | None
    objective: int | None                # time units
    bound: int | None                    # time units; a bound over every placement
    time_unit_s: float
    memory_unit_bytes: int
    rounding_slack_units: float
    exact_links: bool
    solve_time_s: float
    placements: int                      # how many were solved (0: the relaxation)


def common_time_unit_s(problem: PartitionProblem, cluster: ClusterSpec, microbatch_size: int,
                       config: SolverConfig) -> float:
    """One unit for every placement's model (so their objectives and bounds compare): the
    automatic unit of Note [ILP scaling] for the fastest device class."""
    if config.time_unit_s is not None:
        return config.time_unit_s
    work_s = min(sum(sum(region_times_s(r, device, microbatch_size)) for r in problem.regions)
                 for device in cluster.devices)
    return min(1e-6, 10.0 ** math.floor(math.log10(work_s / 1e6))) if work_s > 0 else 1e-6


def _model(problem, cluster, c: Candidate, config, placement=None) -> CandidateModel:
    return CandidateModel(problem, cluster, num_stages=c.p, dp=c.d, num_microbatches=c.m, microbatch_size=c.b,
                          schedule=c.schedule, config=config, placement=placement)


def _hinted_model(problem, cluster, placement, c: Candidate, *, config, incumbent_s, hints):
    """A model on ``placement``, hinted and capped."""
    model = _model(problem, cluster, c, config, placement)
    plans = []
    if config.use_hint and hints is not None:
        plans = _hint_plans(model, problem, cluster, c, placement=hints)
    _hint_and_cap(model, plans, cluster, hints, incumbent_s)
    return model, plans


def _hint_and_cap(model, plans, cluster, hint_placement, incumbent_s) -> None:
    """Hint the best hint plan and cap the objective at the incumbent (+ the rounding any plan's
    objective may carry, Note [ILP scaling]). A hint above the cap is left out: it cannot be a
    solution, and OR-Tools 9.15 aborts the process (``Check failed: heuristics.fixed_search !=
    nullptr``) on such a model with interleave_search and 2 workers once presolve proves it
    infeasible (seen on GPT-2 small, 4 stages on 2 x A100 + 2 x H100)."""
    cap = None
    if incumbent_s is not None:
        cap = math.floor((incumbent_s + model.max_rounding_s()) / model.time_unit_s)
    values = _best_hint(model, plans, cluster, hint_placement) if plans else None
    if values is not None and (cap is None or model.objective.value(values) <= cap):
        model.add_hint(values)
    if cap is not None:
        model.cap_objective(cap)


def solve_placements(problem, cluster, placements, c: Candidate, *, config, time_limit_s,
                     incumbent_s, time_unit_s=None) -> PlacedResult:
    """Solve every placement's model (exact links), capping each at the best plan so far; the
    bound is the smallest over placements (a placement proven unable to beat the cap is bounded
    by the cap). OPTIMAL when the best plan's objective reaches that bound."""
    start = time.perf_counter()
    limit = time_limit_s or config.time_limit_s
    if time_unit_s is not None:
        config = replace(config, time_unit_s=time_unit_s)
    best = None  # (cost, assignment, objective, model, result)
    bounds: list[float] = []
    statuses: list[str] = []
    unit = mem_unit = None
    chain = has_chain_backbone(problem)
    ranked = sorted((placement_bound_s(problem, cluster, placement, c, allow_recompute=config.allow_recompute,
                                       chain=chain), placement)
                    for placement in placements)
    placements = [placement for _, placement in ranked]
    for i, (lower_s, placement) in enumerate(ranked):
        if math.isinf(lower_s):  # no plan on it fits memory
            bounds.append(math.inf)
            statuses.append("INFEASIBLE")
            continue
        if best is not None and lower_s >= best[0].step_time_s * (1 - 1e-9):
            # this and every later placement are bounded at or above the best plan: pruned
            bounds.append(math.floor(lower_s / best[3].time_unit_s))
            break
        left = limit - (time.perf_counter() - start)
        if best is not None and left < 0.05:  # out of time: the rest keep their bounds (ranked)
            bounds.append(math.floor(lower_s / best[3].time_unit_s))
            statuses.append("SKIPPED")
            break
        cap_s = incumbent_s
        if best is not None:
            cap_s = best[0].step_time_s if cap_s is None else min(cap_s, best[0].step_time_s)
        # the most promising placements come first and get the larger share
        each = max(left / (len(ranked) - i), min(max(left, 0.05), limit / 4))
        model, plans = _hinted_model(problem, cluster, placement, c, config=config, incumbent_s=cap_s,
                                     hints=placement)
        unit, mem_unit = model.time_unit_s, model.mem_unit
        result = model.solve(each)
        statuses.append(result.status)
        found = []
        if result.stage_of_region is not None:  # CP-SAT's bound or the placement's own, the larger
            bounds.append(max(result.bound, math.floor(lower_s / unit)))
            found.append((result.stage_of_region, result.recompute, result.objective, result.rounding_slack_units))
        elif result.status == "INFEASIBLE":
            # nothing on this placement beats the cap (or fits memory, without one)
            bounds.append(math.inf if cap_s is None else math.floor((cap_s + model.max_rounding_s()) / unit) + 1)
        else:  # time limit without a solution: the placement's own bound stands
            bounds.append(math.floor(lower_s / unit))
        if result.status != "OPTIMAL":  # a hint may still be the best plan found on it
            for stage_of_region, recompute in plans:
                values = model.hint_values(stage_of_region, recompute)
                if model.memory_fits(values, model.classes):
                    found.append((stage_of_region, recompute, model.objective.value(values),
                                  model._rounding_slack(stage_of_region, recompute)))
        for stage_of_region, recompute, objective, slack in found:
            assignment = c.assignment(stage_of_region, recompute, placement)
            cost = evaluate(problem, cluster, assignment)
            if cost.fits_memory and (best is None or cost.step_time_s < best[0].step_time_s):
                best = (cost, assignment, objective, model, slack)
    elapsed = time.perf_counter() - start
    if best is None:
        status = "INFEASIBLE" if all(s == "INFEASIBLE" for s in statuses) else "UNKNOWN"
        return PlacedResult(status, None, None, None, None, unit or 1e-6, mem_unit or 1, 0.0, True, elapsed,
                            len(placements))
    cost, assignment, objective, model, slack = best
    bound = min(bounds)
    bound = objective if math.isinf(bound) else int(bound)
    bound = _within_rounding(bound, objective, model)
    status = "OPTIMAL" if objective <= bound else "FEASIBLE"
    return PlacedResult(status, assignment, cost, objective, bound, unit, mem_unit, slack,
                        model.exact_links, elapsed, len(placements))


def _within_rounding(bound: int, objective: int, model) -> int:
    """A bound from another model or from floats (a placement's, the relaxation's) is exact only
    to the rounding of Note [ILP scaling]: it may pass a plan's rounded objective by at most that
    rounding, and is then the objective; by more, it is a bug (Note [no clamped bound])."""
    if bound <= objective:
        return bound
    if (bound - objective) * model.time_unit_s > model.max_rounding_s():
        raise InconsistentBoundError(objective, bound, float(bound), "combined over placements")
    return objective


def placement_bound_s(problem, cluster, placement, c: Candidate, *, allow_recompute, chain) -> float:
    """A lower bound on every plan on ``placement`` (inf: none fits memory): the chain DP's bound
    when every plan is contiguous (its links and devices are the placement's), else perfectly
    divisible work on its devices; plus the all-reduce's bound; times its core-sharing factor.
    A schedule with a bound of its own (interleaved: the chain DP prices 1F1B/GPipe only) uses it."""
    p, d, m, b = c.p, c.d, c.m, c.b
    own = c.pipeline_schedule.lower_bound_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                            microbatch_size=b, allow_recompute=allow_recompute)
    if own is not None:
        return own
    scale = core_sharing_factor(cluster, placement)
    if chain:
        pipeline = chain_lower_bound_s(problem, cluster, num_stages=p, num_microbatches=m, microbatch_size=b,
                                       schedule=c.schedule, placement=placement, allow_recompute=allow_recompute)
    else:
        pipeline = scale * lower_bound_step_time_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                                   microbatch_size=b, stage_devices=[row[0] for row in placement])
    return pipeline + scale * allreduce_lower_bound_s(problem, cluster, num_stages=p, dp=d)


def solve_relaxed(problem, cluster, c: Candidate, *, config, time_limit_s, incumbent_s,
                  time_unit_s=None) -> PlacedResult:
    """The class-choice model with the fastest links (Note [heterogeneous devices] in model.py):
    its bound holds for every placement; its plan, and every hint, placed by ``place_stages``
    and costed by ``evaluate``; the cheapest fitting one is kept, with its exact cost as objective.
    OPTIMAL only when that exact cost reaches the relaxation's bound."""
    start = time.perf_counter()
    if time_unit_s is not None:
        config = replace(config, time_unit_s=time_unit_s)
    model = _model(problem, cluster, c, config)
    hint_placement = place_stages(cluster, c.p, c.d, _fastest_stage_classes(model, c.p))
    plans = []
    if config.use_hint:
        plans = _hint_plans(model, problem, cluster, c, placement=hint_placement)
    _hint_and_cap(model, plans, cluster, hint_placement, incumbent_s)
    result = model.solve(time_limit_s)
    unit = model.time_unit_s
    options = []
    if result.stage_of_region is not None:
        options.append(c.assignment(result.stage_of_region, result.recompute,
                                    place_stages(cluster, c.p, c.d, list(result.stage_classes))))
    options += [c.assignment(s, r, hint_placement) for s, r in plans]
    best = None
    for assignment in options:
        if not is_launchable(cluster, assignment.device_of_stage_replica):  # Note [exact placements]
            continue
        cost = evaluate(problem, cluster, assignment)
        if cost.fits_memory and (best is None or cost.step_time_s < best[0].step_time_s):
            best = (cost, assignment)
    if result.stage_of_region is not None:
        bound = result.bound
    elif result.status == "INFEASIBLE":
        bound = (math.inf if incumbent_s is None
                 else math.floor((incumbent_s + model.max_rounding_s()) / unit) + 1)
    else:
        bound = 0
    elapsed = time.perf_counter() - start
    if best is None:
        return PlacedResult(result.status if result.status != "OPTIMAL" else "INFEASIBLE", None, None, None, None,
                            unit, model.mem_unit, 0.0, False, elapsed, 0)
    cost, assignment = best
    objective, slack = round(cost.step_time_s / unit), 1.0
    if model.exact_links:  # one node: the plan's objective in the model's own rounding, as its bound's
        classes = [cluster.devices[row[0]].device_class for row in assignment.device_of_stage_replica]
        values = model.hint_values(assignment.stage_of_region, assignment.recompute, classes)
        objective = model.objective.value(values)
        slack = model._rounding_slack(assignment.stage_of_region, assignment.recompute)
    bound = objective if math.isinf(bound) else int(bound)
    bound = _within_rounding(bound, objective, model)
    status = "OPTIMAL" if objective <= bound else "FEASIBLE"
    return PlacedResult(status, assignment, cost, objective, bound, unit, model.mem_unit, slack, True, elapsed, 0)


def _hint_plans(model: CandidateModel, problem, cluster, c: Candidate, *, placement):
    """(stage_of_region, recompute) of the baselines and the chain DP (no/all recompute); a pinned
    recompute is every plan's (Note [recompute a user pins] in recompute_cost.py): a hint is also a
    plan kept when CP-SAT stops early, so it must obey the pin."""
    p, m, b = c.p, c.m, c.b
    pinned = pinned_recompute(problem, model.config.recompute)
    plans: list[tuple[tuple[int, ...], tuple[bool, ...]]] = []
    for a in baseline_assignments(problem, num_stages=p, dp=c.d, num_microbatches=m, microbatch_size=b,
                                  schedule=c.schedule, placement=placement).values():
        plans.append((a.stage_of_region, a.recompute if pinned is None else pinned))
    recompute_options: list = [(False,) * problem.num_regions if pinned is None else pinned]
    if model.rec and pinned is None:
        recompute_options.append(tuple(any((r, s) in model.rec for s in range(p)) for r in range(problem.num_regions)))
        recompute_options.append("greedy")
    for recompute in recompute_options:
        # interleaved: the 1F1B split of the same stages is a hint only (the model checks memory per rank)
        dp_result = solve_chain_dp(problem, cluster, num_stages=p, num_microbatches=m, microbatch_size=b,
                                   schedule=c.pipeline_schedule.chain_hint().name,
                                   placement=placement, recompute=recompute, max_caps=100)
        if dp_result is not None:
            plans.append((dp_result.stage_of_region, dp_result.assignment.recompute))
    return plans


def _best_hint(model: CandidateModel, plans, cluster, placement):
    """The hint plan of smallest model objective that fits memory, as model variable values, or None."""
    stage_classes = [cluster.devices[row[0]].device_class for row in placement]
    best = None
    for stage_of_region, recompute in plans:
        values = model.hint_values(stage_of_region, recompute, stage_classes)
        if not model.memory_fits(values, stage_classes):
            continue
        objective = model.objective.value(values)
        if best is None or objective < best[0]:
            best = (objective, values)
    return None if best is None else best[1]


def _fastest_stage_classes(model: CandidateModel, p: int) -> list[tuple]:
    slots = [c for c in model.classes for _ in range(model.class_slots[c])]  # fastest first
    return slots[:p]
