"""Note [terms outside the ILP] (partitioner/solver/space.py): the global gradient norm and the
replica check are in the plan's predicted step, so the search weighs them between candidates: the
plan it returns is never slower, by its own cost model, than another candidate of the request."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.config.cluster import ClusterSpec, LinkSpec
from partitioner.solver import SolverConfig, evaluate, solve
from partitioner.solver.problem import Edge, PartitionProblem, RegionCost
from partitioner.solver.space import StepTerms

MIB = 2**20


def _problem():
    """Two regions of little compute and many gradient bytes: the norm pass (10 GB/s on cpu) over
    one stage holding all of them outweighs what a second replica saves in compute."""
    regions = tuple(RegionCost(f"r{i}", 2e7, 4e7, 256 * MIB, 256 * MIB, 512 * MIB, 1024, 1024) for i in range(2))
    return PartitionProblem(regions, (Edge(0, 1, 1024),))


def _cluster():
    fast = LinkSpec(1e13, 0.0)  # the all-reduce and the sends nearly free: only the norm decides
    cluster = ClusterSpec.homogeneous(2, "cpu", cores=2)
    return dataclasses.replace(cluster, intra_node_link=fast, inter_node_link=fast)


def _full_s(solution, problem, cluster):
    return evaluate(problem, cluster, solution.assignment, global_norm=True).step_time_s


def test_the_search_weighs_the_gradient_norm_between_candidates():
    problem, cluster = _problem(), _cluster()
    config = SolverConfig(time_limit_s=5)
    blind = solve(problem, cluster, 4, config=config)
    seeing = solve(problem, cluster, 4, config=config, step_terms=StepTerms(global_norm=True))
    # without the term the search keeps one stage x dp 2 (half the compute each), which the norm
    # over every gradient byte on that one stage makes the slower plan of the two
    assert (blind.num_stages, blind.dp) == (1, 2)
    assert (seeing.num_stages, seeing.dp) == (2, 1)
    assert _full_s(seeing, problem, cluster) < _full_s(blind, problem, cluster)
    for p, d in ((1, 1), (1, 2), (2, 1)):
        pinned = solve(problem, cluster, 4, num_stages=p, dp=d, config=config)
        assert _full_s(seeing, problem, cluster) <= _full_s(pinned, problem, cluster) * (1 + 1e-9)
    assert "the gradient norm weighed between candidates" in seeing.optimal_over


def test_baselines_split_the_plans_own_tensor_groups_with_its_step_terms():
    """Note [fair baselines] holds: with --tp 2 --stages 1 the one-stage baselines are the plan itself
    (same tensor groups, same gradient norm and replica check), not tp 1 on half the devices."""
    from partitioner import compile
    from partitioner.models.builtin import gpt

    plan = compile(gpt(layers=2, width=64, heads=4, vocab=128, seq=16), cluster=ClusterSpec.homogeneous(8, "h100"),
                   global_batch=16, tensor_parallel=2, num_stages=1, dp=4, clip_grad_norm=1.0).plan
    ours = plan.predicted["step_time_s"]
    assert plan.tensor_parallel == 2 and plan.predicted["grad_norm_s_per_step"] > 0
    for name in ("uniform", "param_balanced"):
        assert plan.baselines[name]["step_time_s"] == pytest.approx(ours, rel=1e-9), name


def test_schedule_auto_weighs_the_terms_between_schedules():
    """As Note [schedule choice] asks: with one microbatch 1F1B can only run one stage (dp 2: the norm over
    every gradient byte on one stage), GPipe can run two stages (the norm split): the faster ILP
    objective is 1F1B's, the faster predicted step GPipe's, and auto must pick by the step."""
    problem, cluster = _problem(), _cluster()
    config, terms = SolverConfig(time_limit_s=5), StepTerms(global_norm=True)
    each = {s: solve(problem, cluster, 2, microbatches=1, schedule=s, config=config, step_terms=terms)
            for s in ("1f1b", "gpipe")}
    assert each["1f1b"].step_time_s < each["gpipe"].step_time_s  # the ILP alone prefers 1F1B
    chosen = solve(problem, cluster, 2, microbatches=1, schedule="auto", config=config, step_terms=terms)
    assert (chosen.schedule, chosen.num_stages, chosen.dp) == ("gpipe", 2, 1)
    for s, other in each.items():
        assert chosen.total_step_s == pytest.approx(_full_s(chosen, problem, cluster), rel=1e-9)
        assert _full_s(chosen, problem, cluster) <= _full_s(other, problem, cluster) * (1 + 1e-9), s
