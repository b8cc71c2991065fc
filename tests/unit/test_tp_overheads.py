"""Tensor parallelism's fixed costs in the cost model (Note [tensor-parallel overheads] in
partitioner/solver/tensor_groups.py): DTensor's dispatch per op and a fixed cost per
collective on cpu, none on accelerators, a calibrated profile's figures over the preset's, and
the per-step gradient gathers in the step time (Note [cost model] in evaluate.py)."""

from __future__ import annotations

import pytest

from partitioner.calibrate import DeviceProfile, DirectionFit
from partitioner.calibrate.profiles import apply_profiles
from partitioner.config.cluster import DEVICE_PRESETS, ClusterSpec
from partitioner.solver import PartitionProblem, RegionCost, SolverConfig, evaluate, solve
from partitioner.solver.problem import Assignment, TensorParallelCost, region_times_s
from partitioner.solver.tensor_groups import group_cluster, sent_bytes, tp_priced_problem

MIB = 2**20


def _region(**tp):
    return RegionCost("block", 1e9, 2e9, 4 * MIB, 4 * MIB, 8 * MIB, MIB, MIB, fwd_ops=50, bwd_ops=40,
                      tp=TensorParallelCost(sharded_param_bytes=4 * MIB, comm_bytes=4096, comm_bwd_bytes=4096,
                                            fwd_collectives=2, bwd_collectives=2, **tp))


def test_a_cpu_tensor_group_pays_per_op_and_per_collective_and_an_h100_does_not():
    problem = PartitionProblem((_region(),), ())
    for kind, expect_overheads in (("cpu", True), ("h100", False)):
        cluster = ClusterSpec.homogeneous(2, kind)
        group = group_cluster(cluster, 2).devices[0]
        priced = tp_priced_problem(problem, cluster, 2).regions[0]
        bare = tp_priced_problem(PartitionProblem((_region(),), ()), cluster, 2).regions[0]
        fwd, bwd = region_times_s(priced, group, 1)
        preset, link = DEVICE_PRESETS[kind], cluster.intra_node_link
        per_collective = 2 * link.latency_s + preset.tp_collective_s
        compute_fwd = 1e9 / 2 / cluster.devices[0].flops_per_s  # all sharded: half of it per member
        f_sent, b_sent, _ = sent_bytes(bare, 2)
        drift = 1 + preset.tp_skew  # the members wait for each other per second computed
        assert fwd == pytest.approx(drift * (compute_fwd + 50 * preset.dtensor_op_s)
                                    + f_sent / link.bandwidth_bytes_per_s + 2 * per_collective)
        assert bwd == pytest.approx(drift * (2 * compute_fwd + 40 * preset.dtensor_op_s)
                                    + b_sent / link.bandwidth_bytes_per_s + 2 * per_collective)
        assert (preset.dtensor_op_s > 0 and preset.tp_collective_s > 0 and preset.tp_skew > 0) == expect_overheads
        assert expect_overheads or (preset.dtensor_op_s, preset.tp_collective_s, preset.tp_skew) == (0, 0, 0)
    assert tp_priced_problem(problem, ClusterSpec.homogeneous(2, "cpu"), 1) is problem  # tp 1: unchanged


def test_calibrated_overheads_replace_the_presets_and_survive_the_profile_file(tmp_path):
    fit = DirectionFit(0.0, 0.0, 0.0, 0.0)
    profile = DeviceProfile("cpu", fit, fit, dtensor_op_s=1e-3, tp_collective_s=5e-3, tp_skew=0.25)
    again = DeviceProfile.load(profile.save(tmp_path / "cpu.profile.json"))
    assert (again.dtensor_op_s, again.tp_collective_s, again.tp_skew) == (1e-3, 5e-3, 0.25)
    from partitioner.frontend.analysis import annotate, trace_keyed
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.models.builtin import hf_llama

    workload = hf_llama(layers=1, width=32, heads=4, vocab=64, seq=8)
    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity="block", loss_outside_graph=True)
    problem = build_problem(gm, workload.example_batch_size)
    measured = apply_profiles(problem, gm, workload.example_batch_size, [again])
    assert measured.dtensor_op_s_by_kind == {"cpu": 1e-3} and measured.tp_collective_s_by_kind == {"cpu": 5e-3}
    assert measured.tp_skew_by_kind == {"cpu": 0.25}
    block = next(r for r in measured.regions if r.layer is not None)
    assert block.fwd_ops > 0 and block.bwd_ops > 0 and block.tp.fwd_collectives == 2
    cluster = ClusterSpec.homogeneous(2, "cpu")
    group = group_cluster(cluster, 2).devices[0]
    i = measured.regions.index(block)
    with_fit = region_times_s(tp_priced_problem(measured, cluster, 2).regions[i], group, 1)
    without = region_times_s(tp_priced_problem(problem, cluster, 2).regions[i], group, 1)
    preset = DEVICE_PRESETS["cpu"]
    # the profile's region seconds are 0 (a zero fit): what is left is the overheads and the bytes
    link = cluster.intra_node_link
    f_sent, _, _ = sent_bytes(block, 2)
    assert with_fit[0] == pytest.approx(1.25 * block.fwd_ops * 1e-3 + 2 * (2 * link.latency_s + 5e-3)
                                        + f_sent / link.bandwidth_bytes_per_s)
    assert without[0] > block.fwd_ops * preset.dtensor_op_s  # the preset's figures where nothing was measured


def test_the_per_step_gradient_gathers_are_in_the_step_time_of_evaluate_and_the_solver():
    cluster = ClusterSpec.homogeneous(2, "cpu", cores=2)
    plain = PartitionProblem((_region(),), ())
    gathered = PartitionProblem((_region(step_gather_bytes=MIB, step_collectives=1),), ())
    group, b = group_cluster(cluster, 2), 2
    assignment = Assignment((0,), (False,), ((0,),), 1, 1, 1, b, "1f1b")
    base = evaluate(tp_priced_problem(plain, cluster, 2), group, assignment)
    more = evaluate(tp_priced_problem(gathered, cluster, 2), group, assignment)
    link, preset = cluster.intra_node_link, DEVICE_PRESETS["cpu"]
    step_s = 2 * link.latency_s + preset.tp_collective_s + MIB / 2 / link.bandwidth_bytes_per_s
    assert more.step_time_s - base.step_time_s == pytest.approx(step_s)
    assert more.stages[0].step_s == pytest.approx(step_s)
    # the solver prices its plan with it too
    solution = solve(gathered, cluster, b, tp_degrees=(2,), num_stages=1, microbatches=1,
                     config=SolverConfig(time_limit_s=5))
    assert solution.tensor_parallel == 2 and solution.step_time_s == pytest.approx(more.step_time_s, rel=1e-3)
    # and the ILP's objective has it (check_assignment refuses an objective that disagrees with evaluate)
    from partitioner.solver.check import check_assignment

    assert solution.objective is not None
    check_assignment(tp_priced_problem(gathered, cluster, 2), group, solution)


def test_measuring_dtensor_op_cost_reads_the_regions_sharded_bytes():
    """`--calibrate` without `--stages` measures DTensor's per-op cost on the whole model; it read
    ``r.tp`` on a RegionRow (which has ``tp_sharded_param_bytes``) and crashed with AttributeError."""
    from partitioner.calibrate.tp_overheads import measure_dtensor_op_s
    from partitioner.frontend.analysis import annotate, trace_keyed
    from partitioner.models.builtin import hf_llama

    workload = hf_llama(layers=1, width=32, heads=4, vocab=64, seq=8)
    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity="block", loss_outside_graph=True)
    seconds = measure_dtensor_op_s(gm, workload.example_args, repeats=1, warmup=0)
    assert seconds is not None and seconds >= 0.0
