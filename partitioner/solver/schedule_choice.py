"""``--schedule auto``: the pipeline schedule as a decision of the solver.

Note [schedule choice]
    Each schedule the solver prices (problem.SCHEDULES: gpipe, 1f1b) is solved over the whole
    allowed (stages, dp, microbatches) space by ``solve``, and the plan with the smallest
    predicted step time under the memory limit wins; on a tie the earlier of SCHEDULE_ORDER
    (1f1b first: it holds fewer activations). In the cost model (Note [cost model] in
    evaluate.py) the two schedules have the same time for the same (p, d, m) and GPipe holds every
    microbatch's activations, so GPipe can only win where 1F1B cannot run: fewer microbatches
    than stages (Note [only runnable plans]), e.g. a small global batch over a deep pipeline.
    The chosen plan is OPTIMAL over both schedules only when its own solve is OPTIMAL and every
    other schedule's solve was OPTIMAL (or found nothing that fits) at a step time no lower;
    otherwise it is FEASIBLE and its bound the smaller of the two (0 when a schedule found no plan
    within the time limit). Interleaved is not a
    candidate: it is not priced yet (Note [interleaved not priced] in interleaved.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from partitioner.errors import PartitionInfeasibleError
from partitioner.solver.solution import Solution

__all__ = ["AUTO", "SCHEDULE_ORDER", "solve_any_schedule"]

AUTO = "auto"
SCHEDULE_ORDER = ("1f1b", "gpipe")  # tie-break: fewer activations first


def solve_any_schedule(solve, problem, cluster, global_batch, **kwargs) -> Solution:
    """The best of ``solve(..., schedule=s)`` over SCHEDULE_ORDER (Note [schedule choice]).
    ``solve`` is solve.solve (passed in: that module dispatches here)."""
    results: dict[str, Solution] = {}
    errors: dict[str, ValueError] = {}
    for schedule in SCHEDULE_ORDER:
        try:
            results[schedule] = solve(problem, cluster, global_batch, schedule=schedule, **kwargs)
        except ValueError as err:  # PartitionInfeasibleError, or no runnable candidate
            errors[schedule] = err
    if not results:
        infeasible = [e for e in errors.values() if isinstance(e, PartitionInfeasibleError)]
        detail = "; ".join(f"{s}: {e}" for s, e in errors.items())
        cls = PartitionInfeasibleError if infeasible else ValueError
        raise cls(f"no schedule has a plan ({detail})")
    chosen_name = min(results, key=lambda s: (results[s].step_time_s, SCHEDULE_ORDER.index(s)))
    chosen = results[chosen_name]
    status, bound = chosen.status, chosen.bound
    for name, other in results.items():
        if name == chosen_name:
            continue
        other_bound_s = (other.bound * other.time_unit_s) if other.bound is not None else 0.0
        if other.status != "OPTIMAL" and other_bound_s < chosen.step_time_s:
            status = "FEASIBLE"
            if bound is not None:
                bound = min(bound, max(0, math.floor(other_bound_s / chosen.time_unit_s)))
    if any(getattr(e, "timed_out", False) for e in errors.values()):  # a time limit, not a proof
        status, bound = "FEASIBLE", (0 if bound is not None else None)
    others = ", ".join(f"{s} {r.step_time_s:.6g} s ({r.status})" for s, r in results.items() if s != chosen_name)
    others += "".join(f", {s} has no plan" for s in errors)
    scope = chosen.optimal_over.replace(f"the {chosen_name} schedule",
                                        f"schedules {' and '.join(SCHEDULE_ORDER)} (chose {chosen_name}; {others})")
    lower = min(r.lower_bound_step_time_s for r in results.values())
    return replace(chosen, status=status, bound=bound, optimal_over=scope,
                   lower_bound_step_time_s=lower,
                   solve_time_s=sum(r.solve_time_s for r in results.values()))
