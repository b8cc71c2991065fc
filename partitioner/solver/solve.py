"""solve(): enumerate pipeline depth x data-parallel degree x microbatch count (candidates.py)
times each variant of the problem (tensor-parallel degree, sharded optimizer state: space.py,
Note [one enumeration]), solve each candidate's CP-SAT model in order of its lower bound, keep
the best plan, verify it.

Note [candidate pruning]
    Every candidate gets a cheap lower bound (bounds.py); candidates leave a priority queue by
    their best known bound, a candidate with only the cheap one gets the strong one first (the
    chain DP's, chain_dp.chain_lower_bound_s) and goes back, and one with its strong bound is
    solved by CP-SAT, capped at the incumbent. When the smallest bound left reaches the incumbent,
    every candidate not solved is PRUNED and the plan is the optimum over the enumerated space;
    an infinite bound proves a candidate cannot fit (INFEASIBLE, no CP-SAT call).
    ``total_time_limit_s`` caps the enumeration (a first pass gets time_limit_s / 4, one left at
    it is queued again for a full one). Candidates left when it runs out are SKIPPED and the
    Solution is FEASIBLE with the smallest proven bound over every candidate, so the gap says how
    far from the optimum it can be. A candidate at its time limit without a plan keeps its bound
    open: the result is FEASIBLE, and when no plan was found at all the error says it was a time
    limit (``PartitionInfeasibleError.timed_out``), not a proof about memory.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import replace
from typing import Callable

from partitioner.config.cluster import GIB, ClusterSpec
from partitioner.errors import PartitionInfeasibleError
from partitioner.solver.bounds import (
    allreduce_lower_bound_s,
    candidate_lower_bound_s,
    core_sharing_lower_bound,
)
from partitioner.solver.candidates import enumerate_candidates, solve_candidate, validate_request
from partitioner.solver.chain_dp import chain_lower_bound_s, has_chain_backbone
from partitioner.solver.evaluate import evaluate
from partitioner.solver.fair_baselines import best_baselines
from partitioner.solver.model import CandidateModel, InconsistentBoundError, SolverConfig
from partitioner.solver.problem import Assignment, PartitionProblem
from partitioner.solver.recompute_cost import pinned_recompute, saves_memory
from partitioner.solver.device_layout import place_stages
from partitioner.solver.schedule_choice import solve_any_local_stages, solve_any_schedule
from partitioner.solver.schedules import priced_schedule, requested_schedule
from partitioner.solver.solution import CandidateRecord, Solution, SolveProgress
from partitioner.solver.space import SearchSpace, StepTerms, Variant

__all__ = ["CandidateRecord", "Solution", "SolveProgress", "SolverConfig", "solve", "solve_candidate",
           "solve_with_sharding"]


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
    shard: str = "off",
    tp_degrees: tuple[int, ...] = (1,),
    tp_dp: bool = True,
    tp_shard: bool | None = None,
    step_terms: "StepTerms | None" = None,
) -> Solution:
    """The best verified plan over every (p, d, m) with p·d <= devices and d·m | global_batch
    (an argument given fixes it), times every variant (Note [one enumeration] in space.py):
    ``shard`` "off" | "on" | "auto" (optimizer state sharding, Note [sharding as a candidate]) and
    the tensor-parallel degrees ``tp_degrees`` (``tp_dp``: whether tp > 1 may have d > 1;
    ``tp_shard``: whether it may have sharded state, default ``tp_dp``). The
    Solution's ``tensor_parallel`` and ``shard_optimizer`` say which variant won; its figures
    are of that variant's problem and cluster (``SearchSpace.inputs``). Raises
    PartitionInfeasibleError when nothing fits memory.
    ``schedule="auto"`` weighs every priced schedule (Note [schedule choice] in schedule_choice.py).

    ``step_terms``: the per-step terms the program adds beside the ILP's objective (the global
    gradient norm, the replica check: Note [terms outside the ILP] in space.py), weighed when
    candidates are compared.
    ``progress(SolveProgress)``, if given, hears of the start, of every candidate finished (with
    the incumbent and the bound so far) and of the end; it does not change the result."""
    config = config if config is not None else SolverConfig()
    if requested_schedule(schedule) is None:  # auto: Note [schedule choice]
        return solve_any_schedule(solve, problem, cluster, global_batch, num_stages=num_stages, dp=dp,
                                  microbatches=microbatches, config=config, progress=progress, shard=shard,
                                  tp_degrees=tp_degrees, tp_dp=tp_dp, tp_shard=tp_shard, step_terms=step_terms)
    if priced_schedule(schedule).local_stage_options != (1,) and config.local_stages is None:  # Note [interleaved pricing]
        return solve_any_local_stages(solve, problem, cluster, global_batch, schedule=schedule, num_stages=num_stages, dp=dp,
                                      microbatches=microbatches, config=config, progress=progress, shard=shard,
                                      tp_degrees=tp_degrees, tp_dp=tp_dp, tp_shard=tp_shard, step_terms=step_terms)
    validate_request(problem, cluster, global_batch, num_stages, dp, microbatches, schedule)
    priced = priced_schedule(schedule, config.local_stages)  # Note [one class per schedule]
    local = priced.local_stages  # stages per rank
    space = SearchSpace(problem, cluster, tp_degrees=tp_degrees, shard=shard, tp_dp=tp_dp, tp_shard=tp_shard,
                        step_terms=step_terms)
    candidates = space.candidates(global_batch, num_stages, dp, microbatches, config, schedule)
    if not candidates:
        if shard == "on" and dp == 1:  # asked for both: say which two settings clash
            raise ValueError("shard_optimizer 'on' needs a plan with dp > 1, and dp=1 (--dp 1) was asked for: "
                             "there are no replicas to shard the optimizer state over; use --dp 2 or more, or "
                             "shard_optimizer 'auto' or 'off'")
        if shard == "on":
            raise ValueError("shard_optimizer 'on' needs a plan with dp > 1, and none fits this cluster and "
                             "global batch: allow more devices, or use shard_optimizer 'auto'")
        rule = ("which needs microbatches >= stages for 1f1b" if local == 1 else
                f"which puts {local} stages on each of at least 2 ranks, ranks x dp <= devices, microbatches a "
                "multiple of max(1, microbatches // ranks)")
        raise ValueError(f"no (stages, dp, microbatches) combination fits {cluster.num_devices} devices and "
                         f"global_batch={global_batch} with the given num_stages={num_stages}, dp={dp}, "
                         f"microbatches={microbatches} under schedule {schedule} ({rule}): raise the global "
                         "batch, fix fewer stages, or use --schedule gpipe")
    chain = has_chain_backbone(problem)

    def cheap_bound(p, d, m, v):
        prob, clus = space.inputs(v, d)
        return candidate_lower_bound_s(prob, clus, num_stages=p, dp=d, num_microbatches=m,
                                       microbatch_size=global_batch // (d * m), schedule=schedule,
                                       allow_recompute=config.allow_recompute, local_stages=local)

    def strong_bound(p, d, m, v, cheap):
        prob, clus = space.inputs(v, d)
        # interleaved: the chain DP prices 1F1B memory, no bound on it (Note [interleaved pricing])
        if not (clus.is_homogeneous and chain) or not math.isfinite(cheap) or not priced.chain_priced:
            return cheap
        b = global_batch // (d * m)
        pipeline = chain_lower_bound_s(prob, clus, num_stages=p, num_microbatches=m, microbatch_size=b,
                                       schedule=schedule, placement=place_stages(clus, p, d),
                                       allow_recompute=config.allow_recompute)
        allreduce = allreduce_lower_bound_s(prob, clus, num_stages=p, dp=d)
        return max(cheap, pipeline + allreduce * core_sharing_lower_bound(clus, num_stages=p, dp=d))

    # (bound, strong?, p, d, m, variant, tries); Note [candidate pruning]
    queue = [(cheap_bound(p, d, m, v), False, p, d, m, v, 0) for p, d, m, v in candidates]
    # the smallest cheap bound over the whole space (Note [whole-space lower bound])
    whole_space_lower_s = min(bound for bound, *_ in queue)
    heapq.heapify(queue)
    start = time.perf_counter()
    deadline = None if config.total_time_limit_s is None else start + config.total_time_limit_s
    best: Solution | None = None
    best_s = math.inf  # best's step time with what the ILP does not see (SearchSpace.extra_s)
    records: list[CandidateRecord] = []
    proven: list[float] = []  # lower bounds (s) of candidates left open (SKIPPED, time limit)
    unresolved: dict[tuple, float] = {}  # solved at the time limit: its bound (s)
    done: set[tuple] = set()

    def record(p, d, m, v, status, step_s, lower, seconds) -> CandidateRecord:
        return CandidateRecord(p, d, m, global_batch // (d * m), status, step_s, lower, seconds,
                               tensor_parallel=v.tp, shard_optimizer=v.sharded, local_stages=local)

    def report(rec: CandidateRecord | None = None, *, finished: bool = False, status=None, bound_s=None) -> None:
        if progress is None:
            return
        if bound_s is None:
            open_bounds = [queue[0][0]] if queue else []
            open_bounds += list(unresolved.values()) + ([best_s] if best is not None else [])
            bound_s = min(open_bounds) if open_bounds else None
        progress(SolveProgress(
            done=len(candidates) if finished else len(done), total=len(candidates),
            incumbent_s=None if best is None else best_s,
            incumbent=None if best is None else (best.num_stages, best.dp, best.num_microbatches),
            bound_s=bound_s, elapsed_s=time.perf_counter() - start, candidate=rec, finished=finished,
            status=status, incumbent_tp=1 if best is None else best.tensor_parallel))

    report()
    while queue:
        lower, strong, p, d, m, v, tries = queue[0]
        key = (p, d, m, v)
        if best is not None and lower >= best_s * (1 - 1e-9):
            break  # every bound left is at least the incumbent: all PRUNED below
        heapq.heappop(queue)
        if not math.isfinite(lower):  # cannot fit memory even fractionally
            records.append(record(p, d, m, v, "INFEASIBLE", None, lower, 0.0))
            done.add(key)
            report(records[-1])
            continue
        if not strong:
            heapq.heappush(queue, (strong_bound(p, d, m, v, lower), True, p, d, m, v, 0))
            continue
        left = None if deadline is None else deadline - time.perf_counter()
        if best is not None and left is not None and left < 0.2:
            records.append(record(p, d, m, v, "SKIPPED", None, lower, 0.0))
            proven.append(lower)
            done.add(key)
            report(records[-1])
            continue
        # A first pass gets a quarter of time_limit_s (an incumbent early prunes the most); a
        # candidate left at that limit is queued again by its bound for the full limit.
        limit = config.time_limit_s / 4 if tries == 0 else config.time_limit_s
        limit = limit if left is None or best is None else min(limit, left)
        prob, clus = space.inputs(v, d)
        solution, status, seconds = solve_candidate(
            prob, clus, num_stages=p, dp=d, num_microbatches=m, global_batch=global_batch,
            schedule=schedule, config=config, time_limit_s=limit,
            incumbent_s=None if best is None else best_s)
        total_s = None
        if solution is not None:
            solution = replace(solution, tensor_parallel=v.tp, shard_optimizer=v.sharded)
            total_s = solution.step_time_s + space.extra_s(v, solution.assignment)
        records.append(record(p, d, m, v, status, total_s, lower, seconds))
        unresolved.pop(key, None)
        if status in ("FEASIBLE", "UNKNOWN"):  # time limit: it may still hold a better plan
            bound = max(lower, solution.bound * solution.time_unit_s if solution is not None else lower)
            unresolved[key] = bound
            if tries == 0:  # once more, later, capped at the incumbent then
                heapq.heappush(queue, (bound, True, p, d, m, v, 1))
        if not (tries == 0 and status in ("FEASIBLE", "UNKNOWN")):
            done.add(key)
        # The same candidate solved again at the same step time replaces itself: its status and
        # bound are the newer, stronger ones (a second pass that proves OPTIMAL must say so).
        if solution is not None and (best is None or total_s < best_s
                                     or (total_s <= best_s and key == _key_of(best))):
            best, best_s = solution, total_s
        report(records[-1])
    if best is not None:
        proven.extend(bound for key, bound in unresolved.items() if key != _key_of(best))
    for lower, _, p, d, m, v, _ in queue:
        if (p, d, m, v) not in unresolved:
            records.append(record(p, d, m, v, "PRUNED", None, lower, 0.0))
    if best is None:
        _raise_infeasible(space, global_batch, records, schedule, config)
    pinned = pinned_recompute(problem, config.recompute)
    if pinned is not None and best.recompute != pinned:  # Note [recompute a user pins]: a bug, never a plan
        raise AssertionError(f"recompute {config.recompute!r} was pinned and the plan recomputes "
                             f"{best.recompute}, not {pinned}: please report it with the model")
    # a person's pipeline x data-parallel split (Note [fair baselines]) over the plan's own tensor
    # groups (at tp 1 on the same --tp N request it would leave (N - 1)/N of the devices idle)
    base_problem, base_cluster = space.grouped(best.tensor_parallel)
    baselines = best_baselines(base_problem, base_cluster,
                               baseline_candidates(base_problem, base_cluster, global_batch, num_stages, dp,
                                                   microbatches, config, schedule),
                               global_batch, schedule=schedule, recompute=config.recompute,
                               bound_of=_bounds_for_baselines(queue, records, space, best.tensor_parallel),
                               local_stages=local, step_terms=space.step_terms)
    status, bound = best.status, best.bound
    own = unresolved.get(_key_of(best))
    if own is not None and best.objective is not None:  # its cheap or strong bound may be the better one
        own_units = math.floor(own / best.time_unit_s)
        if own_units > best.objective + best.rounding_slack_units:  # Note [no clamped bound]
            raise InconsistentBoundError(best.objective, own_units, float(own_units), "candidate bound")
        bound = max(bound, min(own_units, best.objective))  # above it by the rounding only
    slack_s = best.rounding_slack_units * best.time_unit_s
    open_bounds = [x for x in proven if x < best_s - slack_s]
    if open_bounds:  # best found; the enumerated optimum may be as low as the smallest open bound
        status = "FEASIBLE"
        bound = min(bound, max(0, math.floor(min(open_bounds) / best.time_unit_s)))
    report(finished=True, status=status, bound_s=bound * best.time_unit_s)
    # never lowered to the plan's time; one above it is a bound bug (Note [whole-space lower bound])
    if whole_space_lower_s > best.step_time_s * (1 + 1e-9) + slack_s:
        raise InconsistentBoundError(best.objective or 0, math.ceil(whole_space_lower_s / best.time_unit_s),
                                     best.step_time_s / best.time_unit_s, "whole-space lower bound")
    winner = space.unsharded_if_it_fits(Variant(best.tensor_parallel, best.shard_optimizer), best.assignment)
    scope = optimality_scope(cluster, global_batch, num_stages, dp, microbatches, schedule, config, best)
    return replace(best, baselines={name: cost.step_time_s if cost.fits_memory else None
                                    for name, cost in baselines.items()},
                   baseline_details=baselines, candidates=tuple(records), status=status, bound=bound,
                   solve_time_s=time.perf_counter() - start, optimal_over=f"{scope}; {space.scope_words()}",
                   lower_bound_step_time_s=whole_space_lower_s,
                   shard_optimizer=winner.sharded, extra_step_s=best_s - best.step_time_s)


def solve_with_sharding(problem, cluster, global_batch: int, *, shard: str = "auto", dp: int | None = None,
                        tp_degrees=(1,), tp_dp: bool = True, tp_shard: bool | None = None,
                        **solve_kwargs):
    """(solution, its problem, its cluster, shard_optimizer) of the best plan over the unsharded
    space and, unless ``shard`` is "off", the sharded one per dp degree ("on": only sharded plans
    with dp > 1), times the tensor-parallel degrees ``tp_degrees``: one enumeration (Note [one
    enumeration] in space.py). The problem and cluster are the winning variant's (tensor groups
    as devices when ``solution.tensor_parallel`` > 1)."""
    solution = solve(problem, cluster, global_batch, dp=dp, shard=shard, tp_degrees=tuple(tp_degrees), tp_dp=tp_dp,
                     tp_shard=tp_shard,
                     **solve_kwargs)
    space = SearchSpace(problem, cluster, tp_degrees=tp_degrees, shard=shard, tp_dp=tp_dp, tp_shard=tp_shard)
    variant = Variant(solution.tensor_parallel, solution.shard_optimizer)
    used_problem, used_cluster = space.inputs(variant, solution.dp)
    return solution, used_problem, used_cluster, variant.sharded


def _key_of(solution: Solution) -> tuple:
    return (solution.num_stages, solution.dp, solution.num_microbatches,
            Variant(solution.tensor_parallel, solution.shard_optimizer))


def baseline_candidates(problem, cluster, global_batch, num_stages, dp, microbatches, config, schedule):
    """The (p, d, m) the baselines are priced over: every one the request allows on ``cluster`` (the
    plan's tensor groups as devices; Note [fair baselines]: a person's pipeline x data-parallel split)."""
    return enumerate_candidates(problem, cluster, global_batch, num_stages, dp, microbatches, config, schedule)


def _bounds_for_baselines(queue, records, space, tp: int = 1) -> dict:
    """(p, d, m) -> a lower bound on every unsharded plan of it at tensor-parallel degree ``tp``: its
    own candidate's bound, or its sharded candidate's where sharding relaxes it (Note [one enumeration])."""
    out: dict = {}
    items = [(r.num_stages, r.dp, r.num_microbatches, Variant(r.tensor_parallel, r.shard_optimizer),
              r.lower_bound_step_time_s) for r in records]
    items += [(p, d, m, v, lower) for lower, _, p, d, m, v, _ in queue]
    for p, d, m, v, lower in items:
        if v.tp != tp or (v.sharded and not space.sharding_relaxes(tp, d)):
            continue
        out[(p, d, m)] = max(out.get((p, d, m), 0.0), lower)
    return out


def optimality_scope(cluster, global_batch, num_stages, dp, microbatches, schedule, config, best) -> str:
    """What the plan's OPTIMAL is a proof over, in words (``partitioner inspect`` prints it).

    Note [honest optimality]: OPTIMAL is a proof over the cost model for the space the request
    allows, never over every plan a person could write, so the plan says which space: the region
    granularity (compiler.py adds it), each of stages, dp and microbatches fixed or searched (and
    the microbatch cap), the schedule, recompute, the rank layout (fixed on one device class,
    enumerated placements or their relaxation on mixed ones) and the integer units the ILP rounds
    to; the enumeration adds its tensor-parallel degrees and sharding (``Space.scope_words``).
    A reader who sees OPTIMAL without this would take it for more than was proved."""
    limit = f", at most {config.max_microbatches}" if config.max_microbatches is not None and microbatches is None else ""
    parts = [
        f"stages {num_stages} (fixed)" if num_stages is not None else "every stage count",
        f"dp {dp} (fixed)" if dp is not None else "every dp",
        (f"{microbatches} microbatches (fixed)" if microbatches is not None
         else f"microbatch counts dividing the per-replica batch of {global_batch}/dp{limit}"),
        priced_schedule(schedule, best.local_stages).words(),
        {"auto": "recompute per region, whole (selective: only by --recompute selective)",
         "none": "no recompute (pinned: --recompute none)",
         "full": "every region that saves memory recomputed (pinned: --recompute full)",
         "selective": "each attention core recomputed, no whole region (pinned: --recompute selective)"}[config.recompute],
    ]
    if cluster.is_homogeneous and best.local_stages > 1:
        parts.append(f"rank = {priced_schedule(schedule, best.local_stages).position_words()} * dp + replica "
                     "on the devices in cluster order")
    elif cluster.is_homogeneous:
        parts.append("rank = stage * dp + replica on the devices in cluster order")
    elif len({d.node for d in cluster.devices}) == 1:
        parts.append("a device class per stage (one node: every link the same)")
    else:
        parts.append(f"every placement of stages on devices (class and node; beyond {config.max_placements} "
                     "placements a fastest-link relaxation bounds them)")
    parts.append(f"time in integer units of {best.time_unit_s:.3g} s (coefficients rounded, "
                 f"<= {best.rounding_slack_units * best.time_unit_s:.3g} s on this plan), memory rounded up "
                 f"to {best.memory_unit_bytes} B")
    return "; ".join(parts)


# Note [whole-space lower bound]
#     The Solution's lower_bound_step_time_s is the smallest cheap bound over every candidate the
#     request allows (bounds.candidate_lower_bound_s: perfectly divisible work on the fastest
#     devices, memory-forced recompute, the data-parallel all-reduce, the core-sharing factor):
#     no plan of any allowed (stages, dp, microbatches) can beat it under the model, so "ours /
#     lower bound" is the gap to the best any plan could do. Ties are left at 0 (a colocated tie
#     costs no synchronisation); it is not the solver's proof (``bound``), which is much tighter.


def _raise_infeasible(space, global_batch, records, schedule, config) -> None:
    """Say why no plan came back: candidates left at the time limit (then it is no proof that
    nothing fits, whatever the others did), or the plan that overflows memory least."""
    last = {}  # a candidate solved twice (time limit, then again) ends with its second status
    for r in records:
        last[(r.num_stages, r.dp, r.num_microbatches, r.tensor_parallel, r.shard_optimizer)] = r
    unknown = [r for r in last.values() if r.status in ("UNKNOWN", "SKIPPED")]
    failed = [r for r in last.values() if r.status == "INFEASIBLE"]
    if unknown:
        memory = (f"; {len(failed)} other candidate(s) cannot fit memory" if failed else "")
        raise PartitionInfeasibleError(
            f"no plan found within time_limit_s={config.time_limit_s} (total_time_limit_s="
            f"{config.total_time_limit_s}) for {len(unknown)} candidate(s){memory}: this is a time limit, not a "
            "proof that no plan fits; raise SolverConfig.time_limit_s or fix num_stages/dp/microbatches",
            timed_out=True)
    if not failed:
        raise PartitionInfeasibleError("no candidate was solved: fix num_stages/dp/microbatches", timed_out=True)

    priced = priced_schedule(schedule, config.local_stages)
    local = priced.local_stages  # stages per rank

    def rough_memory(r: CandidateRecord) -> float:  # per-stage memory if everything divided evenly
        problem = space.inputs(Variant(r.tensor_parallel, r.shard_optimizer), r.dp)[0]
        in_flight = max(priced.in_flight(s, r.num_stages, r.num_microbatches) for s in range(r.num_stages))
        static = sum(x.static_bytes for x in problem.regions)
        saved = sum(x.recompute_activation_bytes_per_sample if config.allow_recompute else x.activation_bytes_per_sample
                    for x in problem.regions)
        return (static + in_flight * r.microbatch_size * saved) / r.num_stages

    tightest = None
    for r in sorted(failed, key=rough_memory)[:4]:
        problem, cluster = space.inputs(Variant(r.tensor_parallel, r.shard_optimizer), r.dp)
        placement = place_stages(cluster, r.num_stages, r.dp, local_stages=local,
                                 position_of=priced.position_of) if cluster.is_homogeneous else None
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
        terms = f" ({_terms_words(stage, r.tensor_parallel)})"
        where, needed, capacity = f"stage {s}{terms}", stage.memory_bytes, stage.capacity_bytes
        if cost.rank_memory_bytes:  # interleaved: a rank's stages together (Note [interleaved pricing])
            pos = max(range(len(cost.rank_memory_bytes)),
                      key=lambda i: cost.rank_memory_bytes[i] / cost.rank_capacity_bytes[i])
            where = f"the rank holding stages {list(range(pos, r.num_stages, len(cost.rank_memory_bytes)))}"
            needed, capacity = cost.rank_memory_bytes[pos], cost.rank_capacity_bytes[pos]
        ratio = needed / capacity
        if tightest is None or ratio < tightest[0]:
            tightest = (ratio, r, where, needed, capacity, any(result.recompute))
    largest = max(d.usable_memory_bytes for d in space.cluster.devices) / GIB  # Note [usable memory] in device_presets.py
    if tightest is None:
        raise PartitionInfeasibleError(
            f"no partition fits in memory on any of {len(failed)} candidates (largest device {largest:.1f} GiB)"
            f"{_even_split_words(space, min(failed, key=rough_memory), schedule, config, local)}: "
            f"add devices, {_enable_recompute(config)}or lower the microbatch size")
    _, r, where, needed, capacity, used_recompute = tightest
    raise PartitionInfeasibleError(
        f"no partition fits in memory: the tightest plan found (num_stages={r.num_stages}, dp={r.dp}, "
        f"microbatches={r.num_microbatches}, microbatch_size={r.microbatch_size}, {schedule}"
        f"{f', tp {r.tensor_parallel}' if r.tensor_parallel > 1 else ''}"
        f"{', sharded optimizer state' if r.shard_optimizer else ''}"
        f"{', recompute on' if used_recompute else ''}) needs {needed / GIB:.2f} GiB on {where}, "
        f"whose device holds {capacity / GIB:.2f} GiB usable; the largest device has {largest:.2f} GiB usable: "
        f"add devices, {_enable_recompute(config)}or lower the microbatch size"
    )


def _terms_words(stage, tp: int) -> str:
    """A stage's predicted peak by term (Note [memory model] in evaluate.py), per GPU of a tensor
    group (which is planned as one device of tp times the memory)."""
    terms = (("model state", stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes),
             ("activations in flight", stage.activations_bytes), ("receive buffers and batch", stage.buffers_bytes),
             ("backward transient", stage.transient_bytes))
    return ", ".join(f"{name} {nbytes / tp / GIB:.1f}" for name, nbytes in terms) + (
        f" GiB per GPU of tp {tp}" if tp > 1 else " GiB")


def _even_split_words(space, r: CandidateRecord, schedule, config, local: int) -> str:
    """Where the candidate that needs least memory overflows with its regions split evenly over
    its stages and every region that saves memory recomputed (unless --recompute none): the
    terms that decide it, when the search found no plan to show. Empty where the layout is not
    one device class placed in order."""
    problem, cluster = space.inputs(Variant(r.tensor_parallel, r.shard_optimizer), r.dp)
    if not cluster.is_homogeneous or local > 1:
        return ""
    n, p = problem.num_regions, r.num_stages
    recompute = tuple(config.allow_recompute and config.recompute != "none" and saves_memory(x)
                      for x in problem.regions)
    cost = evaluate(problem, cluster, Assignment(
        tuple(min(p - 1, i * p // n) for i in range(n)), recompute, place_stages(cluster, p, r.dp), p, r.dp,
        r.num_microbatches, r.microbatch_size, schedule))
    s, stage = max(enumerate(cost.stages), key=lambda item: item[1].memory_bytes / item[1].capacity_bytes)
    tp = r.tensor_parallel
    return (f"; split evenly (num_stages={p}, dp={r.dp}, microbatches={r.num_microbatches}, microbatch_size="
            f"{r.microbatch_size}{f', tp {tp}' if tp > 1 else ''}) stage {s} needs "
            f"{stage.memory_bytes / tp / GIB:.1f} GiB{' per GPU' if tp > 1 else ''} of "
            f"{stage.capacity_bytes / tp / GIB:.1f} usable: {_terms_words(stage, tp)}")


def _enable_recompute(config) -> str:
    """The infeasible error's advice on recompute: a pinned "none" is named, a pinned "full" has no more
    to give (Note [recompute a user pins] in recompute_cost.py)."""
    return {"auto": "enable recompute, ", "full": "",
            "none": "allow recompute (--recompute auto, or full: it was pinned off by --recompute none), ",
            "selective": "recompute whole regions (--recompute full or auto: selective recomputes only attention cores), "}[
        config.recompute]
