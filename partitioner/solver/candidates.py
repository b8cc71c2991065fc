"""The candidates ``solve`` searches, and one candidate's solve.

A candidate is (pipeline depth p, data-parallel degree d, microbatch count m) for one schedule;
``enumerate_candidates`` lists those the request allows (m divides the per-replica batch), and
``solve_candidate`` solves it: one CP-SAT model per device placement, each hinted with the best
baseline or chain-DP plan (Note [search help] in model.py), or the class-choice relaxation
(placed.py, Note [exact placements] in placements.py), and verifies the plan.
"""

from __future__ import annotations

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.check import check_assignment
from partitioner.solver.model import SolverConfig
from partitioner.solver.placed import common_time_unit_s, solve_placements, solve_relaxed
from partitioner.solver.placements import enumerate_placements
from partitioner.solver.problem import PartitionProblem
from partitioner.solver.device_layout import place_stages
from partitioner.solver.candidate import Candidate
from partitioner.solver.schedules import priced_schedule, requested_schedule
from partitioner.solver.solution import Solution

__all__ = ["enumerate_candidates", "solve_candidate", "validate_request"]


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
    c = Candidate.of(num_stages, dp, num_microbatches, global_batch, schedule, config.local_stages)
    p, d, m, b = c.p, c.d, c.m, c.b
    single_node = len({device.node for device in cluster.devices}) == 1
    if cluster.is_homogeneous:
        result = solve_placements(problem, cluster, [place_stages(cluster, p, d, local_stages=c.local_stages,
                                                                 position_of=c.pipeline_schedule.position_of)], c,
                                  config=config, time_limit_s=time_limit_s, incumbent_s=incumbent_s)
    else:
        # Note [exact placements]; on one node every link is the same and class choice is exact.
        placements = None if single_node else enumerate_placements(cluster, p, d, limit=config.max_placements)
        unit = common_time_unit_s(problem, cluster, b, config)
        if placements:
            result = solve_placements(problem, cluster, placements, c, config=config, time_limit_s=time_limit_s,
                                      incumbent_s=incumbent_s, time_unit_s=unit)
        elif placements == []:
            return None, "INFEASIBLE", 0.0
        else:
            result = solve_relaxed(problem, cluster, c, config=config, time_limit_s=time_limit_s,
                                   incumbent_s=incumbent_s, time_unit_s=unit)
    if result.assignment is None:
        return None, result.status, result.solve_time_s
    assignment, cost = result.assignment, result.cost
    solution = Solution(
        stage_of_region=assignment.stage_of_region,
        recompute=assignment.recompute,
        device_of_stage_replica=assignment.device_of_stage_replica,
        num_stages=p, dp=d, num_microbatches=m, microbatch_size=b, schedule=schedule, global_batch=global_batch,
        stages=cost.stages,
        step_time_s=cost.step_time_s,
        bubble_fraction=cost.bubble_fraction,
        lower_bound_step_time_s=cost.lower_bound_step_time_s,
        ties=cost.ties,
        status=result.status,
        objective=result.objective,
        bound=result.bound,
        solve_time_s=result.solve_time_s,
        time_unit_s=result.time_unit_s,
        memory_unit_bytes=result.memory_unit_bytes,
        rounding_slack_units=result.rounding_slack_units,
        exact_links=result.exact_links,
    )
    check_assignment(problem, cluster, solution)  # raises AssignmentError on any violation
    return solution, result.status, result.solve_time_s


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_candidates(problem, cluster, global_batch, num_stages, dp, microbatches, config, schedule="1f1b"):
    """Every (stages, dp, microbatches) the devices, the batch and the schedule admit (Note [only
    runnable plans] in problem.py)."""
    num_devices, n = cluster.num_devices, problem.num_regions
    # Note [cluster queries are cached] in partitioner/config/cluster.py
    class_counts = {c: n for c, (_first, _last, n) in cluster.device_classes.items()}
    priced = priced_schedule(schedule, config.local_stages)  # Note [one class per schedule]
    v = priced.local_stages
    stage_options = [num_stages] if num_stages is not None else range(1, min(num_devices * v, n) + 1)
    out = []
    for p in stage_options:
        if p % v or (v > 1 and p // v < 2):
            continue
        ranks = p // v
        dp_options = [dp] if dp is not None else range(1, num_devices // ranks + 1)
        for d in dp_options:
            if global_batch % d or sum(k // d for k in class_counts.values()) < ranks:
                continue
            m_options = [microbatches] if microbatches is not None else _divisors(global_batch // d)
            for m in m_options:
                if global_batch % (d * m):
                    continue
                if microbatches is None and config.max_microbatches is not None and m > config.max_microbatches:
                    continue
                if priced.refusal(p, m) is not None:
                    continue
                out.append((p, d, m))
    return out


def validate_options(cluster, global_batch, num_stages, dp, microbatches, schedule):
    """The checks that need no model: the compiler runs them before tracing (seconds to minutes),
    validate_request again with the traced problem."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be an int >= 1")
    priced = requested_schedule(schedule)  # a refused or unknown name: its one line (Note [DualPipeV refused])
    if priced is None:  # auto: Note [schedule choice]
        return _validate_counts(cluster, global_batch, num_stages, dp, microbatches, (1,))
    if priced.one_device_class and not cluster.is_homogeneous:  # Note [interleaved pricing]
        raise ValueError(f"schedule {schedule} is priced on one device class only, and this cluster has "
                         f"{len({d.device_class for d in cluster.devices})}: use --schedule 1f1b, gpipe or auto")
    _validate_counts(cluster, global_batch, num_stages, dp, microbatches, priced.local_stage_options, schedule)


def _validate_counts(cluster, global_batch, num_stages, dp, microbatches, local_stage_options, schedule="interleaved"):
    """The request's counts against the devices and the batch; ``local_stage_options``: the
    stages per rank the schedule may put on a rank (stage counts are checked per rank then)."""
    for name, value in (("num_stages", num_stages), ("dp", dp), ("microbatches", microbatches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1 or None (let the solver choose)")
    devices = cluster.num_devices
    several = local_stage_options != (1,)  # several stages per rank
    if several and devices < 2:  # no stage count can help: say what does
        raise ValueError(f"schedule {schedule} needs at least 2 pipeline ranks and the cluster has {devices} "
                         "device: use --schedule 1f1b or gpipe, or more devices (--devices 2)")
    if several and num_stages is not None:
        ok = [v for v in local_stage_options if num_stages % v == 0 and 2 <= num_stages // v <= devices]
        if not ok:
            good = sorted({v * r for v in local_stage_options for r in range(2, devices + 1)})
            raise ValueError(f"num_stages={num_stages} (--stages) cannot run {schedule} on {devices} devices: it "
                             f"puts {'/'.join(map(str, local_stage_options))} stages on each of at least 2 ranks "
                             f"(at most {devices}); use --stages {' or '.join(map(str, good[:4]))}")
    if several:  # stage counts were checked per rank above
        num_stages = None
    for name, flag, value in (("num_stages", "--stages", num_stages), ("dp", "--dp", dp)):
        if value is not None and value > devices:
            raise ValueError(f"{name}={value} ({flag}) needs {value} devices and the cluster has {devices}: "
                             f"use {flag} {devices} or fewer, or more devices (--devices {value})")
    if num_stages is not None and dp is not None and num_stages * dp > devices:
        raise ValueError(f"num_stages * dp = {num_stages} * {dp} = {num_stages * dp} exceeds the cluster's "
                         f"{devices} devices; lower one of them or add devices")
    if microbatches is not None and global_batch % microbatches:
        raise ValueError(f"global_batch={global_batch} is not divisible by microbatches={microbatches} "
                         "(--microbatches): choose a divisor of the global batch")


def validate_request(problem, cluster, global_batch, num_stages, dp, microbatches, schedule):
    if type(num_stages) is int and num_stages > problem.num_regions:
        raise ValueError(f"num_stages={num_stages} exceeds the model's {problem.num_regions} regions; "
                         "use fewer stages or finer regions")
    validate_options(cluster, global_batch, num_stages, dp, microbatches, schedule)
    if dp is not None and microbatches is not None and global_batch % (dp * microbatches):
        raise ValueError(f"global_batch={global_batch} is not divisible by dp * microbatches = "
                         f"{dp} * {microbatches}; choose values whose product divides it")
    priced = requested_schedule(schedule)
    if num_stages is not None and microbatches is not None and priced is not None and priced.local_stage_options == (1,):
        refusal = priced.refusal(num_stages, microbatches)
        if refusal is not None:
            raise ValueError(f"{refusal}: use --microbatches {num_stages} or more, fewer stages, "
                             "or --schedule gpipe")
