"""--schedule auto (Note [schedule choice] in partitioner/solver/schedule_choice.py): the solver
weighs gpipe and 1f1b by the cost model's predicted step time under the memory limit."""

import pytest

from partitioner.config.cluster import ClusterSpec
from partitioner.errors import PartitionInfeasibleError
from partitioner.solver import SolverConfig, check_assignment, evaluate, solve
from partitioner.solver.candidates import validate_options
from tests.unit.test_solver_hand import chain, cpus, region

FAST = SolverConfig(time_limit_s=5)
GIB = 2**30


def _each(problem, cluster, global_batch, **kwargs):
    out = {}
    for schedule in ("1f1b", "gpipe"):
        try:
            out[schedule] = solve(problem, cluster, global_batch, schedule=schedule, config=FAST, **kwargs)
        except ValueError:
            out[schedule] = None
    return out


def _predicted(problem, cluster, sol):
    return evaluate(problem, cluster, sol.assignment).step_time_s


def test_small_batch_deep_pipeline_chooses_gpipe():
    """Global batch 2 on 4 devices: 1F1B needs microbatches >= stages, so it stops at 2 stages;
    GPipe runs 4 stages with 2 microbatches, which the cost model predicts faster."""
    problem = chain([region(f"r{i}", fwd=4e9) for i in range(4)])
    cluster = ClusterSpec.homogeneous(4, cores=4)  # a core per rank: no core sharing
    each = _each(problem, cluster, 2, dp=1)
    auto = solve(problem, cluster, 2, dp=1, schedule="auto", config=FAST)
    assert auto.schedule == "gpipe" and auto.num_stages == 4
    assert each["1f1b"].num_stages <= 2
    times = {s: _predicted(problem, cluster, sol) for s, sol in each.items()}
    assert times["gpipe"] < times["1f1b"]
    assert auto.step_time_s == pytest.approx(min(times.values()))
    assert auto.step_time_s == pytest.approx(_predicted(problem, cluster, auto))
    assert auto.status == "OPTIMAL" and "schedules 1f1b and gpipe and interleaved and zb and zbv (chose gpipe" in auto.optimal_over
    check_assignment(problem, cluster, auto)


def test_equal_time_prefers_1f1b_and_memory_rules_out_gpipe():
    """Both run (4 microbatches, 2 stages) at the same predicted time: 1f1b, which holds fewer
    activations. With memory for 2 in-flight microbatches but not 4, GPipe does not fit at all."""
    problem = chain([region(f"r{i}", act=1 << 20) for i in range(4)])
    cluster = ClusterSpec.homogeneous(2)
    auto = solve(problem, cluster, 8, num_stages=2, dp=1, microbatches=4, schedule="auto", config=FAST)
    each = _each(problem, cluster, 8, num_stages=2, dp=1, microbatches=4)
    assert _predicted(problem, cluster, each["gpipe"]) == pytest.approx(_predicted(problem, cluster, each["1f1b"]))
    assert auto.schedule == "1f1b"

    # 1F1B holds 2 and 1 microbatches in flight on its stages, GPipe 4: with memory for 1F1B's
    # peak and a fifth more (recompute off), GPipe fits nowhere
    tight = chain([region(f"r{i}", act=64 << 20, static=8 << 20) for i in range(4)])
    no_rc = SolverConfig(time_limit_s=5, allow_recompute=False)
    one = solve(tight, cluster, 8, num_stages=2, dp=1, microbatches=4, schedule="1f1b", config=no_rc)
    probe = cpus(GIB).devices[0]
    usable_fraction = probe.usable_memory_bytes / GIB
    memory = int(max(s.memory_bytes for s in one.stages) * 1.2 / usable_fraction)
    small = cpus(memory, memory)
    with pytest.raises(PartitionInfeasibleError):
        solve(tight, small, 8, num_stages=2, dp=1, microbatches=4, schedule="gpipe", config=no_rc)
    auto = solve(tight, small, 8, num_stages=2, dp=1, microbatches=4, schedule="auto", config=no_rc)
    assert auto.schedule == "1f1b" and "gpipe has no plan" in auto.optimal_over
    assert auto.status == "OPTIMAL"


def test_auto_and_interleaved_are_accepted_and_others_refused_with_the_fix():
    cluster = ClusterSpec.homogeneous(2)
    validate_options(cluster, 8, 2, 1, 4, "auto")
    validate_options(cluster, 8, 4, 1, 4, "interleaved")
    validate_options(cluster, 8, 4, 1, 4, "zbv")
    with pytest.raises(ValueError, match="cannot run zbv on 2 devices.*--stages 4"):
        validate_options(cluster, 8, 2, 1, 4, "zbv")
    with pytest.raises(ValueError, match="dualpipev.*OVERLAP_F_B.*--schedule zbv"):
        validate_options(cluster, 8, 4, 1, 4, "dualpipev")


def test_cli_auto_compiles_where_1f1b_cannot_and_inspect_names_the_schedule(tmp_path, capsys):
    """4 fixed stages and a global batch of 2: 1F1B has no runnable plan (microbatches < stages);
    auto compiles GPipe, and inspect says so."""
    import json

    from partitioner.cli import main

    args = ["compile", "mlp", "--device", "h100", "--devices", "4", "--stages", "4", "--dp", "1",
            "--global-batch", "2", "-q"]
    assert main(args + ["--schedule", "1f1b", "-o", str(tmp_path / "fixed")]) != 0
    assert "--schedule gpipe" in capsys.readouterr().err
    out = tmp_path / "auto"
    assert main(args + ["--schedule", "auto", "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["schedule"] == "gpipe" and plan["num_stages"] == 4
    assert "chose gpipe" in plan["solver"]["optimal_over"] and "1f1b has no plan" in plan["solver"]["optimal_over"]
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "schedule gpipe" in capsys.readouterr().out
