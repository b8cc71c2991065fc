"""``--schedule auto``: the pipeline schedule as a decision of the solver.

Note [schedule choice]
    Each schedule the solver prices is solved over the whole allowed (stages, dp, microbatches)
    space (interleaved at every v of LOCAL_STAGE_OPTIONS), and the plan with the smallest predicted
    whole step under the memory limit wins (the terms beside the ILP differ between the schedules'
    winners: Note [terms outside the ILP] in space.py); a tie goes to the earlier of SCHEDULE_ORDER
    (1f1b first: it holds fewer activations). GPipe prices as 1F1B does in time and holds every
    microbatch, so it wins only where 1F1B cannot run (fewer microbatches than stages: Note [only
    runnable plans]). Interleaved wins where the bubble is large and the model splits into many
    balanced stages; it is left out on a cluster of several device classes. The choice is OPTIMAL
    only when every schedule's solve was OPTIMAL (or found nothing that fits) at a step time no
    lower; otherwise FEASIBLE, its bound the smallest (0 when a schedule timed out with no plan).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from partitioner.errors import PartitionInfeasibleError
from partitioner.solver.schedules import SCHEDULE_ORDER, priced_schedule
from partitioner.solver.solution import Solution

__all__ = ["SCHEDULE_ORDER", "solve_any_schedule"]


def solve_any_schedule(solve, problem, cluster, global_batch, **kwargs) -> Solution:
    """The best of ``solve(..., schedule=s)`` over SCHEDULE_ORDER (Note [schedule choice]).
    ``solve`` is solve.solve (passed in: that module dispatches here). Interleaved is left out on
    a cluster of several device classes (Note [interleaved pricing] in interleaved.py)."""
    order = [s for s in SCHEDULE_ORDER if cluster.is_homogeneous or not priced_schedule(s).one_device_class]
    runs = {s: (lambda s=s: solve(problem, cluster, global_batch, schedule=s, **kwargs)) for s in order}
    chosen, results, errors, chosen_name = _best_of(runs, order)
    others = _others(results, errors, chosen_name)
    for left_out in (s for s in SCHEDULE_ORDER if s not in order):
        others += f", {left_out} left out (one device class only)"
    scope = re.sub(rf"the {chosen.schedule} schedule( at \d+ stages per rank)?",
                   lambda match: f"schedules {' and '.join(order)} (chose {chosen.schedule}"
                                 f"{match.group(1) or ''}; {others})", chosen.optimal_over, count=1)
    return replace(chosen, optimal_over=scope)


def solve_any_local_stages(solve, problem, cluster, global_batch, *, schedule, config, **kwargs) -> Solution:
    """``schedule`` at every number of stages per rank it offers (``local_stage_options``), the
    best kept, as ``solve_any_schedule`` keeps the best schedule (Note [interleaved pricing])."""
    options = priced_schedule(schedule).local_stage_options
    order = [f"v={v}" for v in options]
    runs = {f"v={v}": (lambda v=v: solve(problem, cluster, global_batch, schedule=schedule,
                                          config=replace(config, local_stages=v), **kwargs))
            for v in options}
    chosen, results, errors, chosen_name = _best_of(runs, order, f"schedule {schedule} has no plan at any "
                                                    "number of stages per rank")
    others = _others(results, errors, chosen_name)
    if len(options) == 1:  # zbv: one number of stages per rank, nothing to choose between
        return chosen
    scope = chosen.optimal_over.replace(
        f"at {chosen.local_stages} stages per rank",
        f"at {', '.join(str(v) for v in options)} stages per rank (chose {chosen.local_stages}; {others})")
    return replace(chosen, optimal_over=scope)


def _others(results, errors, chosen_name) -> str:
    parts = [f"{s} {r.total_step_s:.6g} s ({r.status})" for s, r in results.items() if s != chosen_name]
    return ", ".join(parts + [f"{s} has no plan" for s in errors])


def _best_of(runs: dict, order: list[str], what: str = "no schedule has a plan"):
    """Run every option; (the fastest plan with the combined status, bound and lower bound, the
    results, the errors, the chosen option's name). OPTIMAL only when the chosen plan's solve is and
    every other option's is OPTIMAL (or found nothing that fits) at a step time no lower."""
    results: dict[str, Solution] = {}
    errors: dict[str, ValueError] = {}
    for name in order:
        try:
            results[name] = runs[name]()
        except ValueError as err:  # PartitionInfeasibleError, or no runnable candidate
            errors[name] = err
    if not results:
        infeasible = [e for e in errors.values() if isinstance(e, PartitionInfeasibleError)]
        detail = "; ".join(f"{s}: {e}" for s, e in errors.items())
        if infeasible:  # a time limit in any option keeps the whole answer "no proof" (timed_out)
            raise PartitionInfeasibleError(f"{what} ({detail})",
                                           timed_out=any(getattr(e, "timed_out", False) for e in infeasible))
        raise ValueError(f"{what} ({detail})")
    # on the whole predicted step: the terms beside the ILP (norm, replica check) differ with dp
    chosen_name = min(results, key=lambda s: (results[s].total_step_s, order.index(s)))
    chosen = results[chosen_name]
    status, bound = chosen.status, chosen.bound
    for name, other in results.items():
        if name == chosen_name:
            continue
        other_bound_s = (other.bound * other.time_unit_s) if other.bound is not None else 0.0
        if other.status != "OPTIMAL" and other_bound_s < chosen.total_step_s:  # its terms are >= 0
            status = "FEASIBLE"
            if bound is not None:
                bound = min(bound, max(0, math.floor(other_bound_s / chosen.time_unit_s)))
    if any(getattr(e, "timed_out", False) for e in errors.values()):  # a time limit, not a proof
        status, bound = "FEASIBLE", (0 if bound is not None else None)
    lower = min(r.lower_bound_step_time_s for r in results.values())
    chosen = replace(chosen, status=status, bound=bound, lower_bound_step_time_s=lower,
                     solve_time_s=sum(r.solve_time_s for r in results.values()))
    return chosen, results, errors, chosen_name
