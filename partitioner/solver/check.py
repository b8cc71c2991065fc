"""The independent checker: ``check_assignment`` re-verifies every solution the solver returns.

``structural_violations`` lists what makes an assignment no plan at all (a region on no stage, an
edge running backwards, an empty stage, a schedule that cannot run it), with the values; the
checker adds memory over capacity and an objective that disagrees with ``evaluate`` (evaluate.py)
by more than the ILP's rounding slack (Note [ILP scaling] in model.py).
"""

from __future__ import annotations

from collections import Counter

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.evaluate import CostBreakdown, evaluate
from partitioner.solver.schedules import priced_schedule
from partitioner.solver.problem import Assignment, PartitionProblem

__all__ = ["AssignmentError", "check_assignment", "structural_violations"]


class AssignmentError(ValueError):
    """A solution violates constraints; ``violations`` lists every one found."""

    def __init__(self, violations: list[str]):
        self.violations = tuple(violations)
        super().__init__(
            f"{len(violations)} violated constraint(s):\n" + "\n".join(f"  - {v}" for v in violations)
        )


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
    try:
        refusal = priced_schedule(a.schedule, a.local_stages).refusal(p, a.num_microbatches)
    except ValueError as unknown:  # the name as a plan writes it: Note [one class per schedule]
        refusal = str(unknown)
    if refusal is not None:
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
    rows = a.device_of_stage_replica
    if a.local_stages > 1:  # stage s on the devices of its pipeline position (s % pp, or a V)
        pp = a.pipeline_ranks
        moved = [s for s in range(p) if rows[s] != rows[a.position_of(s)]]
        if moved:
            out.append(f"{a.schedule} stages {moved} are not on the devices of their pipeline positions")
        rows = rows[:pp]
    flat = [i for row in rows for i in row]
    outside = [i for i in flat if not 0 <= i < cluster.num_devices]
    if outside:
        out.append(f"device indices {outside} outside 0..{cluster.num_devices - 1}")
        return out
    twice = sorted(i for i, n in Counter(flat).items() if n > 1)  # one pass: flat is every rank
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
    for pos, (peak, capacity) in enumerate(zip(cost.rank_memory_bytes, cost.rank_capacity_bytes)):
        if peak > capacity:  # interleaved: Note [interleaved pricing]
            violations.append(f"memory over capacity: the rank at pipeline position {pos} needs "
                              f"{peak / 2**30:.3f} GiB, its device holds {capacity / 2**30:.3f} GiB")
    for s, st in enumerate(cost.stages):
        if not cost.rank_memory_bytes and st.memory_bytes > st.capacity_bytes:
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
