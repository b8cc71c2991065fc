"""Tensor parallelism in the search (Note [one enumeration] in partitioner/solver/space.py, Note
[tensor-parallel pricing] in partitioner/solver/tensor_groups.py): the solver picks tp > 1 where
memory forces it, the priced terms match a hand computation, and inspect shows the layout."""

from __future__ import annotations

import dataclasses

import pytest

import partitioner
from partitioner.config.cluster import GIB, ClusterSpec
from partitioner.errors import PartitionInfeasibleError
from partitioner.inspect import inspect_json, table
from partitioner.models.builtin import hf_llama
from partitioner.solver import Edge, PartitionProblem, RegionCost, SolverConfig, evaluate, solve
from partitioner.solver.problem import Assignment, TensorParallelCost, region_times_s
from partitioner.solver.space import SearchSpace, Variant
from partitioner.solver.tensor_groups import degrees_to_search, group_cluster, tp_priced_problem

MIB = 2**20
FAST = SolverConfig(time_limit_s=5)


def _block(name, *, param, comm=0, fwd=1e9, act=MIB, opt=2):
    return RegionCost(name, fwd, 2 * fwd, param, param, opt * param, act, act, layer=None,
                      tp=TensorParallelCost(comm_bytes=comm, sharded_param_bytes=param))


def _two_blocks(param, opt=2):
    return PartitionProblem((_block("b0", param=param, comm=4096, opt=opt),
                             _block("b1", param=param, comm=4096, opt=opt)),
                            (Edge(0, 1, 4096),))


def _h100s(n, memory_bytes):
    return ClusterSpec.from_dict({"group": [{"kind": "h100", "count": n, "memory_bytes": memory_bytes,
                                            "usable_memory_fraction": 1.0, "memory_reserve_bytes": 0}]})


def test_the_search_picks_tensor_parallelism_where_memory_forces_it():
    # Each block holds 4 x 400 MiB of parameters, gradients and AdamW state: 1.6 GiB on one 1 GiB
    # device (2 stages, at most: two blocks), 1.2 GiB with the state sharded over 2 replicas; a
    # tensor group of 2 holds 0.8 GiB per member (2 stages of a group of 2 on the 4 devices).
    problem, cluster = _two_blocks(400 * MIB), _h100s(4, GIB)
    with pytest.raises(PartitionInfeasibleError):
        solve(problem, cluster, 4, shard="auto", config=FAST)
    sol = solve(problem, cluster, 4, shard="auto", tp_degrees=(1, 2), config=FAST)
    assert (sol.tensor_parallel, sol.num_stages, sol.dp) == (2, 2, 1)
    assert sol.status == "OPTIMAL" and "tensor-parallel degrees 1, 2" in sol.optimal_over
    # the figures are of the tensor group's problem: each member holds half the bytes, under 1 GiB
    assert sol.stages[0].memory_bytes / 2 < GIB
    tried = {(r.tensor_parallel, r.num_stages, r.dp) for r in sol.candidates}
    assert (1, 2, 2) in tried and (2, 1, 2) in tried  # pp x dp and tp x dp were weighed too


def test_with_room_the_search_keeps_tp_one_when_its_collectives_cost_more():
    # Every byte fits one device: tp 2 halves compute but adds its all-reduces; pp 2 / dp 2 win
    # unless the collectives are free. The chosen plan is OPTIMAL over both degrees.
    problem = _two_blocks(MIB)
    problem = PartitionProblem(tuple(dataclasses.replace(r, tp=dataclasses.replace(r.tp, comm_bytes=10**9)) for r in problem.regions),
                               problem.edges)
    sol = solve(problem, _h100s(2, 80 * GIB), 4, shard="auto", tp_degrees=(1, 2), config=FAST)
    assert sol.tensor_parallel == 1 and sol.status == "OPTIMAL"


def test_priced_terms_match_a_hand_computation():
    cluster = ClusterSpec.homogeneous(8, "h100")
    rate, link = cluster.devices[0].flops_per_s, cluster.intra_node_link
    region = RegionCost("b", 3e12, 6e12, 100 * MIB, 100 * MIB, 200 * MIB, 8 * MIB, 2 * MIB,
                        tp=TensorParallelCost(comm_bytes=16 * MIB, sharded_param_bytes=75 * MIB,  # 3/4 sharded
                                              sharded_activation_bytes_per_sample=6 * MIB,
                                              comm_bwd_bytes=16 * MIB, fwd_collectives=1, bwd_collectives=1))
    problem = PartitionProblem((region,), ())
    tp, b = 4, 2
    priced = tp_priced_problem(problem, cluster, tp).regions[0]
    group = group_cluster(cluster, tp).devices[0]
    fwd_s, bwd_s = region_times_s(priced, group, b)
    compute_fraction = 0.75 / tp + 0.25  # sharded part / tp, the rest whole on every member
    ring_s = 2 * (tp - 1) / tp * 16 * MIB / link.bandwidth_bytes_per_s  # per sample, each direction
    latency_s = 2 * (tp - 1) * link.latency_s  # per collective: one each direction (h100: no fixed cost)
    assert fwd_s == pytest.approx(b * (3e12 * compute_fraction / rate + ring_s) + latency_s)
    assert bwd_s == pytest.approx(b * (6e12 * compute_fraction / rate + ring_s) + latency_s)
    # bytes per group: the sharded 75 MiB once, the 25 MiB replicated on each of the 4 members
    assert priced.param_bytes == 75 * MIB + 4 * 25 * MIB
    assert priced.optimizer_bytes == 2 * priced.param_bytes
    # activations: the split 6 MiB once per group, the other 2 MiB whole on each member
    assert priced.activation_bytes_per_sample == 6 * MIB + 4 * 2 * MIB
    # evaluate prices a one-stage plan on one group with exactly those seconds
    assignment = Assignment((0,), (False,), ((0,),), 1, 1, 1, b, "1f1b")
    cost = evaluate(tp_priced_problem(problem, cluster, tp), group_cluster(cluster, tp), assignment)
    assert cost.stages[0].compute_s == pytest.approx(fwd_s + bwd_s)


def test_the_activations_between_column_and_row_linears_are_the_split_ones():
    from partitioner.frontend.analysis import annotate, trace_keyed
    from partitioner.calibrate.priced_problem import build_problem
    from passes import ir
    from passes.tp_activations import split_nodes

    workload = hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8)
    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity="block", loss_outside_graph=True)
    split = split_nodes(gm)
    roles = {n: ir.get(n, ir.TP).role for n in gm.graph.nodes}
    assert any(roles[n] == "column" for n in split)
    assert not any(roles[n] in ("row", "vocab") for n in split)  # all-reduced / gathered: whole
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert sdpa and all(n in split for n in sdpa)  # per-head attention: split on heads
    problem = build_problem(gm, workload.example_batch_size)
    blocks = [r for r in problem.regions if r.layer is not None]
    assert all(0 < r.tp.sharded_activation_bytes_per_sample < r.activation_bytes_per_sample for r in blocks)
    assert problem.regions[0].tp.sharded_activation_bytes_per_sample == 0  # the embedding's output is whole


def test_degrees_stay_within_a_node_and_divide_what_is_split():
    cluster = ClusterSpec.homogeneous(16, "h100", devices_per_node=8)
    assert degrees_to_search(cluster) == (1, 2, 4, 8)
    assert degrees_to_search(cluster, lambda tp: 12 % tp == 0) == (1, 2, 4)  # 12 heads
    assert degrees_to_search(ClusterSpec.homogeneous(12, "h100", devices_per_node=6)) == (1, 2, 3, 6)


def test_sharding_is_a_relaxation_on_nccl_and_not_on_gloo():
    problem = _two_blocks(MIB)
    assert SearchSpace(problem, _h100s(4, GIB), shard="auto").variants(2) == [Variant(1, True)]
    cpu = ClusterSpec.homogeneous(4, "cpu")
    assert SearchSpace(problem, cpu, shard="auto").variants(2) == [Variant(1, False), Variant(1, True)]
    # tp > 1 with dp > 1 only where the runtime runs it
    assert SearchSpace(problem, _h100s(4, GIB), shard="off", tp_degrees=(1, 2), tp_dp=False).variants(2) == \
        [Variant(1, False)]


def test_inspect_shows_tensor_groups_stages_and_replicas(tmp_path):
    # fp32 on cpu: what the program runs with tensor parallelism (Note [what tensor parallelism
    # runs with]); 4 ranks as 2 stages of a tensor group of 2
    workload = hf_llama(layers=2, width=32, heads=4, vocab=64, seq=8)
    plan = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(4, "cpu"), global_batch=4,
                               num_stages=2, tensor_parallel=2, solver_config=FAST).plan
    assert (plan.tensor_parallel, plan.num_stages, plan.world_size) == (2, 2, 4)
    text = table(plan)
    assert "2 stage(s) x 1 data-parallel x 2 tensor-parallel = 4 rank(s)" in text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "tensor group ranks" in line)
    assert lines[at + 1].split() == ["0", "0", "0-1"] and lines[at + 2].split() == ["1", "0", "2-3"]
    layout = inspect_json(plan)["layout"]
    assert layout["tensor_parallel"] == 2 and layout["world_size"] == 4
    assert layout["tensor_groups"] == [{"stage": 0, "replica": 0, "ranks": [0, 1]},
                                       {"stage": 1, "replica": 0, "ranks": [2, 3]}]


def test_one_enumeration_finds_the_best_of_the_separate_searches():
    # Blocks of 150 MiB parameters, as much gradient and 6 x as much optimizer state (fp32 AdamW
    # of 2-byte weights) on 1 GiB devices: a stage per block needs 1200 MiB unsharded, 900 MiB
    # sharded over 2 replicas (with the whole flat gradient in the step). The one search must find what solving the unsharded
    # space and each sharded dp degree separately finds, and call it OPTIMAL only as a proof.
    from partitioner.solver.zero_choice import dp_degrees_for_test, sharded_problem

    problem, cluster = _two_blocks(150 * MIB, opt=6), _h100s(4, GIB)
    one = solve(problem, cluster, 4, shard="auto", config=FAST)
    separate = []
    for d in dp_degrees_for_test(cluster, 4):
        try:
            separate.append(solve(sharded_problem(problem, d), cluster, 4, dp=d, config=FAST).step_time_s)
        except PartitionInfeasibleError:
            pass
    assert one.shard_optimizer and one.dp > 1 and one.status == "OPTIMAL"
    assert one.step_time_s == pytest.approx(min(separate))


def test_a_timeout_beside_memory_failures_is_reported_as_a_timeout():
    from partitioner.solver.solution import CandidateRecord
    from partitioner.solver.solve import _raise_infeasible

    problem, cluster = _two_blocks(400 * MIB), _h100s(4, GIB)
    space = SearchSpace(problem, cluster, shard="auto")
    infeasible = CandidateRecord(2, 1, 4, 1, "INFEASIBLE", None, float("inf"), 0.0)
    timed_out = CandidateRecord(2, 2, 2, 1, "UNKNOWN", None, 1.0, 5.0, shard_optimizer=True)
    with pytest.raises(PartitionInfeasibleError, match="time limit, not a proof") as err:
        _raise_infeasible(space, 4, [infeasible, timed_out], "1f1b", FAST)
    assert err.value.timed_out
    # the same candidate solved again and then proven infeasible: a memory failure after all
    again = CandidateRecord(2, 2, 2, 1, "INFEASIBLE", None, 1.0, 5.0, shard_optimizer=True)
    with pytest.raises(PartitionInfeasibleError, match="no partition fits in memory") as err:
        _raise_infeasible(space, 4, [infeasible, timed_out, again], "1f1b", FAST)
    assert not err.value.timed_out


def test_schedule_auto_is_not_optimal_when_the_other_schedule_timed_out():
    from partitioner.solver.schedule_choice import solve_any_schedule

    problem = _two_blocks(MIB)

    def solve_gpipe_times_out(*args, schedule, **kwargs):  # the real solve, but gpipe hit its limit
        if schedule == "gpipe":
            raise PartitionInfeasibleError("no plan found within the time limit", timed_out=True)
        return solve(*args, schedule=schedule, **kwargs)

    auto = solve_any_schedule(solve_gpipe_times_out, problem, _h100s(2, 80 * GIB), 4, config=FAST)
    assert auto.schedule == "1f1b" and auto.status == "FEASIBLE"


def test_compile_picks_tensor_parallelism_when_no_pipeline_or_replica_plan_fits():
    # One Llama block of ~0.8 M parameters with AdamW: ~13.7 MiB on one rank, and dp 2 with
    # sharded state still needs the whole block per rank; a tensor group of 2 holds ~7 MiB each.
    # The user gives no --tp: compile weighs the degrees the program runs (fp32 on cpu).
    workload = hf_llama(layers=1, width=256, heads=4, vocab=64, seq=8)
    cluster = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2, "memory_bytes": 8 * MIB,
                                                "usable_memory_fraction": 1.0, "memory_reserve_bytes": 0}]})
    with pytest.raises(PartitionInfeasibleError, match="no partition fits in memory"):
        partitioner.compile(workload, cluster=cluster, global_batch=2, tensor_parallel=1, solver_config=FAST)
    plan = partitioner.compile(workload, cluster=cluster, global_batch=2, solver_config=FAST).plan
    assert (plan.tensor_parallel, plan.world_size) == (2, 2)
    assert "tensor-parallel degrees 1, 2" in plan.solver["optimal_over"]
    for stage in plan.stages:  # the plan's memory is per rank: each member of the group under its 8 MiB
        assert stage.memory_capacity_bytes == 8 * MIB and stage.peak_memory_bytes <= 8 * MIB
    assert [r["tp_index"] for r in plan.rank_layout()] == [0, 1]
