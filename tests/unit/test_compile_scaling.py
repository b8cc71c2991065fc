"""The solver's work scales with its candidates and stages, not with the ranks (issue 48): per-device
questions are asked once per cluster (Note [cluster queries are cached] in partitioner/config/cluster.py)
and an assignment's layout once per assignment (Note [assignment layout is cached] in
partitioner/solver/problem.py). Counted calls, no clocks. The program folder holds files per stage,
none per rank (Note [roles from the plan] in runtime/launch/entry_files.py)."""

from __future__ import annotations

import sys

import pytest

from partitioner.config import device_link_specs
from partitioner.config.cluster import ClusterSpec
from partitioner.solver import Assignment, solve
from partitioner.solver.device_layout import place_stages
from partitioner.solver.evaluate import evaluate
from partitioner.solver.model import SolverConfig
from partitioner.solver.space import SearchSpace
from runtime.program.schedules import schedule_named

from test_solver_chain_dp import layered_chain


def _count_memory_questions(monkeypatch) -> list[int]:
    """Count reads of DeviceSpec.usable_memory_bytes (device_class reads it too): each is one
    device looked at."""
    calls = [0]
    original = device_link_specs.DeviceSpec.usable_memory_bytes

    def counted(self):
        calls[0] += 1
        return original.fget(self)

    monkeypatch.setattr(device_link_specs.DeviceSpec, "usable_memory_bytes", property(counted))
    return calls


def test_a_solve_looks_at_each_device_a_bounded_number_of_times(monkeypatch):
    # 256 devices: before the caches every candidate priced re-read every device (617,187 reads);
    # now each device is read a few times per solve, however many candidates there are.
    devices = 256
    cluster = ClusterSpec.homogeneous(devices, "h100")
    calls = _count_memory_questions(monkeypatch)
    result = solve(layered_chain(8), cluster, global_batch=devices)
    assert result.assignment.num_stages * result.assignment.dp <= devices
    assert calls[0] <= 16 * devices, f"{calls[0]} device reads for {devices} devices"


def test_pricing_again_reads_a_device_per_stage_not_per_rank(monkeypatch):
    """A second evaluate of an assignment on the same cluster reads one device per stage (its
    class), not its 64 ranks': links, capacities and core sharing are the cluster's memo."""
    cluster = ClusterSpec.homogeneous(64, "h100")
    problem = layered_chain(4)
    a = Assignment(tuple(i * 4 // problem.num_regions for i in range(problem.num_regions)),
                   (False,) * problem.num_regions, place_stages(cluster, 4, 16), 4, 16, 8, 1, "1f1b")
    first = evaluate(problem, cluster, a)
    calls = _count_memory_questions(monkeypatch)
    again = evaluate(problem, cluster, a)
    assert again == first
    assert calls[0] <= a.num_stages, f"{calls[0]} device reads for {a.num_stages} stages x {a.dp} replicas"


@pytest.mark.parametrize("schedule,p,v", [("1f1b", 4, 1), ("interleaved", 8, 2), ("zbv", 8, 2)])
def test_cached_positions_are_the_schedules_own(schedule, p, v):
    """position_of / stages_at / local_stages from the cache agree with the schedule's rule."""
    dp = 3
    kind = schedule_named(schedule, v)
    cluster = ClusterSpec.homogeneous(p // v * dp, "h100")
    placement = place_stages(cluster, p, dp, local_stages=v, position_of=kind.position_of if v > 1 else None)
    a = Assignment(tuple(range(p)), (False,) * p, placement, p, dp, 8, 1, schedule)
    pp = p // v
    assert (a.local_stages, a.pipeline_ranks) == (v, pp)
    for s in range(p):
        assert a.position_of(s) == kind.position_of(s, pp)
    for pos in range(pp):
        assert a.stages_at(pos) == tuple(s for s in range(p) if kind.position_of(s, pp) == pos)
    assert a.stages_at(pp) == ()
    # the cache lives outside the fields: equality and the serialized form are unchanged
    assert a == Assignment(tuple(range(p)), (False,) * p, placement, p, dp, 8, 1, schedule)


def test_a_4096_rank_folder_holds_one_file_per_stage_and_no_file_per_rank(tmp_path, capsys):
    """Issue 48: the program folder of a 4,096-rank compile is per-stage code, plan.json, README.md
    and one train.py; any rank's role is `inspect DIR --rank N` (Note [roles from the plan] in
    runtime/launch/entry_files.py)."""
    from partitioner.cli import main as cli_main  # lazy: the CLI's compile, only this test needs it

    out = tmp_path / "p"
    assert cli_main(["compile", "gpt:layers=2,width=32,heads=2,vocab=64,seq=16", "--devices", "4096",
                     "--device", "h100", "--global-batch", "4096", "--stages", "2", "--dp", "2048",
                     "-o", str(out), "-q"]) == 0
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["README.md", "compile_stats.json", "plan.json", "stage_0.py", "stage_1.py", "train.py",
                     "weights/stage_0.safetensors", "weights/stage_1.safetensors"]
    capsys.readouterr()
    assert cli_main(["inspect", str(out), "--rank", "4095"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("rank 4095 of 4096: stage(s) [1] of 2, data-parallel replica 2047 of 2048;")
    assert "data-parallel peers 2048-4095 (2048 ranks)" in said


def test_cheap_bounds_lay_out_each_stage_and_dp_pair_once(monkeypatch):
    """Every candidate gets a cheap bound (Note [candidate pruning] in solve.py); its layout terms
    (links, core sharing: a pass over p x d ranks) are computed once per (p, d), not once per
    candidate (Note [bounds priced per candidate shape] in partitioner/solver/bounds.py)."""
    from partitioner.solver import bounds  # lazy: its module global is what the counter replaces

    calls = []
    original = bounds.place_stages
    monkeypatch.setattr(bounds, "place_stages", lambda cluster, p, d, *a, **k: calls.append((p, d)) or original(
        cluster, p, d, *a, **k))
    cluster = ClusterSpec.homogeneous(64, "h100")
    problem = layered_chain(8)
    space = SearchSpace(problem, cluster)
    candidates = space.candidates(64, None, None, None, SolverConfig(), "1f1b")
    bounds_now = [bounds.candidate_lower_bound_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                                 microbatch_size=64 // (d * m), schedule="1f1b")
                  for p, d, m, _ in candidates]
    shapes = {(p, d) for p, d, *_ in candidates}
    assert len(candidates) > 2 * len(shapes)  # the counted work would show per candidate
    assert sorted(calls) == sorted(set(calls)) and set(calls) <= shapes, f"{len(calls)} layouts for {len(shapes)} (p, d)"
    again = [bounds.candidate_lower_bound_s(problem, cluster, num_stages=p, dp=d, num_microbatches=m,
                                            microbatch_size=64 // (d * m), schedule="1f1b")
             for p, d, m, _ in candidates]
    assert again == bounds_now and len(calls) <= len(shapes)  # memo answers are the first answers


def test_sharding_relaxes_is_decided_once_per_degree_and_dp(monkeypatch):
    """Whether sharding relaxes replication scans every device (Note [one enumeration] in
    partitioner/solver/space.py); the enumeration asks it per candidate, so it is kept per (tp, dp):
    at 16,384 devices the scans were 258 million generator steps."""
    cluster = ClusterSpec.homogeneous(64, "h100")
    space = SearchSpace(layered_chain(4), cluster, shard="auto")
    scans = [0]
    original = space.grouped

    def counted(tp):
        scans[0] += 1
        return original(tp)

    monkeypatch.setattr(space, "grouped", counted)
    candidates = space.candidates(64, None, None, None, SolverConfig(), "1f1b")
    dps = {d for _p, d, _m, _v in candidates}
    assert len(candidates) > 2 * len(dps)
    assert scans[0] <= 1 + len(dps), f"{scans[0]} scans for {len(candidates)} candidates over {len(dps)} dp degrees"


def test_evaluate_sums_a_stage_once_across_dp_and_microbatch_counts(monkeypatch):
    """The fair baselines evaluate one split per p at every (d, m) (Note [fair baselines]); a
    stage's region sums depend on its regions, recompute and b only, so a second candidate with
    the same b times no region again (Note [stage terms are kept] in partitioner/solver/evaluate.py)."""
    evaluate_module = sys.modules[evaluate.__module__]  # the module: partitioner.solver.evaluate is the function

    calls = [0]
    original = evaluate_module.region_times_s

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(evaluate_module, "region_times_s", counted)
    cluster = ClusterSpec.homogeneous(64, "h100")
    problem = layered_chain(4)
    split = tuple(i * 4 // problem.num_regions for i in range(problem.num_regions))
    first = evaluate(problem, cluster, Assignment(split, (False,) * problem.num_regions, place_stages(cluster, 4, 1),
                                                  4, 1, 16, 1, "1f1b"))
    timed = calls[0]
    assert timed >= problem.num_regions
    again = evaluate(problem, cluster, Assignment(split, (False,) * problem.num_regions, place_stages(cluster, 4, 4),
                                                  4, 4, 4, 1, "1f1b"))
    assert calls[0] == timed, f"{calls[0] - timed} region timings again for the same stages at the same b"
    assert [s.compute_s for s in again.stages] == [s.compute_s for s in first.stages]
