"""Core sharing and the whole-step terms (Note [whole-step terms] in partitioner/solver/problem.py):
the factor, its effect on the prediction, and the ILP, the checker and the chain DP agreeing on it."""

import pytest

from partitioner.config.cluster import CPU_MICROBATCH_OVERHEAD_S, ClusterSpec
from partitioner.solver import Edge, PartitionProblem, RegionCost, SolverConfig, evaluate, solve, solve_chain_dp
from partitioner.solver.problem import core_sharing_factor
from partitioner.solver.device_layout import place_stages

FAST = SolverConfig(time_limit_s=5)


def chain(num_regions=4, fwd=1e9):
    regions = tuple(RegionCost(f"r{i}", fwd, 2 * fwd, 1000, 1000, 2000, 100, 10) for i in range(num_regions))
    return PartitionProblem(regions, tuple(Edge(i, i + 1, 100) for i in range(num_regions - 1)))


def test_factor_counts_ranks_per_core_on_each_node():
    two_cores = ClusterSpec.homogeneous(4, "cpu", cores=2)
    assert core_sharing_factor(two_cores, place_stages(two_cores, 2, 2)) == 2.0
    assert core_sharing_factor(two_cores, place_stages(two_cores, 2, 1)) == 1.0  # 2 ranks, 2 cores
    assert core_sharing_factor(ClusterSpec.homogeneous(4, "cpu", cores=4), place_stages(two_cores, 4, 1)) == 1.0
    # Two nodes of 2 cores, 3 devices each: 3 ranks on node 0 set the factor.
    two_nodes = ClusterSpec.homogeneous(6, "cpu", devices_per_node=3, cores=2)
    assert core_sharing_factor(two_nodes, place_stages(two_nodes, 4, 1)) == 1.5
    assert core_sharing_factor(two_nodes, num_ranks=2) == 1.0 and core_sharing_factor(two_nodes, num_ranks=6) == 1.5
    # Accelerators compute on their own: no factor, however many ranks a node holds.
    assert core_sharing_factor(ClusterSpec.homogeneous(8, "h100"), place_stages(ClusterSpec.homogeneous(8, "h100"), 8, 1)) == 1.0


def test_four_ranks_on_two_cores_predict_twice_the_four_core_time():
    problem = chain()
    times = {}
    for cores in (2, 4):
        cluster = ClusterSpec.homogeneous(4, "cpu", cores=cores)
        sol = solve(problem, cluster, 16, num_stages=2, dp=2, microbatches=4, config=FAST)  # checked inside
        assert sol.objective * sol.time_unit_s == pytest.approx(sol.step_time_s, rel=1e-5)  # ILP == checker
        times[cores] = sol
    shared, own = times[2], times[4]
    assert shared.stage_of_region == own.stage_of_region
    for a, b in zip(shared.stages, own.stages):
        assert a.compute_s == pytest.approx(2 * b.compute_s)
        assert a.overhead_s == pytest.approx(2 * CPU_MICROBATCH_OVERHEAD_S)
    assert shared.step_time_s == pytest.approx(2 * own.step_time_s)


def test_solver_uses_fewer_ranks_than_devices_when_cores_are_short():
    problem = chain(num_regions=4, fwd=1e8)
    plenty = solve(problem, ClusterSpec.homogeneous(4, "cpu", cores=4), 16, config=FAST)
    short = solve(problem, ClusterSpec.homogeneous(4, "cpu", cores=1), 16, config=FAST)
    assert plenty.num_stages * plenty.dp == 4
    assert short.num_stages * short.dp == 1  # more ranks on one core only add overheads


def test_chain_dp_matches_the_ilp_and_the_checker_under_core_sharing():
    problem = PartitionProblem(
        tuple(RegionCost(f"r{i}", (1 + i % 3) * 1e9, 2e9, 1000, 1000, 2000, 100, 10) for i in range(7)),
        tuple(Edge(i, i + 1, 100 * (i + 1)) for i in range(6)))
    cluster = ClusterSpec.homogeneous(3, "cpu", cores=2)
    sol = solve(problem, cluster, 6, num_stages=3, dp=1, microbatches=6, config=FAST)
    dp = solve_chain_dp(problem, cluster, num_stages=3, num_microbatches=6, microbatch_size=1,
                        placement=place_stages(cluster, 3, 1))
    assert dp.step_time_s == pytest.approx(sol.step_time_s, rel=1e-6)
    cost = evaluate(problem, cluster, sol.assignment)
    assert cost.step_time_s == pytest.approx(1.5 * evaluate(
        problem, ClusterSpec.homogeneous(3, "cpu", cores=3), sol.assignment).step_time_s)


def test_cores_in_cluster_files_and_errors():
    cluster = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 4, "cores": 2}]})
    assert {d.cores for d in cluster.devices} == {2}
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster
    assert ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 2}]}).devices[0].cores is None
    with pytest.raises(ValueError, match="cores=0"):
        ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 1, "cores": 0}]})
    with pytest.raises(ValueError, match="node 0 is given 2 and 4 cores"):
        ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 1, "cores": 2},
                                         {"kind": "cpu", "count": 1, "cores": 4}]})
    with pytest.raises(ValueError, match="cores=4 is for cpu devices"):
        ClusterSpec.homogeneous(2, "h100", cores=4)
