"""Interleaved 1F1B as a plan the solver makes (Note [interleaved pricing] in
partitioner/solver/interleaved.py): OPTIMAL is the optimum of exhaustive search over every split
under the same cost model, the priced time is never below torch's own order on the plan's stage
times, a rank's stages share its memory, and auto picks interleaved where its bubble wins."""

from __future__ import annotations

import itertools
import random

import pytest

from partitioner.config.cluster import ClusterSpec
from partitioner.solver import (Edge, PartitionProblem, RegionCost, SolverConfig, check_assignment, evaluate,
                                solve)
from partitioner.solver.candidates import enumerate_candidates, validate_options
from partitioner.solver.problem import Assignment
from partitioner.solver.device_layout import place_stages
from runtime.execute.schedule import timed_actions

GIB = 2**30


def _cluster(count: int, memory_bytes: int = 16 * GIB) -> ClusterSpec:
    return ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": count, "memory_bytes": memory_bytes,
                                             "cores": count}]})


def _problem(rng: random.Random, n: int) -> PartitionProblem:
    regions = []
    for i in range(n):
        fwd = rng.uniform(0.5, 3.0) * 1e9
        static = rng.randrange(1, 64) << 20
        regions.append(RegionCost(f"r{i}", fwd, rng.uniform(1.0, 3.0) * fwd, static // 4, static // 4,
                                  static // 2, rng.randrange(1, 32) << 20, 0))
    edges = tuple(Edge(i, i + 1, rng.randrange(1, 4) << 18) for i in range(n - 1))
    return PartitionProblem(tuple(regions), edges, input_bytes_per_sample=1 << 12, target_bytes_per_sample=1 << 10)


def _splits(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(s for s in range(p) for _ in range(bounds[s], bounds[s + 1]))


def _exhaustive(problem, cluster, *, p, v, m, b, d=1):
    placement = place_stages(cluster, p, d, local_stages=v)
    best = None
    for split in _splits(problem.num_regions, p):
        cost = evaluate(problem, cluster, Assignment(split, (False,) * problem.num_regions, placement,
                                                     p, d, m, b, "interleaved"))
        if cost.fits_memory and (best is None or cost.step_time_s < best):
            best = cost.step_time_s
    return best


@pytest.mark.parametrize("seed", range(5))
def test_optimal_is_the_exhaustive_optimum_with_memory_binding(seed):
    """Random chains, 2 ranks x 2 or 3 stages each, memory tight enough that some splits do not
    fit a rank: the solver's OPTIMAL plan costs what exhaustive search over every split finds,
    and its bound is not above that optimum."""
    rng = random.Random(seed)
    v = 2 + seed % 2
    n, p, m, gb = 8, 2 * v, 4, 8
    problem = _problem(rng, n)
    roomy = _cluster(2)
    placement = place_stages(roomy, p, 1, local_stages=v)
    peaks = sorted(max(evaluate(problem, roomy, Assignment(split, (False,) * n, placement, p, 1, m, gb // m,
                                                           "interleaved")).rank_memory_bytes)
                   for split in _splits(n, p))
    usable = roomy.devices[0].usable_memory_bytes / roomy.devices[0].memory_bytes
    tight = _cluster(2, int(peaks[len(peaks) // 3] / usable) + 1)  # two thirds of the splits do not fit
    config = SolverConfig(time_limit_s=10, allow_recompute=False, local_stages=v)
    sol = solve(problem, tight, gb, num_stages=p, dp=1, microbatches=m, schedule="interleaved", config=config)
    optimum = _exhaustive(problem, tight, p=p, v=v, m=m, b=gb // m)
    assert sol.status == "OPTIMAL" and sol.local_stages == v and sol.num_ranks == 2
    assert sol.step_time_s == pytest.approx(optimum, rel=1e-6)
    assert sol.bound * sol.time_unit_s <= optimum + sol.rounding_slack_units * sol.time_unit_s
    cost = check_assignment(problem, tight, sol)
    assert max(cost.rank_memory_bytes) <= tight.devices[0].usable_memory_bytes
    assert max(cost.rank_memory_bytes) > max(st.memory_bytes for st in cost.stages)  # a rank holds v stages


def test_optimal_with_data_parallelism_and_a_tie_is_the_exhaustive_optimum():
    """2 ranks x 2 stages x dp 2 on 4 devices, the first and last region sharing a parameter: the
    all-reduce is per rank (its two stages' gradients), the tie's copies are synchronised."""
    from dataclasses import replace

    from partitioner.solver import SharedParam

    rng = random.Random(11)
    problem = _problem(rng, 8)
    problem = replace(problem, ties=(SharedParam((0, 7), 8 << 20),))
    cluster = _cluster(4)
    config = SolverConfig(time_limit_s=10, allow_recompute=False, local_stages=2)
    sol = solve(problem, cluster, 16, num_stages=4, dp=2, microbatches=4, schedule="interleaved", config=config)
    optimum = _exhaustive(problem, cluster, p=4, v=2, m=4, b=2, d=2)
    assert sol.status == "OPTIMAL" and sol.num_ranks == 4
    assert sol.step_time_s == pytest.approx(optimum, rel=1e-6)
    cost = check_assignment(problem, cluster, sol)
    assert cost.dp_allreduce_s > max(st.dp_allreduce_s for st in cost.stages)  # a rank's stages together


def test_priced_time_is_never_below_torchs_order():
    """The worst-stage price bounds torch's own timeline (runtime/execute/schedule.py asks
    ScheduleInterleaved1F1B for its order) on the stage times of the solver's own plans and of
    lopsided splits."""
    rng = random.Random(7)
    for trial in range(6):
        v, m = 2 + trial % 2, (2, 4, 6)[trial % 3]
        problem = _problem(rng, 8)
        cluster = _cluster(2)
        p = 2 * v
        sol = solve(problem, cluster, m * 2, num_stages=p, dp=1, microbatches=m, schedule="interleaved",
                    config=SolverConfig(time_limit_s=5, local_stages=v))
        lopsided = next(s for i, s in enumerate(_splits(8, p)) if i == trial)
        for split in (sol.stage_of_region, lopsided):
            a = Assignment(split, (False,) * 8, place_stages(cluster, p, 1, local_stages=v), p, 1, m, 2,
                           "interleaved")
            cost = evaluate(problem, cluster, a)
            fwd = [st.forward_s for st in cost.stages]
            bwd = [st.time_s - st.forward_s for st in cost.stages]
            actions = timed_actions("interleaved", 2, p, m, lambda kind, s: fwd[s] if kind == "F" else bwd[s])
            assert max(end for *_, end in actions) <= cost.pipeline_s * (1 + 1e-9), (trial, split)


def test_rank_layout_and_candidates():
    """Stage s on pipeline position s % pp; candidates count ranks, not stages, against the devices."""
    cluster = _cluster(2)
    sol_like = Assignment((0, 1, 2, 3), (False,) * 4, place_stages(_cluster(4), 4, 2, local_stages=2),
                          4, 2, 2, 1, "interleaved")
    assert sol_like.local_stages == 2 and sol_like.pipeline_ranks == 2
    assert [sol_like.rank_of(s, r) for s in range(4) for r in range(2)] == [0, 1, 2, 3, 0, 1, 2, 3]
    problem = _problem(random.Random(1), 8)
    found = enumerate_candidates(problem, cluster, 8, None, None, None, SolverConfig(local_stages=2), "interleaved")
    assert found and all(p % 2 == 0 and p // 2 * d <= 2 and m % max(1, m // (p // 2)) == 0 for p, d, m in found)
    assert max(p for p, _, _ in found) == 4  # 2 ranks x 2 stages: more than the 2 devices' worth of stages


def test_auto_chooses_interleaved_where_the_bubble_dominates():
    """Eight equal regions, 2 devices, no data parallelism, 8 microbatches: 1F1B over 2 stages
    idles (p - 1) / (m + p - 1) of the step; interleaved's bubble is v times smaller."""
    regions = tuple(RegionCost(f"r{i}", 1e9, 2e9, 0, 0, 0, 0, 0) for i in range(8))
    problem = PartitionProblem(regions, tuple(Edge(i, i + 1, 64) for i in range(7)))
    cluster = _cluster(2)
    fast = SolverConfig(time_limit_s=5)
    one = solve(problem, cluster, 8, dp=1, microbatches=8, schedule="1f1b", config=fast)
    auto = solve(problem, cluster, 8, dp=1, microbatches=8, schedule="auto", config=fast)
    assert auto.schedule == "interleaved" and auto.step_time_s < one.step_time_s
    assert "chose interleaved" in auto.optimal_over and auto.status == "OPTIMAL"
    check_assignment(problem, cluster, auto)


def test_heterogeneous_interleaved_is_refused_with_the_fix_and_left_out_of_auto():
    mixed = ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 2}, {"kind": "a100", "count": 2}]})
    with pytest.raises(ValueError, match="one device class only.*--schedule 1f1b"):
        validate_options(mixed, 8, None, None, None, "interleaved")
    validate_options(_cluster(2), 8, 4, 1, 4, "interleaved")  # 4 stages on 2 devices: accepted
    with pytest.raises(ValueError, match="num_stages=3 .*use --stages 4 or 6"):
        validate_options(_cluster(2), 8, 3, 1, 4, "interleaved")


@pytest.mark.parametrize("num_stages", [None, 2, 4])
def test_interleaved_on_one_device_names_a_fix(num_stages):
    """No stage count runs interleaved on one device: the refusal says what does (it used to end
    in an empty 'use --stages ' list)."""
    with pytest.raises(ValueError) as info:
        validate_options(_cluster(1), 8, num_stages, 1, 4, "interleaved")
    text = str(info.value)
    assert "needs at least 2 pipeline ranks" in text and "--schedule 1f1b or gpipe" in text
    assert "--devices 2" in text and not text.rstrip().endswith("--stages")


def test_no_fit_names_the_rank_whose_stages_overflow():
    from partitioner.errors import PartitionInfeasibleError

    problem = _problem(random.Random(0), 8)
    with pytest.raises(PartitionInfeasibleError, match=r"on the rank holding stages \[\d, \d\], whose device holds"):
        solve(problem, _cluster(2, 2**27), 8, num_stages=4, dp=1, microbatches=4, schedule="interleaved",
              config=SolverConfig(time_limit_s=3, local_stages=2))
