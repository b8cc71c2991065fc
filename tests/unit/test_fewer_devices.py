"""A plan on fewer devices than given says why in one line (Note [fewer devices than given] in
partitioner/solver/solution.py): from the candidates the solver priced on more devices, the
fastest and what it adds, else the bound that pruned them, the time limit, memory, or the request."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.solver import Edge, PartitionProblem, RegionCost, SolverConfig, solve
from partitioner.solver.solution import CandidateRecord


def _heavy_one_region_plan():
    """One region of 100 MB of gradients and little compute on 2 cpus: dp 2's all-reduce costs more
    than the half of the compute it saves, and one region makes one stage."""
    static = 800 * 2**20
    region = RegionCost("r0", 1e6, 2e6, static // 8, static // 8, static - 2 * (static // 8), 0, 0)
    problem = PartitionProblem((region,), tuple[Edge, ...](), ())
    return solve(problem, ClusterSpec.homogeneous(2), 8, config=SolverConfig(time_limit_s=5))


def test_compile_says_why_it_uses_one_of_two_devices(tmp_path, capsys):
    assert main(["compile", "mlp", "--devices", "2", "--no-calibrate", "-o", str(tmp_path / "two")]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("devices: ")]
    assert len(lines) == 1, out
    assert lines[0].startswith("devices: the plan uses 1 of 2 devices: ") and "dp 2" in lines[0], lines[0]
    assert " ms/step" in lines[0] and " against " in lines[0] and "more than it saves" in lines[0], lines[0]
    assert main(["compile", "mlp", "--devices", "1", "--no-calibrate", "-o", str(tmp_path / "one")]) == 0
    assert "devices: " not in capsys.readouterr().out  # every device used: nothing to explain


def test_each_reason_from_the_candidates():
    sol = _heavy_one_region_plan()
    assert (sol.num_stages, sol.dp, sol.tensor_parallel) == (1, 1, 1)
    assert sol.fewer_devices_line(1) is None
    line = sol.fewer_devices_line(2)
    assert line.startswith("the plan uses 1 of 2 devices: ") and "dp 2" in line, line

    ours = sol.total_step_s

    def record(dp, status, step_s=None, lower=0.0, stages=1, tp=1):
        return CandidateRecord(stages, dp, 1, 8 // dp, status, step_s, lower, 0.0, tensor_parallel=tp)

    def line_of(*records):
        return dataclasses.replace(sol, candidates=(record(1, "OPTIMAL", ours),) + records).fewer_devices_line(2)

    priced = line_of(record(2, "OPTIMAL", 2 * ours), record(2, "OPTIMAL", 3 * ours, stages=2))
    assert f"1 stage x dp 2 on 2, would be predicted {2 * ours * 1e3:.4g} ms/step against " \
           f"{ours * 1e3:.4g} ms/step (dp 2's gradient all-reduce costs more than it saves)" in priced, priced
    both = line_of(record(2, "OPTIMAL", 2 * ours, stages=2, tp=2))
    assert "tp 2 x 2 stages x dp 2 on 8," in both, both  # 2 stages x dp 2 x tp 2 = 8 ranks
    assert "dp 2's gradient all-reduce and 2 stages' transfers and bubble and tp 2's collectives cost more " \
           "than they save" in both, both
    pruned = line_of(record(2, "PRUNED", lower=1.5 * ours))
    assert "no plan on more can be faster: the best of them, 1 stage x dp 2 on 2, is at least " in pruned, pruned
    assert "by its lower bound" in pruned
    assert "--time-limit" in line_of(record(2, "SKIPPED", lower=0.5 * ours))
    assert "fits in memory" in line_of(record(2, "INFEASIBLE", lower=float("inf")))
    assert "no plan on more was open to the solver" in line_of()


@pytest.mark.parametrize("stages, dp, tp, local, ranks", [(2, 1, 1, 1, 2), (4, 1, 1, 2, 2), (2, 2, 2, 1, 8)])
def test_a_candidate_counts_its_devices(stages, dp, tp, local, ranks):
    rec = CandidateRecord(stages, dp, 4, 1, "OPTIMAL", 1.0, 1.0, 0.0, tensor_parallel=tp, local_stages=local)
    assert rec.ranks == ranks
