"""ILP == exact chain DP on seeded random chains (identical devices, dp = 1, no ties)."""

import random

import pytest

from partitioner.config.cluster import ClusterSpec
from partitioner.solver import (
    Edge,
    PartitionProblem,
    RegionCost,
    SolverConfig,
    evaluate,
    solve_candidate,
    solve_chain_dp,
)
from partitioner.solver.baselines import min_max_contiguous_split, uniform_split

MIB = 2**20


def random_chain(seed: int):
    rng = random.Random(seed)
    n = rng.randint(6, 14)
    regions = tuple(
        RegionCost(f"r{i}", rng.uniform(0.2, 4) * 1e9, rng.uniform(0.5, 8) * 1e9, rng.randint(0, 3) * MIB,
               rng.randint(0, 3) * MIB, rng.randint(0, 6) * MIB, rng.randint(0, 2) * MIB, 0)
        for i in range(n)
    )
    edges = tuple(Edge(i, i + 1, rng.randint(0, 400) * MIB // 8) for i in range(n - 1))
    # a tensor group's members each hold the boundary tensors (Note [boundary holders]): every third chain
    return PartitionProblem(regions, edges, input_bytes_per_sample=rng.randint(0, 8) * MIB,
                            boundary_holders=1 + 2 * (seed % 3 == 2))


@pytest.mark.parametrize("seed", range(20))
def test_ilp_equals_chain_dp(seed):
    rng = random.Random(1000 + seed)
    problem = random_chain(seed)
    p = rng.randint(2, 4)
    m = rng.choice([1, 2, 4, 8])
    schedule = rng.choice(["1f1b", "gpipe"])
    if schedule == "1f1b":
        m = max(m, p)  # torch's 1F1B refuses fewer microbatches than stages (Note [only runnable plans])

    def cluster_with(memory):
        return ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 4, "devices_per_node": 2,
                                                 "memory_bytes": memory}]})

    # every other instance gets less memory than the unconstrained optimum's peak stage needs
    memory = 2**40
    if seed % 2 == 0:
        free = solve_chain_dp(problem, cluster_with(memory), num_stages=p, num_microbatches=m, microbatch_size=1,
                              schedule=schedule)
        peak = max(st.memory_bytes for st in evaluate(problem, cluster_with(memory), free.assignment).stages)
        memory = int(peak * rng.uniform(0.7, 0.99))
    cluster = cluster_with(memory)
    dp_result = solve_chain_dp(problem, cluster, num_stages=p, num_microbatches=m, microbatch_size=1,
                               schedule=schedule)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=p, dp=1, num_microbatches=m, global_batch=m,
                                          schedule=schedule, config=SolverConfig(allow_recompute=False))
    if dp_result is None:
        assert solution is None
        return
    assert status == "OPTIMAL"
    assert solution.step_time_s == pytest.approx(dp_result.step_time_s, rel=1e-5)
    assert dp_result.pipeline_s == pytest.approx(dp_result.step_time_s)  # no all-reduce, no ties


def test_min_max_split_and_uniform_split_by_hand():
    assert min_max_contiguous_split([1, 1, 1, 1], 2) == (0, 0, 1, 1)
    assert min_max_contiguous_split([5, 1, 1, 1, 1, 1], 2) == (0, 1, 1, 1, 1, 1)
    assert min_max_contiguous_split([1, 2], 3) is None
    layers = [None, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, None]
    problem = PartitionProblem(tuple(RegionCost(f"r{i}", 1, 1, 1, 1, 1, 1, 1, layer=l) for i, l in enumerate(layers)),
                               ())
    # 5 blocks on 2 stages: 3 + 2, embedding first, head last
    assert uniform_split(problem, 2) == (0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1)
    assert uniform_split(problem, 6) is None


def layered_chain(layers: int) -> PartitionProblem:
    """Alternating attention-like and MLP-like regions, each able to recompute down to its input."""
    regions = []
    for i in range(layers):
        regions.append(RegionCost(f"attn{i}", 2e9, 4e9, 2 * MIB, 2 * MIB, 12 * MIB, 40 * MIB, 4 * MIB))
        regions.append(RegionCost(f"mlp{i}", 4e9, 8e9, 4 * MIB, 4 * MIB, 24 * MIB, 30 * MIB, 4 * MIB))
    edges = tuple(Edge(i, i + 1, 4 * MIB) for i in range(len(regions) - 1))
    return PartitionProblem(tuple(regions), edges, input_bytes_per_sample=MIB)


@pytest.mark.parametrize("capacity_mib", [300, 400, 550])
def test_greedy_recompute_dp_fits_memory_and_matches_the_ilp(capacity_mib):
    """The greedy-recompute DP (the ILP's hint) gives a plan that fits memory, recomputes only
    where a stage needs it, and on a layered chain costs what the ILP proves optimal."""
    problem = layered_chain(8)
    cluster = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 4, "memory_bytes": capacity_mib * MIB}]})
    greedy = solve_chain_dp(problem, cluster, num_stages=4, num_microbatches=8, microbatch_size=1, recompute="greedy")
    assert greedy is not None
    cost = evaluate(problem, cluster, greedy.assignment)
    assert cost.fits_memory
    none = solve_chain_dp(problem, cluster, num_stages=4, num_microbatches=8, microbatch_size=1)
    if none is not None:  # recompute is only worth it under memory pressure
        assert greedy.step_time_s <= none.step_time_s + 1e-12
    solution, status, _ = solve_candidate(problem, cluster, num_stages=4, dp=1, num_microbatches=8, global_batch=8,
                                          config=SolverConfig(use_hint=False))
    assert status == "OPTIMAL"
    assert greedy.step_time_s == pytest.approx(solution.step_time_s, rel=1e-6)
    assert any(greedy.assignment.recompute) == any(solution.recompute)
