"""The recompute fixed cost (Note [recompute fixed cost] in partitioner/solver/recompute_cost.py):
every pricer charges it, and it changes what the solver recomputes."""

import dataclasses
import itertools

import pytest

from partitioner.config.cluster import DEVICE_PRESETS, ClusterSpec
from partitioner.solver import (Assignment, Edge, PartitionProblem, RegionCost, SolverConfig, evaluate,
                                place_stages, solve_candidate)
from partitioner.solver.bounds import candidate_lower_bound_s
from partitioner.solver.chain_dp import chain_lower_bound_s, has_chain_backbone, solve_chain_dp
from partitioner.solver.recompute_cost import recompute_fixed_s, recompute_s
from tests.unit.test_solver_bruteforce import all_plans, best_fitting, cluster_for, random_instance, tight_capacity

MIB = 2**20
CPU_FLOPS = DEVICE_PRESETS["cpu"].flops_per_s


def _region(name, fwd_ms, activation_mib, savable):
    flops = fwd_ms * 1e-3 * CPU_FLOPS
    return RegionCost(name, flops, 2 * flops, 0, 0, 0, activation_mib * MIB, 0 if savable else activation_mib * MIB)


def _one_big_or_two_small(fixed_s):
    """One stage under GPipe (4 microbatches in flight), 32 MiB: it fits by recomputing either the
    big region a (4 ms, frees 4 MiB a microbatch) or both small ones b and c (1.5 ms and 2 MiB
    each), not by one small one alone. Without a fixed term b + c is cheaper (3 ms < 4 ms); with
    2 ms a region, a is (6 ms < 7 ms)."""
    regions = (_region("a", 4, 4, True), _region("b", 1.5, 2, True), _region("c", 1.5, 2, True),
               _region("d", 1, 3, False))
    problem = PartitionProblem(regions, tuple(Edge(i, i + 1, 0) for i in range(3)),
                               recompute_fixed_s_by_kind={"cpu": fixed_s})
    cluster = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 1, "memory_bytes": 32 * MIB}]})
    return problem, cluster


@pytest.mark.parametrize("fixed_s, recomputed", [(0.0, (False, True, True, False)), (2e-3, (True, False, False, False))])
def test_the_fixed_term_makes_the_solver_recompute_fewer_regions(fixed_s, recomputed):
    problem, cluster = _one_big_or_two_small(fixed_s)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=1, dp=1, num_microbatches=4, global_batch=4,
                                          schedule="gpipe", config=SolverConfig(time_limit_s=10))
    assert status == "OPTIMAL"
    assert solution.recompute == recomputed
    plain = evaluate(problem, cluster, Assignment((0,) * 4, (False,) * 4, place_stages(cluster, 1, 1), 1, 1, 4, 1,
                                                  "gpipe"))
    fwd = sum(r.fwd_flops_per_sample / CPU_FLOPS for r, rc in zip(problem.regions, recomputed) if rc)
    assert solution.step_time_s == pytest.approx(plain.step_time_s + 4 * (fwd + fixed_s * sum(recomputed)))
    dp = solve_chain_dp(problem, cluster, num_stages=1, num_microbatches=4, microbatch_size=1, schedule="gpipe",
                        recompute="greedy")
    assert dp.step_time_s >= solution.step_time_s - 1e-12  # the greedy DP is a heuristic: never better


def test_fixed_term_by_kind_wins_over_the_preset():
    problem, cluster = _one_big_or_two_small(0.25)
    device = cluster.devices[0]
    assert recompute_fixed_s(problem, device) == 0.25
    assert recompute_fixed_s(dataclasses.replace(problem, recompute_fixed_s_by_kind=None), device) \
        == DEVICE_PRESETS["cpu"].recompute_fixed_s > 0
    assert recompute_s(problem, problem.regions[0], device, 2) == pytest.approx(2 * 4e-3 + 0.25)


@pytest.mark.parametrize("seed", [203, 205, 208])
def test_ilp_matches_brute_force_with_a_large_fixed_term(seed):
    """Exhaustive: every split x every recompute choice, the fixed term as large as a region's
    forward (the instances' forwards are 10..60 ms on cpu), memory between the smallest peak with
    recompute and the smallest without (so every fitting plan recomputes); the ILP's optimum is
    the brute-force best, and the chain DP's and the candidate's lower bounds stay below it."""
    n, p, m = 5, 2, 4
    problem = dataclasses.replace(random_instance(seed, n), recompute_fixed_s_by_kind={"cpu": 30e-3})
    every = list(itertools.product((False, True), repeat=n))
    free = all_plans(problem, cluster_for(p, 1, 2**50), p=p, d=1, m=m, b=1, schedule="1f1b", recompute_options=every)
    plain = all_plans(problem, cluster_for(p, 1, 2**50), p=p, d=1, m=m, b=1, schedule="1f1b",
                      recompute_options=[(False,) * n])
    capacity = int((min(peak for _, peak in free) + min(peak for _, peak in plain)) / 2)
    cluster = cluster_for(p, 1, capacity)
    best = best_fitting(all_plans(problem, cluster, p=p, d=1, m=m, b=1, schedule="1f1b", recompute_options=every),
                        capacity)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=p, dp=1, num_microbatches=m,
                                          global_batch=m, config=SolverConfig(time_limit_s=10))
    assert status == "OPTIMAL" and any(solution.recompute)
    assert solution.step_time_s == pytest.approx(best, rel=1e-5)
    without_term = evaluate(dataclasses.replace(problem, recompute_fixed_s_by_kind={"cpu": 0.0}), cluster,
                            Assignment(solution.stage_of_region, solution.recompute, solution.device_of_stage_replica,
                                       p, 1, m, 1, "1f1b"))
    assert solution.step_time_s > without_term.step_time_s  # the term is priced
    placement = place_stages(cluster, p, 1)
    bound = candidate_lower_bound_s(problem, cluster, num_stages=p, dp=1, num_microbatches=m, microbatch_size=1,
                                    schedule="1f1b")
    assert bound <= best * (1 + 1e-9)
    if has_chain_backbone(problem):
        pipeline = chain_lower_bound_s(problem, cluster, num_stages=p, num_microbatches=m, microbatch_size=1,
                                       schedule="1f1b", placement=placement)
        assert pipeline <= best * (1 + 1e-9)


def test_calibration_measures_the_fixed_term_and_the_profile_carries_it(tmp_path):
    """calibrate's region rows time the region under runtime.execute.recompute.checkpointed too; the fit
    is the median of (extra - fitted forward) floored at 0; the profile file keeps it and
    ``apply_profiles`` hands it to the problem, where it wins over the preset."""
    import partitioner.calibrate as cal
    from partitioner.frontend.analysis import analyze
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.models.builtin import gpt

    workload = gpt(layers=1, width=16, heads=2, vocab=32, seq=8, batch=2)
    gm, _ = analyze(workload)
    rows = cal.measure(workload, gm, warmup=0, repeats=2, single_ops=False)
    regions = [r for r in rows if r["kind"] == "region"]
    assert len(regions) == 3  # embed, block.0, head
    assert all(r["checkpointed_s"] > 0 and r["plain_s"] > 0 and "recompute_extra_s" in r for r in regions)

    forward = cal.DirectionFit(0.0, 0.0, 0.0, 1e-6)  # 1 us per op: a known fitted forward
    synthetic = [dict(r, recompute_extra_s=extra) for r, extra in zip(regions, [5e-3, 2e-3, -1.0])]
    # The median of (5 ms, 2 ms, floored at 0) less each region's fitted forward: block.0's.
    assert cal.fit_recompute_fixed_s(synthetic, forward) == pytest.approx(
        2e-3 - synthetic[1]["fwd_features"]["num_ops"] * 1e-6)
    assert cal.fit_recompute_fixed_s([r for r in rows if r["kind"] != "region"], forward) is None

    profile = cal.DeviceProfile(kind="cpu", forward=forward, backward=forward, recompute_fixed_s=0.7e-3)
    loaded = cal.DeviceProfile.load(profile.save(tmp_path / "cpu.profile.json"))
    assert loaded.recompute_fixed_s == 0.7e-3
    problem = build_problem(gm, 2, profiles=[loaded])
    device = ClusterSpec.homogeneous(1, "cpu").devices[0]
    assert recompute_fixed_s(problem, device) == 0.7e-3 != DEVICE_PRESETS["cpu"].recompute_fixed_s
    unmeasured = build_problem(gm, 2, profiles=[dataclasses.replace(loaded, recompute_fixed_s=None)])
    assert recompute_fixed_s(unmeasured, device) == DEVICE_PRESETS["cpu"].recompute_fixed_s
