"""Baselines at their own best configuration, speed-proportional on mixed devices, and not
fitting shown as not fitting (Note [fair baselines] in partitioner/solver/fair_baselines.py)."""

import sys
from pathlib import Path

from partitioner.config.cluster import GIB, ClusterSpec
from partitioner.solver import Edge, PartitionProblem, RegionCost, SolverConfig, evaluate_baselines, solve
from partitioner.solver.baselines import proportional_counts, uniform_split
from partitioner.solver.fair_baselines import hand_placement

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hetero_instances import het_cluster  # noqa: E402

MIB = 2**20


def layered(num_layers, *, static=0, head_static=0, fwd=1e12):
    regions = [RegionCost(f"block.{i}", fwd, 2 * fwd, static // 8, static // 8, static - 2 * (static // 8), MIB, MIB,
                          layer=i) for i in range(num_layers)]
    regions.append(RegionCost("head", fwd / 10, fwd / 5, head_static // 8, head_static // 8,
                              head_static - 2 * (head_static // 8), MIB, MIB))
    return PartitionProblem(tuple(regions), tuple(Edge(i, i + 1, MIB) for i in range(num_layers)))


def test_uniform_on_mixed_devices_gives_blocks_in_proportion_to_speed():
    cluster = het_cluster()  # H100 (396 TFLOP/s) on node 0, A100 (125) on node 1
    placement = hand_placement(cluster, 4, 1)
    assert [cluster.devices[row[0]].kind for row in placement] == ["h100", "h100", "a100-40gb", "a100-40gb"]
    speeds = [cluster.devices[row[0]].flops_per_s for row in placement]
    assert proportional_counts(12, speeds) == [5, 5, 1, 1]  # 12 x 396 / 1042 = 4.56 each for the H100s
    split = uniform_split(layered(12), 4, speeds)
    assert [split.count(s) for s in range(4)] == [5, 5, 1, 2]  # the head follows the last block
    assert uniform_split(layered(12), 4) == uniform_split(layered(12), 4, [1.0] * 4)  # one class: equal


def test_each_baseline_gets_its_own_best_configuration_and_recompute():
    problem = layered(8)
    cluster = ClusterSpec.homogeneous(4, "h100")
    solution = solve(problem, cluster, 32, config=SolverConfig(time_limit_s=5))
    at_ours = evaluate_baselines(problem, cluster, num_stages=solution.num_stages, dp=solution.dp,
                                 num_microbatches=solution.num_microbatches,
                                 microbatch_size=solution.microbatch_size, schedule="1f1b",
                                 placement=solution.device_of_stage_replica)
    for name, best in solution.baseline_details.items():
        assert best.fits_memory and best.num_stages is not None
        assert best.step_time_s <= at_ours[name].step_time_s * (1 + 1e-12)  # its best, not ours
        assert solution.step_time_s <= best.step_time_s * (1 + 1e-9)  # ours is optimal over a superset
    # the lower bound covers every candidate (Note [whole-space lower bound])
    assert solution.lower_bound_step_time_s <= solution.step_time_s


def test_a_baseline_that_fits_nowhere_has_no_time():
    """Uniform keeps the big head with its share of blocks on the last stage: over 4 GiB on every
    configuration, while a parameter-balanced split and ours fit."""
    problem = layered(4, static=GIB, head_static=5 * GIB // 2)
    cluster = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2, "memory_bytes": 4 * GIB}]})
    solution = solve(problem, cluster, 4, config=SolverConfig(time_limit_s=5))
    assert not solution.baseline_details["uniform"].fits_memory
    assert solution.baselines["uniform"] is None
    assert solution.baselines["param_balanced"] is not None
    assert "baseline uniform: does not fit memory" in solution.summary()
