"""Recompute a user pins (Note [recompute a user pins] in partitioner/solver/recompute_cost.py): the
setting, its job-file key and flag, and the solver honouring "full" and "none" on hand instances."""

import dataclasses

import pytest

from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.config.job import load_job, training_settings
from partitioner.config.settings import TrainingSettings
from partitioner.errors import PartitionInfeasibleError
from partitioner.solver import SolverConfig, check_assignment, evaluate, solve
from partitioner.solver.recompute_cost import pinned_recompute
from tests.unit.test_solver_hand import MIB, _inflight_problem, chain, cpus, region


def test_the_setting_round_trips_and_auto_is_left_out_of_plan_json():
    assert "recompute" not in TrainingSettings().to_dict()  # an older plan's "training" is unchanged
    full = TrainingSettings.from_dict({"recompute": "full"})
    assert full.recompute == "full" and TrainingSettings.from_dict(full.to_dict()) == full


def test_selective_round_trips():  # Note [selective recompute] in partitioner/solver/recompute_cost.py
    selective = TrainingSettings.from_dict({"recompute": "selective"})
    assert TrainingSettings.from_dict(selective.to_dict()) == selective


@pytest.mark.parametrize("value", ["partial", True])
def test_anything_but_auto_none_full_selective_is_refused_naming_the_value(value):
    with pytest.raises(ValueError, match="training.recompute"):
        TrainingSettings.from_dict({"recompute": value})


def test_a_job_file_pins_it(tmp_path):
    (tmp_path / "job.toml").write_text('[training]\nrecompute = "full"\n')
    assert training_settings(load_job(tmp_path / "job.toml").training).recompute == "full"
    (tmp_path / "sel.toml").write_text('[training]\nrecompute = "selective"\n')
    assert training_settings(load_job(tmp_path / "sel.toml").training).recompute == "selective"
    (tmp_path / "bad.toml").write_text('[training]\nrecompute = "partial"\n')
    with pytest.raises(ValueError, match=r"\[training\].recompute = 'partial'"):
        load_job(tmp_path / "bad.toml")


def test_solver_config_has_one_recompute_setting_in_two_spellings():
    assert SolverConfig(allow_recompute=False).recompute == "none"
    assert not SolverConfig(recompute="none").allow_recompute
    assert SolverConfig(recompute="full").allow_recompute
    with pytest.raises(ValueError, match="allow_recompute=False, recompute='full'"):
        SolverConfig(allow_recompute=False, recompute="full")
    selective = SolverConfig(recompute="selective")  # whole regions pinned off: the cores are the problem's
    assert not selective.allow_recompute
    assert dataclasses.replace(selective, time_limit_s=1).recompute == "selective"  # a copy stays selective


def test_cli_refuses_selective_under_tensor_parallelism_in_one_line_before_tracing(tmp_path, capsys):
    code = main(["compile", "gpt:layers=2,width=32", "-o", str(tmp_path / "out"), "--recompute", "selective",
                 "--devices", "2", "--tp", "2", "-q"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "selective recompute" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def _roomy_problem():
    """Four regions on roomy devices (memory never binds): "auto" recomputes nothing; r3's recompute
    would keep as much as it frees, so "full" leaves it out."""
    regions = [region(f"r{i}", act=MIB, recompute_act=MIB // 10) for i in range(3)]
    return chain(regions + [region("r3", act=MIB, recompute_act=MIB)], edge_bytes=8)


def test_full_recomputes_every_region_that_saves_memory_and_prices_it():
    problem, cluster = _roomy_problem(), ClusterSpec.homogeneous(2)
    auto = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=4, config=SolverConfig(time_limit_s=5))
    full = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=4,
                 config=SolverConfig(time_limit_s=5, recompute="full"))
    assert not any(auto.recompute)
    assert full.recompute == (True, True, True, False) == pinned_recompute(problem, "full")
    check_assignment(problem, cluster, full)  # its figures are evaluate's of the pinned plan
    assert full.step_time_s == pytest.approx(evaluate(problem, cluster, full.assignment).step_time_s)
    assert full.step_time_s > auto.step_time_s  # the reruns are priced
    assert "pinned: --recompute full" in full.optimal_over
    # the baselines are priced like for like: with the same recompute
    assert all(b.recompute for b in full.baseline_details.values())


def test_none_keeps_every_region_and_a_plan_that_needs_recompute_is_refused_naming_the_flag():
    problem = _inflight_problem()
    cluster = cpus(3 * MIB + MIB // 2, 3 * MIB + MIB // 2)
    none = solve(problem, cluster, 4, num_stages=2, dp=1, microbatches=4,
                 config=SolverConfig(time_limit_s=5, recompute="none"))
    assert not any(none.recompute)
    tight = cpus(2 * MIB, 2 * MIB)  # 2 in flight x 1 MiB and more on stage 0 whatever the split
    with pytest.raises(PartitionInfeasibleError, match=r"pinned off by --recompute none"):
        solve(problem, tight, 4, num_stages=2, dp=1, microbatches=4,
              config=SolverConfig(time_limit_s=5, recompute="none"))
    assert any(solve(problem, tight, 4, num_stages=2, dp=1, microbatches=4,
                     config=SolverConfig(time_limit_s=5)).recompute)  # auto fits it by recompute


def test_every_hint_obeys_the_pin():
    """A hint is also a plan solve keeps when CP-SAT stops early (placed.solve_placements): under
    "full" the baselines' and the chain DP's hints carry the pinned recompute, not their own."""
    from partitioner.solver.candidate import Candidate
    from partitioner.solver.model import CandidateModel
    from partitioner.solver.placed import _hint_plans

    problem, cluster = _inflight_problem(), cpus(3 * MIB + MIB // 2, 3 * MIB + MIB // 2)
    c = Candidate.of(2, 1, 4, 4, "1f1b", None)
    placement = ((0,), (1,))
    for mode, want in (("full", (True,) * 4), ("none", (False,) * 4)):
        model = CandidateModel(problem, cluster, num_stages=2, dp=1, num_microbatches=4, microbatch_size=1,
                               schedule="1f1b", config=SolverConfig(recompute=mode), placement=placement)
        plans = _hint_plans(model, problem, cluster, c, placement=placement)
        assert plans and all(recompute == want for _, recompute in plans), (mode, plans)
