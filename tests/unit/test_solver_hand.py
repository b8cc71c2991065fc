"""Hand-checkable solver instances: the answer is known before the solver runs."""

import pytest

from partitioner.config.cluster import CPU_MICROBATCH_OVERHEAD_S, GIB, ClusterSpec
from partitioner.errors import PartitionInfeasibleError
from partitioner.solver import (
    Edge,
    PartitionProblem,
    RegionCost,
    SolverConfig,
    SharedParam,
    check_assignment,
    evaluate,
    solve,
)

MIB = 2**20
FAST = SolverConfig(time_limit_s=5)


def region(name, *, fwd=1e9, static=0, act=0, recompute_act=0, layer=None, **kwargs):
    """fwd flops per sample, backward twice that; static bytes split 1/8 param, 1/8 grad, 6/8 optimizer."""
    return RegionCost(name, fwd, 2 * fwd, static // 8, static // 8, static - 2 * (static // 8), act, recompute_act,
                  layer=layer, **kwargs)


def chain(regions, edge_bytes=100, ties=()):
    edges = tuple(Edge(i, i + 1, edge_bytes) for i in range(len(regions) - 1))
    return PartitionProblem(tuple(regions), edges, tuple(ties))


def cpus(*memories_bytes, flops=None):
    groups = [{"kind": "cpu", "count": 1, "memory_bytes": m, **({"flops_per_s": flops[i]} if flops else {})}
              for i, m in enumerate(memories_bytes)]
    return ClusterSpec.from_dict({"group": groups})


def test_four_equal_regions_on_two_stages_split_two_and_two():
    problem = chain([region(f"r{i}") for i in range(4)])
    cluster = ClusterSpec.homogeneous(2)
    sol = solve(problem, cluster, 8, num_stages=2, dp=1, microbatches=4, config=FAST)
    assert sol.stage_of_region == (0, 0, 1, 1)
    assert sol.status == "OPTIMAL" and sol.objective == sol.bound
    # b = 2 samples: each region (1 + 2) GFLOP * 2 / 50 GFLOP/s = 0.12 s; one send of 200 B each
    # way; the stage's fixed cost per microbatch (Note [whole-step terms]).
    link = cluster.intra_node_link
    stage_s = 0.24 + link.latency_s + 200 / link.bandwidth_bytes_per_s + CPU_MICROBATCH_OVERHEAD_S
    assert sol.step_time_s == pytest.approx((4 - 1) * stage_s + 2 * stage_s)
    # The whole space's bound (one candidate here; Note [whole-space lower bound] in solve.py):
    # perfectly divisible work, with both sends' latency and each stage's fixed cost.
    assert sol.lower_bound_step_time_s == pytest.approx(
        (4 + 2 - 1) / 2 * (0.48 + 2 * link.latency_s + 2 * CPU_MICROBATCH_OVERHEAD_S))
    assert sol.lower_bound_step_time_s <= sol.step_time_s
    assert sol.bubble_fraction == pytest.approx(1 / 5, rel=1e-3)
    assert set(sol.baselines) == {"uniform", "param_balanced"}
    check_assignment(problem, cluster, sol)


def test_memory_constrained_skew_moves_work_off_the_heavy_stage():
    problem = chain([region("big", static=6 * MIB)] + [region(f"r{i}", static=MIB) for i in range(3)])
    cluster = cpus(6 * MIB + MIB // 2, 6 * MIB + MIB // 2)
    sol = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=4, config=FAST)
    assert sol.stage_of_region == (0, 1, 1, 1)
    assert all(st.memory_bytes <= st.capacity_bytes for st in sol.stages)


def _inflight_problem():
    # 1F1B, p = 2, m = 4: stage 0 keeps 2 microbatches in flight, stage 1 keeps 1.
    return chain([region(f"r{i}", act=MIB, recompute_act=MIB // 10) for i in range(4)], edge_bytes=8)


def test_1f1b_inflight_overflow_still_gets_a_plan_by_recompute_or_another_split():
    problem = _inflight_problem()
    cluster = cpus(3 * MIB + MIB // 2, 3 * MIB + MIB // 2)
    # The time-optimal split (0, 0, 1, 1) without recompute needs 2 in flight x 2 MiB = 4 MiB on stage 0
    # (+ its 8-byte output, held until its backward, for each of the 2).
    time_optimal = evaluate(problem, cluster, solve(problem, ClusterSpec.homogeneous(2), 4, num_stages=2, dp=1,
                                                    microbatches=4, config=FAST).assignment)
    assert time_optimal.stages[0].activations_bytes == 4 * MIB + 2 * 8

    with_recompute = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=4, config=FAST)
    assert with_recompute.stage_of_region == (0, 0, 1, 1) and any(with_recompute.recompute)
    no_recompute = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=4,
                         config=SolverConfig(time_limit_s=5, allow_recompute=False))
    assert no_recompute.stage_of_region == (0, 1, 1, 1) and not any(no_recompute.recompute)
    for sol in (with_recompute, no_recompute):
        check_assignment(problem, cluster, sol)
        assert all(st.memory_bytes <= st.capacity_bytes for st in sol.stages)
    # recomputing one forward is cheaper than a 1-versus-3 split
    assert with_recompute.step_time_s < no_recompute.step_time_s


def test_impossible_instance_names_needed_and_available_memory():
    problem = chain([region(f"r{i}", static=10 * GIB) for i in range(4)])
    cluster = ClusterSpec.homogeneous(2)  # 16 GiB each: the best split needs 20 GiB per stage
    with pytest.raises(PartitionInfeasibleError) as info:
        solve(problem, cluster, 4, config=FAST)
    message = str(info.value)
    assert "needs 20.00 GiB" in message and "16.00 GiB" in message
    assert "add devices" in message and "recompute" in message and "microbatch size" in message
    assert isinstance(info.value, ValueError)
    # which term overflows: the two regions' model state (issue 44 item 4: say why, not only that)
    assert "(model state 20.0, activations in flight 0.0, receive buffers and batch 0.0, backward transient" in message


def test_with_no_plan_found_the_even_split_names_the_terms_that_overflow():
    """When the search finds no plan to show, the candidate that needs least memory, split evenly
    with every region that saves memory recomputed, names where it overflows and by which terms."""
    from partitioner.solver.solution import CandidateRecord
    from partitioner.solver.solve import _even_split_words
    from partitioner.solver.space import SearchSpace

    problem = chain([region(f"r{i}", static=10 * GIB) for i in range(4)])
    words = _even_split_words(SearchSpace(problem, ClusterSpec.homogeneous(2)),
                              CandidateRecord(2, 1, 4, 1, "INFEASIBLE", None, float("inf"), 0.0), "1f1b", FAST, 1)
    assert words.startswith("; split evenly (num_stages=2, dp=1, microbatches=4, microbatch_size=1) stage 0 "
                            "needs 20.0 GiB of 16.0 usable: model state 20.0, activations in flight")


def test_two_fast_and_two_slow_devices_fast_ones_get_twice_the_work():
    problem = chain([region(f"r{i}") for i in range(12)], edge_bytes=1)
    cluster = cpus(*(16 * GIB,) * 4, flops=[100e9, 100e9, 50e9, 50e9])
    sol = solve(problem, cluster, 16, num_stages=4, dp=1, microbatches=16, config=FAST)
    work = {}
    for s, st in enumerate(sol.stages):
        flops = cluster.devices[sol.device_of_stage_replica[s][0]].flops_per_s
        work.setdefault(flops, []).append(len(st.regions))
    assert work == {100e9: [4, 4], 50e9: [2, 2]}
    assert sol.stages[0].compute_s == pytest.approx(sol.stages[-1].compute_s)
    check_assignment(problem, cluster, sol)


def test_tied_first_and_last_region_is_reported_with_its_cost():
    tie_bytes = 64 * MIB
    regions = [region("embed", static=8 * tie_bytes)] + [region(f"r{i}") for i in range(4)] + [region("head")]
    problem = chain(regions, ties=[SharedParam((0, 5), param_bytes=tie_bytes)])
    cluster = ClusterSpec.homogeneous(2)
    sol = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=4, config=FAST)
    (tie,) = sol.ties
    link = cluster.intra_node_link
    grad_bytes = tie_bytes  # the first region's grad/param ratio is 1
    assert tie.status == "replicated" and tie.stages == (0, 1)
    assert tie.cost_s == pytest.approx(link.latency_s + grad_bytes / link.bandwidth_bytes_per_s)
    last = sol.stages[1]
    assert last.params_bytes == tie_bytes and last.optimizer_bytes == 6 * tie_bytes  # the replica
    one_stage = solve(problem, ClusterSpec.homogeneous(1), 4, num_stages=1, config=FAST)
    assert one_stage.ties[0].status == "colocated" and one_stage.ties[0].cost_s == 0.0


def test_calibrated_seconds_override_flops_for_their_kind():
    calibrated = region("slow", fwd_s_per_sample_by_kind={"cpu": 1.0}, bwd_s_per_sample_by_kind={"cpu": 2.0})
    problem = chain([calibrated, region("a"), region("b")])
    sol = solve(problem, ClusterSpec.homogeneous(2), 2, num_stages=2, dp=1, microbatches=2, config=FAST)
    assert sol.stage_of_region == (0, 1, 1)
    assert sol.stages[0].compute_s == pytest.approx(3.0)


def test_enumeration_records_candidates_and_lays_out_ranks_stage_major():
    problem = chain([region(f"r{i}", static=4 * GIB) for i in range(4)])
    cluster = ClusterSpec.homogeneous(4)
    sol = solve(problem, cluster, 8, config=FAST)
    tried = [c for c in sol.candidates if c.step_time_s is not None]
    assert tried and all(sol.step_time_s <= c.step_time_s + 1e-12 for c in tried)
    assert {c.status for c in sol.candidates} <= {"OPTIMAL", "FEASIBLE", "INFEASIBLE", "PRUNED"}
    assert all(c.lower_bound_step_time_s <= c.step_time_s * (1 + 1e-9) for c in tried)
    # 16 GiB static does not fit one 16 GiB device: at least two stages
    assert sol.num_stages >= 2
    fixed = solve(problem, cluster, 8, num_stages=2, dp=2, microbatches=2, config=FAST)
    assert fixed.device_of_stage_replica == ((0, 1), (2, 3))
    assert [fixed.stage_replica_of_rank(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert fixed.rank_of(1, 0) == 2 and fixed.device_of_rank(3) == 3
    assert fixed.stages[0].dp_allreduce_s > 0


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(num_stages=5), "num_stages=5 exceeds"),
        (dict(num_stages=2, dp=3), "exceeds the cluster's 4 devices"),
        (dict(dp=3, microbatches=1), "not divisible"),
        (dict(schedule="zigzag"), "schedule='zigzag'"),
    ],
)
def test_bad_requests_raise_value_errors(kwargs, text):
    problem = chain([region(f"r{i}") for i in range(4)])
    with pytest.raises(ValueError, match=text):
        solve(problem, ClusterSpec.homogeneous(4), 8, **kwargs)


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="time_limit_s=0"):
        SolverConfig(time_limit_s=0)
    with pytest.raises(ValueError, match="num_workers=0"):
        SolverConfig(num_workers=0)
