"""The ILP's optimum equals exhaustive search over every assignment (seeded random DAGs)."""

import itertools
import random

import pytest

from partitioner.config.cluster import ClusterSpec
from partitioner.solver import (
    Assignment,
    Edge,
    PartitionProblem,
    RegionCost,
    SolverConfig,
    SharedParam,
    evaluate,
    place_stages,
    solve_candidate,
)
from partitioner.solver.check import structural_violations

MIB = 2**20


def random_instance(seed: int, num_regions: int):
    rng = random.Random(seed)
    regions = []
    for i in range(num_regions):
        static = rng.randint(0, 4) * MIB
        act = rng.randint(0, 3) * MIB
        regions.append(RegionCost(f"r{i}", rng.uniform(0.5, 3) * 1e9, rng.uniform(1, 6) * 1e9, static // 4, static // 4,
                              static // 2, act, act // 4 if rng.random() < 0.7 else act))
    edges = []
    for dst in range(1, num_regions):
        sources = {dst - 1} if rng.random() < 0.8 else set()
        sources |= {src for src in range(dst - 1) if rng.random() < 0.2}
        edges += [Edge(src, dst, rng.randint(0, 300) * MIB // 4) for src in sorted(sources)]
    ties = ()
    if rng.random() < 0.5:
        pair = tuple(sorted(rng.sample(range(num_regions), 2)))
        ties = (SharedParam(pair, param_bytes=rng.randint(1, 2) * MIB * 64),)
    return PartitionProblem(tuple(regions), tuple(edges), ties, input_bytes_per_sample=rng.randint(0, 4) * MIB)


def all_plans(problem, cluster, *, p, d, m, b, schedule, recompute_options):
    """(step time, peak stage memory) of every structurally valid assignment."""
    placement = place_stages(cluster, p, d)
    plans = []
    for stages in itertools.product(range(p), repeat=problem.num_regions):
        for recompute in recompute_options:
            a = Assignment(stages, recompute, placement, p, d, m, b, schedule)
            if structural_violations(problem, cluster, a):
                break
            cost = evaluate(problem, cluster, a)
            plans.append((cost.step_time_s, max(st.memory_bytes for st in cost.stages)))
    return plans


def tight_capacity(plans, quantile):
    """A capacity that only a ``quantile`` of the plans fit: memory binds but plans remain."""
    peaks = sorted(peak for _, peak in plans)
    return int(peaks[int(quantile * (len(peaks) - 1))])


def best_fitting(plans, capacity):
    return min((step for step, peak in plans if peak <= capacity), default=None)


def cluster_for(p, d, memory_bytes):
    # replicas of a stage share a node; pipeline neighbours cross nodes (exercises both links)
    return ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": p * d, "devices_per_node": d,
                                             "memory_bytes": memory_bytes}]})


CASES = [(seed, 4 + seed % 4, 2 + seed % 2, 1 + (seed // 2) % 2, ("1f1b", "gpipe")[seed % 3 == 0]) for seed in range(12)]


@pytest.mark.parametrize("seed, num_regions, p, d, schedule", CASES)
def test_ilp_matches_brute_force(seed, num_regions, p, d, schedule):
    problem = random_instance(seed, num_regions)
    m = 4
    plans = all_plans(problem, cluster_for(p, d, 2**50), p=p, d=d, m=m, b=1, schedule=schedule,
                      recompute_options=[(False,) * num_regions])
    # a third of the instances unconstrained, the rest with memory binding (one infeasible)
    quantile = (1.0, 0.3, 0.05)[seed % 3] if seed != 4 else -1
    capacity = tight_capacity(plans, quantile) if quantile >= 0 else int(min(pk for _, pk in plans)) - 2**20
    cluster = cluster_for(p, d, capacity)
    best = best_fitting(plans, capacity)
    config = SolverConfig(time_limit_s=10, allow_recompute=False)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                          global_batch=d * m, schedule=schedule, config=config)
    if best is None:
        assert solution is None and status == "INFEASIBLE"
        return
    assert status == "OPTIMAL"
    assert solution.step_time_s == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_ilp_matches_brute_force_with_recompute(seed):
    n, p, m = 5, 2, 4
    problem = random_instance(100 + seed, n)
    no_recompute = all_plans(problem, cluster_for(p, 1, 2**50), p=p, d=1, m=m, b=1, schedule="1f1b",
                             recompute_options=[(False,) * n])
    capacity = tight_capacity(no_recompute, 0.02)
    cluster = cluster_for(p, 1, capacity)
    plans = all_plans(problem, cluster, p=p, d=1, m=m, b=1, schedule="1f1b",
                      recompute_options=list(itertools.product((False, True), repeat=n)))
    best = best_fitting(plans, capacity)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=p, dp=1, num_microbatches=m,
                                          global_batch=m, config=SolverConfig(time_limit_s=10))
    if best is None:
        assert solution is None
        return
    assert solution.step_time_s == pytest.approx(best, rel=1e-5)
