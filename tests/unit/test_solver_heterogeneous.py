"""On heterogeneous multi-node clusters OPTIMAL is a proof over ``evaluate`` (every split and
every device grid, exhaustive search as the reference), and every bound is a bound
(Note [exact placements] in partitioner/solver/placements.py)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hetero_instances import exhaustive_optimum, het_cluster, random_chain  # noqa: E402

from partitioner.solver import SolverConfig, solve, solve_candidate  # noqa: E402
from partitioner.config.cluster import ClusterSpec  # noqa: E402
from partitioner.solver.placements import enumerate_placements, is_launchable  # noqa: E402

M, B = 8, 4


def check_against(solution, status, optimum):
    """Bound <= optimum; OPTIMAL only at the optimum (both to the ILP's rounding)."""
    slack = solution.rounding_slack_units * solution.time_unit_s
    assert solution.bound * solution.time_unit_s <= optimum + slack, (solution.bound, optimum)
    assert solution.step_time_s >= optimum * (1 - 1e-9)  # no plan beats the exhaustive optimum
    if status == "OPTIMAL":
        assert solution.step_time_s <= optimum + slack, (solution.step_time_s, optimum)


@pytest.mark.parametrize("seed", range(15))
def test_four_stages_on_two_h100_and_two_a100_nodes_is_the_exhaustive_optimum(seed):
    problem, cluster = random_chain(seed), het_cluster(memory_gib_a100=40 if seed % 3 else 12)
    optimum = exhaustive_optimum(problem, cluster, p=4, d=1, m=M, b=B)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=4, dp=1, num_microbatches=M,
                                          global_batch=M * B, config=SolverConfig(allow_recompute=False))
    if math.isinf(optimum):
        assert solution is None and status == "INFEASIBLE"
        return
    assert status == "OPTIMAL"  # a few placements, each solved exactly
    check_against(solution, status, optimum)


@pytest.mark.parametrize("seed, p, d", [(100, 2, 2), (101, 3, 1), (102, 2, 1)])
def test_other_depths_and_data_parallel_match_exhaustive_search(seed, p, d):
    problem, cluster = random_chain(seed), het_cluster()
    optimum = exhaustive_optimum(problem, cluster, p=p, d=d, m=M, b=B)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=p, dp=d, num_microbatches=M,
                                          global_batch=M * B * d, config=SolverConfig(allow_recompute=False))
    assert status == "OPTIMAL"
    check_against(solution, status, optimum)


@pytest.mark.parametrize("seed", range(5))
def test_relaxation_bound_is_a_bound_and_optimal_only_when_optimal(seed):
    """Too many placements (max_placements=1): the class-choice model on the fastest links."""
    problem, cluster = random_chain(seed), het_cluster()
    optimum = exhaustive_optimum(problem, cluster, p=4, d=1, m=M, b=B)
    solution, status, _ = solve_candidate(
        problem, cluster, num_stages=4, dp=1, num_microbatches=M, global_batch=M * B,
        config=SolverConfig(allow_recompute=False, max_placements=1, time_limit_s=1.0))
    assert solution is not None and status in ("OPTIMAL", "FEASIBLE")
    check_against(solution, status, optimum)


def test_solve_over_every_stage_count_is_the_exhaustive_optimum():
    problem, cluster = random_chain(7), het_cluster()
    optimum = min(exhaustive_optimum(problem, cluster, p=p, d=1, m=M, b=B) for p in range(1, 5))
    solution = solve(problem, cluster, M * B, dp=1, microbatches=M, config=SolverConfig(allow_recompute=False))
    assert solution.status == "OPTIMAL"
    check_against(solution, solution.status, optimum)
    assert "every placement of stages on devices" in solution.optimal_over


def test_placements_are_the_launchable_label_grids():
    """Of the 4! / (2! 2!) = 6 orders of H, H, A, A only HHAA and AAHH give each node consecutive
    ranks (torchrun's blocks; Note [exact placements])."""
    cluster = het_cluster()
    assert enumerate_placements(cluster, 4, 1) == [((0,), (1,), (2,), (3,)), ((2,), (3,), (0,), (1,))]
    assert len(enumerate_placements(cluster, 3, 1)) == 4  # HHA, HAA, AHH, AAH
    assert enumerate_placements(cluster, 2, 2) == [((0, 1), (2, 3)), ((2, 3), (0, 1))]
    mixed = ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 2, "node": 0},
                                             {"kind": "a100-40gb", "count": 2, "node": 0},
                                             {"kind": "h100", "count": 4, "node": 1}]})
    placements = enumerate_placements(mixed, 4, 1, limit=10_000)
    assert placements and all(is_launchable(mixed, pl) for pl in placements)
    assert ((0,), (2,), (1,), (3,)) not in placements  # H, A, H, A on node 0: not cuda:0..3 in order
    assert enumerate_placements(cluster, 1, 4) == []  # no class has 4 devices
    many = ClusterSpec.from_dict({"group": [{"kind": kind, "count": 1, "node": node}
                                            for node in range(4) for kind in ("h100", "a100-40gb")]})
    assert enumerate_placements(many, 8, 1, limit=10) is None  # too many: the relaxation


def test_compile_on_a_heterogeneous_two_node_cluster_file_from_the_cli(tmp_path, capsys):
    """Was a TypeError traceback (float(None)) when a hint beat the ILP on such a cluster."""
    import json

    from partitioner.cli import main

    (tmp_path / "het.toml").write_text('[[group]]\nkind = "h100"\ncount = 2\nnode = 0\n\n'
                                       '[[group]]\nkind = "a100-40gb"\ncount = 2\nnode = 1\n')
    out = tmp_path / "out"
    assert main(["compile", "mlp", "--cluster", str(tmp_path / "het.toml"), "--stages", "4", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "optimal over" in text and "every placement of stages on devices" in text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["num_stages"] == 4 and plan["solver"]["status"] == "OPTIMAL"
    assert plan["solver"]["bound"] <= plan["solver"]["objective"]
    kinds = [stage["device"] for stage in plan["stages"]]
    assert sorted(kinds) == ["a100-40gb", "a100-40gb", "h100", "h100"]
    # each node runs a block of consecutive ranks, and the folder's README says which
    nodes = [stage["nodes"][0] for stage in plan["stages"]]
    assert nodes in ([0, 0, 1, 1], [1, 1, 0, 0])
    readme = (out / "README.md").read_text()
    first = nodes[0]
    assert f"- cluster node {first}: --node-rank 0 --nproc-per-node 2, ranks 0..1" in readme
    assert f"- cluster node {1 - first}: --node-rank 1 --nproc-per-node 2, ranks 2..3" in readme


@pytest.mark.parametrize("p", [1, 2])
def test_class_choice_on_one_node_prices_each_class_own_per_step_seconds(p):
    """Was InconsistentBoundError (a traceback from `compile` on 8 x H100 + 8 x A100): with the class a
    variable, the per-step seconds (step_s_by_kind: the optimizer step) were priced at the most of any
    class, so the one-node model, exact otherwise, bounded the H100 plan above its own cost."""
    from dataclasses import replace

    cluster = ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 2, "node": 0},
                                               {"kind": "a100-40gb", "count": 2, "node": 0}]})
    problem = random_chain(3)
    problem = replace(problem, regions=tuple(replace(r, step_s_by_kind={"h100": 2e-3, "a100-40gb": 9e-3})
                                             for r in problem.regions))
    optimum = exhaustive_optimum(problem, cluster, p=p, d=1, m=M, b=B)
    solution, status, _ = solve_candidate(problem, cluster, num_stages=p, dp=1, num_microbatches=M,
                                          global_batch=M * B, config=SolverConfig(allow_recompute=False))
    assert status == "OPTIMAL" and solution.bound <= solution.objective  # exact on one node
    check_against(solution, status, optimum)
