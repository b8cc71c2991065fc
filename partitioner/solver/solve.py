"""solve(): enumerate pipeline depth x data-parallel degree x microbatch count, solve each
candidate's CP-SAT model, keep the best plan, verify it.

Note [rank layout]
    rank = stage * dp + replica. A stage's data-parallel replicas are consecutive ranks, so the
    gradient all-reduce (the big, per-step traffic) stays inside a node whenever dp divides the
    node size, and pipeline neighbours (small, per-microbatch activations) are dp ranks apart
    (Megatron-LM's order with pipeline outermost). On a homogeneous cluster rank r runs on device
    r; on a heterogeneous one ``device_of_stage_replica[stage][replica]`` names the device.

Note [candidate pruning]
    Every candidate gets a cheap lower bound (check.candidate_lower_bound_s: fluid bubble +
    memory-forced recompute + all-reduce). Candidates are taken from a priority queue by their
    best known bound; a candidate popped with only the cheap bound gets the strong one first
    (chain_dp.chain_lower_bound_s: an exact DP over contiguous splits with fractional recompute,
    valid when every plan is contiguous, i.e. a chain backbone, on one device class) and goes
    back in the queue; one popped with its strong bound is solved by CP-SAT, capped at the
    incumbent. The loop stops when the smallest bound left reaches the incumbent's step time:
    every candidate not solved is then PRUNED by a bound, and the plan is the optimum over the
    enumerated space (to CP-SAT's own status). An infinite bound proves the candidate cannot fit
    memory (INFEASIBLE, no CP-SAT call).

    ``SolverConfig.total_time_limit_s`` caps the enumeration (a candidate's first CP-SAT pass gets
    time_limit_s / 4; one left at that limit is queued again by its bound for a capped pass of
    time_limit_s; never more than the time left). Candidates left when it runs out are SKIPPED; the Solution is
    then the best found, its ``status`` FEASIBLE and its ``bound`` the smallest proven bound over
    every candidate (CP-SAT's for the solved ones, ours for the rest), so the plan's gap states
    how far from the enumerated optimum it can be.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from partitioner.cluster import GIB, ClusterSpec
from partitioner.errors import PartitionInfeasibleError
from partitioner.solver.baselines import BaselineCost, baseline_assignments, evaluate_baselines
from partitioner.solver.bounds import (
    allreduce_lower_bound_s,
    candidate_lower_bound_s,
    core_sharing_lower_bound,
)
from partitioner.solver.chain_dp import chain_lower_bound_s, has_chain_backbone, solve_chain_dp
from partitioner.solver.check import check_assignment
from partitioner.solver.evaluate import StageCost, TieCost, evaluate
from partitioner.solver.model import CandidateModel, SolverConfig
from partitioner.solver.problem import SCHEDULES, Assignment, PartitionProblem, place_stages, schedule_refusal

__all__ = ["CandidateRecord", "Solution", "SolveProgress", "solve", "solve_candidate"]


@dataclass(frozen=True)
class CandidateRecord:
    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    status: str                 # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, PRUNED, SKIPPED
    step_time_s: float | None
    lower_bound_step_time_s: float
    solve_time_s: float


@dataclass(frozen=True)
class SolveProgress:
    """One update of solve()'s enumeration, handed to its ``progress`` callback; str() is a
    status line, ``candidate_line()`` the line of the candidate just finished (if any)."""

    done: int                        # candidates finished: solved, infeasible, skipped or pruned
    total: int
    incumbent_s: float | None        # the best plan's step time so far
    incumbent: tuple[int, int, int] | None  # its (stages, dp, microbatches)
    bound_s: float | None            # lower bound on the best step time over every candidate
    elapsed_s: float
    candidate: CandidateRecord | None = None
    finished: bool = False
    status: str | None = None        # the Solution's status, when finished

    def __str__(self) -> str:
        text = f"solve: {self.done}/{self.total} candidates"
        if self.incumbent_s is not None:
            p, d, m = self.incumbent
            text += f", best {self.incumbent_s * 1e3:.4g} ms ({p} stage{'s' * (p > 1)} x dp {d}, {m} microbatch" \
                    f"{'es' * (m > 1)})"
        if self.bound_s is not None and math.isfinite(self.bound_s):
            text += f", bound {self.bound_s * 1e3:.4g} ms"
        if self.incumbent_s and self.bound_s is not None and math.isfinite(self.bound_s):
            text += f" (gap {max(0.0, 1 - self.bound_s / self.incumbent_s):.1%})"
        return text + (f", {self.status}" if self.finished and self.status else "")

    def candidate_line(self) -> str | None:
        r = self.candidate
        if r is None:
            return None
        time_s = "-" if r.step_time_s is None else f"{r.step_time_s * 1e3:.4g} ms"
        return (f"candidate {r.num_stages} stage{'s' * (r.num_stages > 1)} x dp {r.dp}, {r.num_microbatches} "
                f"microbatch{'es' * (r.num_microbatches > 1)} of "
                f"{r.microbatch_size}: {r.status}, step {time_s}, bound {r.lower_bound_step_time_s * 1e3:.4g} ms, "
                f"{r.solve_time_s:.2f} s")


@dataclass(frozen=True)
class Solution:
    """The chosen plan and every figure it was chosen by (Note [rank layout] for devices)."""

    stage_of_region: tuple[int, ...]
    recompute: tuple[bool, ...]
    device_of_stage_replica: tuple[tuple[int, ...], ...]
    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    schedule: str
    global_batch: int
    # predicted, recomputed in floats by check.evaluate
    stages: tuple[StageCost, ...]
    step_time_s: float
    bubble_fraction: float
    lower_bound_step_time_s: float
    ties: tuple[TieCost, ...]
    # solver
    status: str
    objective: int | None        # in time units (time_unit_s)
    bound: int | None
    solve_time_s: float
    time_unit_s: float
    memory_unit_bytes: int
    rounding_slack_units: float
    exact_links: bool
    baselines: Mapping[str, float] = field(default_factory=dict, compare=False)  # name -> step_time_s
    baseline_details: Mapping[str, BaselineCost] = field(default_factory=dict, compare=False)
    candidates: tuple[CandidateRecord, ...] = ()

    @property
    def assignment(self) -> Assignment:
        return Assignment(
            stage_of_region=self.stage_of_region,
            recompute=self.recompute,
            device_of_stage_replica=self.device_of_stage_replica,
            num_stages=self.num_stages,
            dp=self.dp,
            num_microbatches=self.num_microbatches,
            microbatch_size=self.microbatch_size,
            schedule=self.schedule,
        )

    @property
    def num_ranks(self) -> int:
        return self.num_stages * self.dp

    def rank_of(self, stage: int, replica: int) -> int:
        return stage * self.dp + replica

    def stage_replica_of_rank(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.dp)

    def device_of_rank(self, rank: int) -> int:
        stage, replica = divmod(rank, self.dp)
        return self.device_of_stage_replica[stage][replica]

    def summary(self) -> str:
        lines = [
            f"{self.num_stages} stages x dp {self.dp}, {self.num_microbatches} microbatches of "
            f"{self.microbatch_size}, {self.schedule}: step {self.step_time_s:.6g} s "
            f"(lower bound {self.lower_bound_step_time_s:.6g} s, bubble {self.bubble_fraction:.1%}), "
            f"solver {self.status} in {self.solve_time_s:.2f} s",
            f"{'stage':>5} {'ranks':>12} {'regions':>9} {'compute_s':>11} {'comm_s':>10} {'mem_GiB':>8} {'cap_GiB':>8}",
        ]
        for s, st in enumerate(self.stages):
            ranks = f"{self.rank_of(s, 0)}..{self.rank_of(s, self.dp - 1)}"
            lines.append(f"{s:>5} {ranks:>12} {len(st.regions):>9} {st.compute_s:>11.4g} {st.comm_s:>10.3g} "
                         f"{st.memory_bytes / GIB:>8.3f} {st.capacity_bytes / GIB:>8.2f}")
        for name, base in self.baseline_details.items():
            lines.append(f"baseline {name}: {base.step_time_s:.6g} s{'' if base.fits_memory else ' (does not fit memory)'}")
        return "\n".join(lines)


def _hint_plans(model: CandidateModel, problem, cluster, *, p, d, m, b, schedule, placement):
    """(stage_of_region, recompute) of the baselines and the chain DP (no/all recompute)."""
    plans: list[tuple[tuple[int, ...], tuple[bool, ...]]] = []
    for a in baseline_assignments(problem, num_stages=p, dp=d, num_microbatches=m, microbatch_size=b,
                                  schedule=schedule, placement=placement).values():
        plans.append((a.stage_of_region, a.recompute))
    recompute_options: list = [(False,) * problem.num_regions]
    if model.rec:
        recompute_options.append(tuple(any((r, s) in model.rec for s in range(p)) for r in range(problem.num_regions)))
        recompute_options.append("greedy")
    for recompute in recompute_options:
        dp_result = solve_chain_dp(problem, cluster, num_stages=p, num_microbatches=m, microbatch_size=b,
                                   schedule=schedule, placement=placement, recompute=recompute, max_caps=100)
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


def solve_candidate(
    problem: PartitionProblem,
    cluster: ClusterSpec,
    *,
    num_stages: int,
    dp: int,
    num_microbatches: int,
    global_batch: int,
    schedule: str = "1f1b",
    config: SolverConfig = SolverConfig(),
    time_limit_s: float | None = None,
    incumbent_s: float | None = None,
) -> tuple[Solution | None, str, float]:
    """Solve one (p, d, m): (verified Solution or None, solver status, solve seconds).

    ``incumbent_s``: a plan of that step time is already known; the model then only looks for
    plans whose objective can be below it (INFEASIBLE then means: cannot beat it)."""
    p, d, m = num_stages, dp, num_microbatches
    b = global_batch // (d * m)
    homogeneous = cluster.is_homogeneous
    placement = place_stages(cluster, p, d) if homogeneous else None
    model = CandidateModel(problem, cluster, num_stages=p, dp=d, num_microbatches=m, microbatch_size=b,
                           schedule=schedule, config=config, placement=placement)
    plans: list = []
    # Hints on a heterogeneous cluster use the fastest class slots, in stage order.
    hint_placement = placement or place_stages(cluster, p, d, _fastest_stage_classes(model, p))
    if config.use_hint:
        plans = _hint_plans(model, problem, cluster, p=p, d=d, m=m, b=b, schedule=schedule,
                            placement=hint_placement)
        values = _best_hint(model, plans, cluster, hint_placement)
        if values is not None:
            model.add_hint(values)
    if incumbent_s is not None:
        # objective <= incumbent + the rounding any plan's objective may carry (Note [ILP scaling])
        model.cap_objective(math.floor((incumbent_s + model.max_rounding_s()) / model.time_unit_s))
    result = model.solve(time_limit_s)
    status, objective, bound = result.status, result.objective, result.bound
    assignment = cost = None
    if result.stage_of_region is not None:
        assignment = Assignment(
            stage_of_region=result.stage_of_region, recompute=result.recompute,
            device_of_stage_replica=placement or place_stages(cluster, p, d, list(result.stage_classes)),
            num_stages=p, dp=d, num_microbatches=m, microbatch_size=b, schedule=schedule,
        )
        cost = evaluate(problem, cluster, assignment)
    if not model.exact_links:
        # The model prices every boundary with the slowest link (Note [heterogeneous devices]), so
        # a hint may cost less than the model's optimum once its real links are known: keep the
        # cheaper plan in exact figures (a FEASIBLE plan, with no objective to check against).
        for stage_of_region, recompute in plans:
            hint = Assignment(stage_of_region=stage_of_region, recompute=recompute,
                              device_of_stage_replica=hint_placement, num_stages=p, dp=d, num_microbatches=m,
                              microbatch_size=b, schedule=schedule)
            hint_cost = evaluate(problem, cluster, hint)
            if hint_cost.fits_memory and (cost is None or hint_cost.step_time_s < cost.step_time_s):
                assignment, cost, status, objective = hint, hint_cost, "FEASIBLE", None
                bound = bound if bound is not None else 0
    if assignment is None:
        return None, result.status, result.solve_time_s
    placement = assignment.device_of_stage_replica
    solution = Solution(
        stage_of_region=assignment.stage_of_region,
        recompute=assignment.recompute,
        device_of_stage_replica=placement,
        num_stages=p, dp=d, num_microbatches=m, microbatch_size=b, schedule=schedule, global_batch=global_batch,
        stages=cost.stages,
        step_time_s=cost.step_time_s,
        bubble_fraction=cost.bubble_fraction,
        lower_bound_step_time_s=cost.lower_bound_step_time_s,
        ties=cost.ties,
        status=status,
        objective=objective,
        bound=bound,
        solve_time_s=result.solve_time_s,
        time_unit_s=model.time_unit_s,
        memory_unit_bytes=model.mem_unit,
        rounding_slack_units=result.rounding_slack_units,
        exact_links=model.exact_links,
    )
    check_assignment(problem, cluster, solution)  # raises AssignmentError on any violation
    return solution, status, result.solve_time_s


def _fastest_stage_classes(model: CandidateModel, p: int) -> list[tuple]:
    slots = [c for c in model.classes for _ in range(model.class_slots[c])]  # fastest first
    return slots[:p]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _candidates(problem, cluster, global_batch, num_stages, dp, microbatches, config, schedule="1f1b"):
    """Every (stages, dp, microbatches) the devices, the batch and the schedule admit (Note [only
    runnable plans] in problem.py)."""
    num_devices, n = cluster.num_devices, problem.num_regions
    class_counts: dict[tuple, int] = {}
    for device in cluster.devices:
        class_counts[device.device_class] = class_counts.get(device.device_class, 0) + 1
    stage_options = [num_stages] if num_stages is not None else range(1, min(num_devices, n) + 1)
    out = []
    for p in stage_options:
        dp_options = [dp] if dp is not None else range(1, num_devices // p + 1)
        for d in dp_options:
            if global_batch % d or sum(k // d for k in class_counts.values()) < p:
                continue
            m_options = [microbatches] if microbatches is not None else _divisors(global_batch // d)
            for m in m_options:
                if global_batch % (d * m):
                    continue
                if microbatches is None and config.max_microbatches is not None and m > config.max_microbatches:
                    continue
                if schedule_refusal(schedule, p, m) is not None:
                    continue
                out.append((p, d, m))
    return out


def _validate_request(problem, cluster, global_batch, num_stages, dp, microbatches, schedule):
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be an int >= 1")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not supported by the solver; use one of {SCHEDULES}")
    for name, value in (("num_stages", num_stages), ("dp", dp), ("microbatches", microbatches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1 or None (let the solver choose)")
    if num_stages is not None and num_stages > problem.num_regions:
        raise ValueError(f"num_stages={num_stages} exceeds the model's {problem.num_regions} regions; "
                         "use fewer stages or finer regions")
    if num_stages is not None and dp is not None and num_stages * dp > cluster.num_devices:
        raise ValueError(f"num_stages * dp = {num_stages} * {dp} = {num_stages * dp} exceeds the cluster's "
                         f"{cluster.num_devices} devices; lower one of them or add devices")
    if dp is not None and microbatches is not None and global_batch % (dp * microbatches):
        raise ValueError(f"global_batch={global_batch} is not divisible by dp * microbatches = "
                         f"{dp} * {microbatches}; choose values whose product divides it")
    if num_stages is not None and microbatches is not None and schedule in SCHEDULES:
        refusal = schedule_refusal(schedule, num_stages, microbatches)
        if refusal is not None:
            raise ValueError(f"{refusal}: use --microbatches {num_stages} or more, fewer stages, "
                             "or --schedule gpipe")


def solve(
    problem: PartitionProblem,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    num_stages: int | None = None,
    dp: int | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    config: SolverConfig | None = None,
    progress: Callable[[SolveProgress], None] | None = None,
) -> Solution:
    """The best verified plan over every (p, d, m) with p·d <= devices and d·m | global_batch
    (an argument given fixes it). Raises PartitionInfeasibleError when nothing fits memory.

    ``progress(SolveProgress)``, if given, hears of the start, of every candidate finished (with
    the incumbent and the bound so far) and of the end; it does not change the result."""
    config = config if config is not None else SolverConfig()
    _validate_request(problem, cluster, global_batch, num_stages, dp, microbatches, schedule)
    candidates = _candidates(problem, cluster, global_batch, num_stages, dp, microbatches, config, schedule)
    if not candidates:
        raise ValueError(f"no (stages, dp, microbatches) combination fits {cluster.num_devices} devices and "
                         f"global_batch={global_batch} with the given num_stages={num_stages}, dp={dp}, "
                         f"microbatches={microbatches} under schedule {schedule} (which needs microbatches >= "
                         "stages for 1f1b): raise the global batch, fix fewer stages, or use --schedule gpipe")
    homogeneous = cluster.is_homogeneous
    chain = has_chain_backbone(problem)

    def cheap_bound(p, d, m):
        return candidate_lower_bound_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                       microbatch_size=global_batch // (d * m), schedule=schedule,
                                       allow_recompute=config.allow_recompute)

    def strong_bound(p, d, m, cheap):
        if not (homogeneous and chain) or not math.isfinite(cheap):
            return cheap
        b = global_batch // (d * m)
        pipeline = chain_lower_bound_s(problem, cluster, num_stages=p, num_microbatches=m, microbatch_size=b,
                                       schedule=schedule, placement=place_stages(cluster, p, d),
                                       allow_recompute=config.allow_recompute)
        allreduce = allreduce_lower_bound_s(problem, cluster, num_stages=p, dp=d)
        return max(cheap, pipeline + allreduce * core_sharing_lower_bound(cluster, num_stages=p, dp=d))

    # (bound, strong?, p, d, m, tries); Note [candidate pruning]
    queue = [(cheap_bound(p, d, m), False, p, d, m, 0) for p, d, m in candidates]
    heapq.heapify(queue)
    start = time.perf_counter()
    deadline = None if config.total_time_limit_s is None else start + config.total_time_limit_s
    best: Solution | None = None
    records: list[CandidateRecord] = []
    proven: list[float] = []  # lower bounds (s) of candidates left open (SKIPPED, time limit)
    unresolved: dict[tuple[int, int, int], float] = {}  # solved at the time limit: its bound (s)
    done: set[tuple[int, int, int]] = set()

    def report(record: CandidateRecord | None = None, *, finished: bool = False, status=None, bound_s=None) -> None:
        if progress is None:
            return
        if bound_s is None:
            open_bounds = [queue[0][0]] if queue else []
            open_bounds += list(unresolved.values()) + ([best.step_time_s] if best is not None else [])
            bound_s = min(open_bounds) if open_bounds else None
        progress(SolveProgress(
            done=len(candidates) if finished else len(done), total=len(candidates),
            incumbent_s=None if best is None else best.step_time_s,
            incumbent=None if best is None else (best.num_stages, best.dp, best.num_microbatches),
            bound_s=bound_s, elapsed_s=time.perf_counter() - start, candidate=record, finished=finished,
            status=status))

    report()
    while queue:
        lower, strong, p, d, m, tries = queue[0]
        b = global_batch // (d * m)
        if best is not None and lower >= best.step_time_s * (1 - 1e-9):
            break  # every bound left is at least the incumbent: all PRUNED below
        heapq.heappop(queue)
        if not math.isfinite(lower):  # cannot fit memory even fractionally
            records.append(CandidateRecord(p, d, m, b, "INFEASIBLE", None, lower, 0.0))
            done.add((p, d, m))
            report(records[-1])
            continue
        if not strong:
            heapq.heappush(queue, (strong_bound(p, d, m, lower), True, p, d, m, 0))
            continue
        left = None if deadline is None else deadline - time.perf_counter()
        if best is not None and left is not None and left < 0.2:
            records.append(CandidateRecord(p, d, m, b, "SKIPPED", None, lower, 0.0))
            proven.append(lower)
            done.add((p, d, m))
            report(records[-1])
            continue
        # A first pass gets a quarter of time_limit_s (an incumbent early prunes the most); a
        # candidate left at that limit is queued again by its bound for the full limit.
        limit = config.time_limit_s / 4 if tries == 0 else config.time_limit_s
        limit = limit if left is None or best is None else min(limit, left)
        solution, status, seconds = solve_candidate(
            problem, cluster, num_stages=p, dp=d, num_microbatches=m, global_batch=global_batch,
            schedule=schedule, config=config, time_limit_s=limit,
            incumbent_s=None if best is None else best.step_time_s)
        records.append(CandidateRecord(p, d, m, b, status, solution.step_time_s if solution else None, lower, seconds))
        unresolved.pop((p, d, m), None)
        if status in ("FEASIBLE", "UNKNOWN"):  # time limit: it may still hold a better plan
            bound = max(lower, solution.bound * solution.time_unit_s if solution is not None else lower)
            unresolved[(p, d, m)] = bound
            if tries == 0:  # once more, later, capped at the incumbent then
                heapq.heappush(queue, (bound, True, p, d, m, 1))
        if not (tries == 0 and status in ("FEASIBLE", "UNKNOWN")):
            done.add((p, d, m))
        if solution is not None and (best is None or solution.step_time_s < best.step_time_s):
            best = solution
        report(records[-1])
    proven.extend(bound for key, bound in unresolved.items() if key != (best.num_stages, best.dp, best.num_microbatches)
                  if best is not None)
    for lower, _, p, d, m, _ in queue:
        if (p, d, m) not in unresolved:
            records.append(CandidateRecord(p, d, m, global_batch // (d * m), "PRUNED", None, lower, 0.0))
    if best is None:
        _raise_infeasible(problem, cluster, global_batch, records, schedule, config)
    baselines = evaluate_baselines(problem, cluster, num_stages=best.num_stages, dp=best.dp,
                                   num_microbatches=best.num_microbatches, microbatch_size=best.microbatch_size,
                                   schedule=schedule, placement=best.device_of_stage_replica)
    status, bound = best.status, best.bound
    slack_s = best.rounding_slack_units * best.time_unit_s
    open_bounds = [x for x in proven if x < best.step_time_s - slack_s]
    if open_bounds:  # best found; the enumerated optimum may be as low as the smallest open bound
        status = "FEASIBLE"
        bound = min(bound, max(0, math.floor(min(open_bounds) / best.time_unit_s)))
    report(finished=True, status=status,
           bound_s=best.step_time_s * bound / best.objective if best.objective else best.step_time_s)
    return replace(best, baselines={name: cost.step_time_s for name, cost in baselines.items()},
                   baseline_details=baselines, candidates=tuple(records), status=status, bound=bound,
                   solve_time_s=time.perf_counter() - start)


def _raise_infeasible(problem, cluster, global_batch, records, schedule, config) -> None:
    """Find, among the failed candidates, the plan that overflows memory least, and say so."""
    unknown = [r for r in records if r.status == "UNKNOWN"]
    failed = [r for r in records if r.status == "INFEASIBLE"]
    if not failed:
        raise PartitionInfeasibleError(
            f"no plan found within time_limit_s={config.time_limit_s} for any of {len(unknown)} candidates; "
            "raise SolverConfig.time_limit_s or fix num_stages/dp/microbatches")

    def rough_memory(r: CandidateRecord) -> float:  # per-stage memory if everything divided evenly
        in_flight = r.num_microbatches if schedule == "gpipe" else min(r.num_stages, r.num_microbatches)
        static = sum(x.static_bytes for x in problem.regions)
        saved = sum(x.recompute_activation_bytes_per_sample if config.allow_recompute else x.activation_bytes_per_sample
                    for x in problem.regions)
        return (static + in_flight * r.microbatch_size * saved) / r.num_stages

    tightest = None
    for r in sorted(failed, key=rough_memory)[:4]:
        placement = place_stages(cluster, r.num_stages, r.dp) if cluster.is_homogeneous else None
        model = CandidateModel(problem, cluster, num_stages=r.num_stages, dp=r.dp, num_microbatches=r.num_microbatches,
                               microbatch_size=r.microbatch_size, schedule=schedule, config=config,
                               placement=placement, minimize_memory=True)
        result = model.solve(time_limit_s=min(config.time_limit_s, 5.0))
        if result.stage_of_region is None:
            continue
        placement = placement or place_stages(cluster, r.num_stages, r.dp, list(result.stage_classes))
        cost = evaluate(problem, cluster, Assignment(
            result.stage_of_region, result.recompute, placement, r.num_stages, r.dp, r.num_microbatches,
            r.microbatch_size, schedule))
        s, stage = max(enumerate(cost.stages), key=lambda item: item[1].memory_bytes / item[1].capacity_bytes)
        ratio = stage.memory_bytes / stage.capacity_bytes
        if tightest is None or ratio < tightest[0]:
            tightest = (ratio, r, s, stage, any(result.recompute))
    largest = max(d.usable_memory_bytes for d in cluster.devices) / GIB  # Note [usable memory] in cluster.py
    if tightest is None:
        raise PartitionInfeasibleError(
            f"no partition fits in memory on any of {len(failed)} candidates (largest device {largest:.1f} GiB): "
            "add devices, enable recompute, or lower the microbatch size")
    _, r, s, stage, used_recompute = tightest
    raise PartitionInfeasibleError(
        f"no partition fits in memory: the tightest plan found (num_stages={r.num_stages}, dp={r.dp}, "
        f"microbatches={r.num_microbatches}, microbatch_size={r.microbatch_size}, {schedule}"
        f"{', recompute on' if used_recompute else ''}) needs {stage.memory_bytes / GIB:.2f} GiB on stage {s}, "
        f"whose device holds {stage.capacity_bytes / GIB:.2f} GiB usable; the largest device has {largest:.2f} GiB usable: "
        "add devices, enable recompute, or lower the microbatch size"
    )
