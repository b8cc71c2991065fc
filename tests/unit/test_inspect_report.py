"""The inspection face on a Plan built by hand: the table, the JSON and the DOT are pinned against
golden files (regenerate with UPDATE_GOLDEN=1 after a deliberate change and review the diff); the
HTML page is self-contained; the timeline follows the schedule; --node prices moves with the solver's
cost model on the solver's problem."""

import json
import re

import pytest

from partitioner.inspect.table import rank_ranges

from partitioner import inspect as report
from partitioner.config.cluster import ClusterSpec
from partitioner.solver.plan import CutEdge, MemoryBreakdown, Plan, PlanRegion, PlanTie, StagePlan
from partitioner.solver import problem as sp
from partitioner.solver import serialize
from partitioner.solver.evaluate import evaluate
from _golden import check_golden

TEST_FILE = "tests/unit/test_inspect_report.py"

KIB, GIB = 2**10, 2**30

# docs/design.md §11: `partitioner inspect --json` prints at least these.
DESIGN_TOP = {"plan_hash", "num_stages", "dp", "microbatches", "schedule", "predicted", "solver", "stages",
              "baselines"}
DESIGN_PREDICTED = {"step_time_s", "bubble_fraction", "lower_bound_step_time_s"}
DESIGN_SOLVER = {"status", "objective", "bound", "solve_time_s"}
DESIGN_STAGE = {"index", "ranks", "device", "regions", "params", "flops_fwd", "flops_bwd", "predicted_time_s",
                "peak_memory_bytes", "memory_capacity_bytes", "send_bytes"}


def _region(id, name, stage, layer, fwd, params, act, recompute=False):
    nodes = tuple(f"{name.replace('.', '_')}_{k}" for k in ("weight", "linear", "add"))
    return PlanRegion(id=id, name=name, stage=stage, recompute=recompute, nodes=nodes, layer=layer,
                  fwd_flops=fwd, bwd_flops=2 * fwd, param_bytes=params, activation_bytes=act)


def _stage(index, regions, names, params, fwd, time_s, mem, send):
    weights, acts = mem
    memory = MemoryBreakdown(weights, weights, 2 * weights, acts, 2 * KIB)
    return StagePlan(index=index, ranks=(index,), device="cpu", regions=regions, region_names=names,
                     params=params, fwd_flops=fwd, bwd_flops=2 * fwd, compute_time_s=time_s * 0.9,
                     comm_time_s=time_s * 0.1, predicted_time_s=time_s, memory=memory,
                     peak_memory_bytes=memory.total_bytes, memory_capacity_bytes=16 * GIB, send_bytes=send)


def hand_plan() -> Plan:
    """Three stages, five regions, a skip tensor crossing two boundaries, a tied embedding."""
    regions = (
        _region(0, "embed", 0, None, 0.0, 4096, 512),
        _region(1, "block.0", 0, 0, 1.0e6, 16384, 4096),
        _region(2, "block.1", 1, 1, 1.0e6, 16384, 4096, recompute=True),
        _region(3, "block.2", 1, 2, 1.0e6, 16384, 4096),
        _region(4, "head", 2, None, 2.0e5, 2048, 1024),
    )
    stages = (
        _stage(0, (0, 1), ("embed", "block.0"), 5120, 2.0e6, 1.25e-4, (20480, 24576), 2048),
        _stage(1, (2, 3), ("block.1", "block.2"), 8192, 4.0e6, 2.5e-4, (32768, 16384), 1024),
        _stage(2, (4,), ("head",), 512, 4.0e5, 0.5e-4, (2048, 2048), 0),
    )
    cut_edges = (
        CutEdge(0, 4, ("pos_emb",), ((2, 8, 16),), 1024, (0, 1)),
        CutEdge(1, 2, ("add_1",), ((2, 8, 16),), 1024, (0,)),
        CutEdge(3, 4, ("add_3", "mask"), ((2, 8, 16), (8, 8)), 1280, (1,)),
    )
    return Plan(
        workload="hand(layers=3)", model_fingerprint="0" * 16, num_stages=3, dp=1, num_microbatches=4,
        microbatch_size=2, global_batch=8, schedule="1f1b", world_size=3, device_type="cpu",
        stages=stages, regions=regions, cut_edges=cut_edges,
        ties=(PlanTie(param="tok_emb.weight", stages=(0, 2), placement="replicated", cost_s=1.0e-5),),
        predicted={"step_time_s": 1.185e-3, "bubble_fraction": 0.3, "lower_bound_step_time_s": 0.9e-3,
                   "samples_per_s": 8 / 1.185e-3},
        solver={"status": "FEASIBLE", "objective": 11850.0, "bound": 11000.0, "gap": 0.0717, "solve_time_s": 1.25},
        baselines={"param_balanced": {"step_time_s": 1.5e-3}, "uniform": {"step_time_s": 1.3e-3}},
        cluster=ClusterSpec.homogeneous(3, "cpu", cores=2).to_dict(),  # pinned: the default is this machine's
    )


def hand_problem() -> tuple[sp.PartitionProblem, sp.Assignment]:
    """The solver's view of hand_plan(): its regions, the chain and the skip edge, the tie."""
    figures = [(r.name, r.fwd_flops, r.param_bytes, r.activation_bytes, r.layer) for r in hand_plan().regions]
    regions = tuple(sp.RegionCost(name, fwd, 2 * fwd, params, params, 2 * params, act, act // 4 if name == "block.1" else act,
                              layer=layer) for name, fwd, params, act, layer in figures)
    edges = tuple(sp.Edge(i, i + 1, 512) for i in range(4)) + (sp.Edge(0, 4, 512),)
    problem = sp.PartitionProblem(regions, edges, ties=(sp.SharedParam((0, 4), 2048),), input_bytes_per_sample=64)
    assignment = sp.Assignment(stage_of_region=(0, 0, 1, 1, 2), recompute=(False, False, True, False, False),
                               device_of_stage_replica=((0,), (1,), (2,)), num_stages=3, dp=1, num_microbatches=4,
                               microbatch_size=2, schedule="1f1b")
    return problem, assignment


@pytest.fixture(scope="module")
def plan():
    return hand_plan()


def test_table_is_pinned(plan):
    text = report.table(plan)
    check_golden("inspect_table.txt", text + "\n", TEST_FILE)
    # Readable by eye: units in the header lines, every stage row as wide as the header.
    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("stage")]
    assert len(headers) == 2  # time, then memory: each fits a terminal
    assert "ms/mb" in lines[headers[0] + 1]
    assert "KiB" in lines[headers[1] + 1] and "GiB" in lines[headers[1] + 1]
    for header in headers:
        rows = lines[header + 2:header + 5]
        assert [r.split()[0] for r in rows] == ["0", "1", "2"]
        assert len({len(lines[header]), *(len(r) for r in rows)}) <= 2  # right-aligned columns line up
        assert max(len(line) for line in lines[header:header + 5]) <= 120


def test_json_is_pinned_and_keeps_design_fields(plan):
    body = report.inspect_json(plan)
    check_golden("inspect.json", report.to_json_text(body) + "\n", TEST_FILE)
    assert DESIGN_TOP <= set(body)
    assert DESIGN_PREDICTED <= set(body["predicted"])
    assert DESIGN_SOLVER <= set(body["solver"])
    assert set(body["baselines"]) == {"uniform", "param_balanced"}
    assert all("step_time_s" in b for b in body["baselines"].values())
    for stage in body["stages"]:
        assert DESIGN_STAGE <= set(stage)
    assert body["plan_hash"] == plan.content_hash()
    assert body["microbatches"] == 4 and body["stages"][1]["regions"] == ["block.1", "block.2"]
    assert body["balance"]["time_max_over_mean"] == pytest.approx(2.5 / (4.25 / 3))
    json.loads(report.to_json_text(body))  # strict JSON (no NaN)


def test_dot_is_pinned_and_well_formed(plan):
    text = report.dot(plan)
    check_golden("inspect.dot", text, TEST_FILE)
    assert text.count("{") == text.count("}") and text.count('"') % 2 == 0
    declared = set(re.findall(r"^\s+(r\d+) \[", text, re.M))
    used = set(re.findall(r"(r\d+) -> (r\d+)", text))
    assert declared == {f"r{i}" for i in range(5)}
    assert {a for a, _ in used} | {b for _, b in used} <= declared
    assert ("r0", "r4") in used and ("r1", "r2") in used  # cut edges, including the skip
    assert ("r2", "r3") in used  # consecutive regions of one stage
    assert text.count("subgraph cluster_stage") == 3


def test_html_is_self_contained_with_timeline_and_memory(plan, tmp_path):
    path = report.write_html(plan, tmp_path / "report.html")
    page = path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary left behind
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<link|<script[^>]*src|@import|url\((?!#)|src=", page)
    for svg in ('<svg id="stage-graph"', '<svg id="timeline"', '<svg id="memory"'):
        assert svg in page
    # one bar per forward and backward of every microbatch on every stage
    assert page.count('<g class="fwd">') == 3 * 4 and page.count('<g class="bwd">') == 3 * 4


def test_timeline_follows_dependencies(plan):
    tl = report.timeline(plan)
    assert tl["ranks"] == [0, 1, 2]
    end = {(b["kind"], b["stage"], b["microbatch"]): b for b in tl["bars"]}
    assert len(end) == 2 * 3 * 4
    for (kind, stage, mb), bar in end.items():
        if kind == "F" and stage > 0:
            assert bar["start_s"] >= end[("F", stage - 1, mb)]["end_s"] - 1e-15
        if kind == "B":
            assert bar["start_s"] >= end[("F", stage, mb)]["end_s"] - 1e-15
            if stage < 2:
                assert bar["start_s"] >= end[("B", stage + 1, mb)]["end_s"] - 1e-15
    for rank in range(3):  # a rank runs one thing at a time
        mine = sorted((b["start_s"], b["end_s"]) for b in tl["bars"] if b["rank_position"] == rank)
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(mine, mine[1:]))
    # widths: forward and backward of a stage add up to its predicted time, in the FLOP ratio
    # (stage 1 recomputes block.1, so its backward carries one more forward)
    f1, b1 = (end[(k, 1, 0)]["end_s"] - end[(k, 1, 0)]["start_s"] for k in ("F", "B"))
    assert f1 + b1 == pytest.approx(2.5e-4) and b1 / f1 == pytest.approx((8e6 + 2e6) / 4e6)


def test_explain_unknown_node_lists_close_matches(plan):
    with pytest.raises(ValueError, match=r"'block_1_lnear'.*close matches: block_1_linear"):
        report.explain_node(plan, "block_1_lnear", *hand_problem())


def test_explain_middle_region_prices_both_neighbours(plan):
    problem, assignment = hand_problem()
    info = report.explain_node(plan, "block_2_add", problem, assignment)
    assert info["region"]["name"] == "block.2" and info["stage"]["index"] == 1
    assert info["neighbours"] == {"before": {"region": "block.1", "stage": 1},
                                  "after": {"region": "head", "stage": 2}}
    earlier, later = info["moves"]
    assert earlier["to_stage"] == 0 and earlier["possible"] is False  # would empty stage 1
    assert later["to_stage"] == 2 and later["regions"] == ["block.2"] and later["possible"] is True
    now = evaluate(problem, ClusterSpec.from_dict(plan.cluster), assignment)
    assert later["stage_times_s"][2] > now.stages[2].time_s  # stage 2 took block.2's work
    assert info["repriced_error"] > 0.01 and "disagree" in info["verdict"]  # hand figures: not the model's
    text = report.explain_text(info)
    assert "move to stage 2 (block.2)" in text and "verdict" in text


def test_solver_problem_round_trips_through_json_and_tolerates_added_fields():
    problem, assignment = hand_problem()
    body = json.loads(json.dumps(serialize.to_dict(problem)))
    body["regions"][0]["a_field_from_a_newer_compiler"] = 1
    assert serialize.problem_from_dict(body) == problem
    assert serialize.assignment_from_dict(json.loads(json.dumps(serialize.to_dict(assignment)))) == assignment
    del body["regions"][1]["param_bytes"]
    with pytest.raises(ValueError, match=r"problem\.regions\[1\] lacks fields RegionCost needs.*recompile"):
        serialize.problem_from_dict(body)


def test_a_plan_written_before_the_tensor_parallel_costs_nested_still_prices_them():
    """plan.json from before RegionCost.tp held the tensor-parallel figures flat (tp_comm_bytes, ...):
    read into the nested TensorParallelCost, not dropped to zero."""
    import dataclasses

    from partitioner.solver.problem import TensorParallelCost

    problem, _ = hand_problem()
    region = dataclasses.replace(problem.regions[0], tp=TensorParallelCost(comm_bytes=96, sharded_param_bytes=64,
                                                                           fwd_collectives=2))
    body = json.loads(json.dumps(serialize.to_dict(dataclasses.replace(problem, regions=(region,) + problem.regions[1:]))))
    old = body["regions"][0]
    old.update({f"tp_{name}": value for name, value in old.pop("tp").items()})
    assert serialize.problem_from_dict(body).regions[0].tp == region.tp


def test_rank_ranges():
    assert rank_ranges(range(64)) == "0-63"
    assert rank_ranges([0, 16, 32, 48]) == "0-48/16"
    assert rank_ranges([5]) == "5"
    assert rank_ranges([0, 1, 3, 4, 5, 9]) == "0-1,3-5,9"
    assert rank_ranges([2, 4]) == "2,4"  # two ranks: a stride says nothing shorter


def test_table_of_a_1024_rank_plan_fits_a_terminal(plan):
    """Ranks as ranges: 64 replicas make a row no wider than one (was: 64 rank numbers per row)."""
    import dataclasses

    stages = tuple(dataclasses.replace(s, ranks=tuple(range(s.index * 64, (s.index + 1) * 64)))
                   for s in plan.stages)
    big = dataclasses.replace(plan, stages=stages, dp=64, world_size=64 * len(stages))
    text = report.table(big)
    assert "0-63" in text and "128-191" in text
    assert max(len(line) for line in text.splitlines()) <= 120, max(text.splitlines(), key=len)


def test_memory_tier_line_of_many_hosts_stays_one_short_line():
    from partitioner.inspect.table import memory_tier_line

    hosts = 128
    choice = {"mode": "copy", "every": 1, "group_size": None, "groups": [[h * 8, h * 8 + 8] for h in range(hosts)],
              "per_host_bytes": [2**30] * hosts, "redundancy_bytes": [1] * hosts, "own_bytes": [1] * hosts}
    line = memory_tier_line(choice)
    assert "(128 in all)" in line and len(line) < 300
