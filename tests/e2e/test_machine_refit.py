"""`partitioner calibrate --from-run` on a real run (Note [refit from a run] in
partitioner/calibrate/refit.py): a tiny plan priced by a made-up machine profile trains a few
steps in the session's shared world-2 launch, writes its per-stage times (Note [stage times]),
and the refit makes the profile predict what that run measured.

The measured figures are whatever this machine gives; what is asserted holds for any of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _machine import fake_profile
from _shared_launch import Job, prepare
from partitioner.calibrate import machine
from partitioner.calibrate.refit import refit_from_run

STEPS = 4


@prepare
def _refit_programs(root: Path):
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt

    profile = fake_profile()
    plan = partitioner.compile(gpt(layers=2, width=32, heads=2, vocab=64, seq=16),
                               cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=2,
                               microbatches=4, dp=1, tensor_parallel=1, machine_profile=profile)
    plan.save(root / "priced")
    preset = partitioner.compile(gpt(layers=2, width=32, heads=2, vocab=64, seq=16),
                                 cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=2,
                                 microbatches=4, dp=1, tensor_parallel=1, machine_profile="preset")
    preset.save(root / "preset")
    return (root, profile), [Job(2, [root / "priced", "--steps", str(STEPS)])]


@pytest.fixture(scope="module")
def trained(shared_launches):
    (root, profile), _outputs = shared_launches.result(_refit_programs)
    return root, profile


def test_a_run_writes_its_stage_times_and_the_program_it_ran(trained):
    root, _ = trained
    run = root / "priced" / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert Path(summary["folder"]) == (root / "priced").resolve()
    assert summary["plan_hash"] == json.loads((root / "priced" / "plan.json").read_text())["plan_hash"]
    stages = {}
    for rank in (0, 1):
        body = json.loads((run / f"stage_times_rank_{rank}.json").read_text())
        assert body["rank"] == rank and body["num_microbatches"] == 4 and body["timed_steps"] == STEPS - 1
        stages.update({e["stage"]: e for e in body["stages"]})
    assert sorted(stages) == [0, 1]
    assert all(e["forward_s_per_microbatch"] > 0 and e["backward_s_per_microbatch"] > 0 for e in stages.values())


def test_refit_makes_the_profile_predict_the_run(trained, tmp_path, monkeypatch, capsys):
    root, profile = trained
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(machine.NO_CALIBRATE_ENV, raising=False)
    machine.save(profile)
    from partitioner.cli import main

    assert main(["calibrate", "--from-run", str(root / "priced" / "run")]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "before" in out and "after" in out and "per-microbatch overhead" in out
    refit, why = machine.load_cached(profile.key)
    assert why is None and len(refit.refits) == 1 and refit.measurement_id == profile.measurement_id
    summary = json.loads((root / "priced" / "run" / "summary.json").read_text())
    entry = refit.refits[0]
    assert entry.measured_step_s == summary["measured_step_time_s"]
    assert entry.predicted_before_s == pytest.approx(summary["predicted_step_time_s"])
    assert (entry.forward_scale, entry.backward_scale) == (refit.forward_scale, refit.backward_scale)
    # the refit prices this plan at what it measured (a region scale or the overhead gives)
    assert entry.predicted_after_s == pytest.approx(entry.measured_step_s, rel=1e-3)
    # a second refit from the same run (priced by the profile before the first) lands where the first did
    again = refit_from_run(root / "priced", refit)
    assert again.profile.forward_scale == pytest.approx(refit.forward_scale)
    assert again.predicted_after_s == pytest.approx(entry.predicted_after_s)


def test_refit_refuses_what_it_cannot_refit(trained, tmp_path):
    root, profile = trained
    with pytest.raises(ValueError, match="no summary.json there"):
        refit_from_run(tmp_path, profile)
    run = tmp_path / "preset_run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"measured_step_time_s": 0.1, "folder": str(root / "preset")}))
    with pytest.raises(ValueError, match="priced by the cpu preset.*without --no-calibrate"):
        refit_from_run(run, profile)
    remeasured = fake_profile(load_average_1m=9.0)
    with pytest.raises(ValueError, match="measured again since"):
        refit_from_run(root / "priced" / "run", remeasured)


def test_a_run_faster_than_its_sends_refits_the_latency(trained, tmp_path):
    """A profile measured on a busy machine prices a pipeline's sends too high: a run whose stages
    took what the plan priced but whose step was shorter refits the latency, not the regions."""
    import dataclasses

    from partitioner.calibrate.refit import _predicted_step_s, _stage_compute_s
    from partitioner.config.cluster import ClusterSpec
    from partitioner.inspect.explain import load_priced
    from partitioner.solver.plan import Plan
    from partitioner.solver.problem import core_sharing_factor
    from runtime.observe.stage_times import FORMAT

    root, profile = trained
    folder = root / "priced"
    plan = Plan.load(folder)
    problem, assignment = load_priced(folder)
    cluster = ClusterSpec.from_dict(plan.cluster)
    core = core_sharing_factor(cluster, assignment.device_of_stage_replica)
    half = dataclasses.replace(cluster, intra_node_link=dataclasses.replace(
        cluster.intra_node_link, latency_s=cluster.intra_node_link.latency_s / 2))
    no_overhead = dataclasses.replace(problem, microbatch_overhead_s_by_kind={"cpu": 0.0})
    measured = _predicted_step_s(plan, no_overhead, half, assignment)
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"measured_step_time_s": measured, "folder": str(folder),
                                                 "plan_hash": plan.content_hash()}))
    for stage, (fwd, bwd) in enumerate(_stage_compute_s(problem, cluster, assignment)):
        (run / f"stage_times_rank_{stage}.json").write_text(json.dumps({"format": FORMAT, "stages": [
            {"stage": stage, "forward_s_per_microbatch": fwd * core, "backward_s_per_microbatch": bwd * core}]}))
    report = refit_from_run(run, profile)
    assert report.microbatch_overhead_after_s == 0.0
    assert report.profile.link().latency_s == pytest.approx(profile.link().latency_s / 2, rel=1e-6)
    assert (report.forward_scale, report.backward_scale) == pytest.approx((1.0, 1.0))
    assert report.predicted_after_s == pytest.approx(measured, rel=1e-6) and "send's latency" in report.text()


@pytest.mark.parametrize("case", ["a stage's NaN", "a step of 5e4 s"])
def test_a_run_that_would_poison_the_profile_is_refused_and_writes_nothing(trained, tmp_path, monkeypatch, capsys,
                                                                          case):
    """Issue 42 finding 5 (Note [machine figures are bounded]): the run's own figures, with one of
    them absurd, refuse the refit in one line naming the file, and the cached profile is as it was."""
    from partitioner.cli import main
    from partitioner.solver.plan import Plan

    root, profile = trained
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(machine.NO_CALIBRATE_ENV, raising=False)
    before = machine.save(profile).read_bytes()
    folder, ran = root / "priced", root / "priced" / "run"
    run = tmp_path / "run"
    run.mkdir()
    summary = json.loads((ran / "summary.json").read_text())
    if case == "a step of 5e4 s":  # inside the step's bounds: what it refits to is not
        summary["measured_step_time_s"] = 5e4
    (run / "summary.json").write_text(json.dumps({**summary, "folder": str(folder),
                                                 "plan_hash": Plan.load(folder).content_hash()}))
    for rank in (0, 1):
        body = json.loads((ran / f"stage_times_rank_{rank}.json").read_text())
        if rank == 0 and case == "a stage's NaN":
            body["stages"][0]["forward_s_per_microbatch"] = float("nan")
        (run / f"stage_times_rank_{rank}.json").write_text(json.dumps(body))
    assert main(["calibrate", "--from-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    if case == "a stage's NaN":
        assert f"{run / 'stage_times_rank_0.json'}: stage 0's forward_s_per_microbatch is nan" in err, err
    else:
        assert f"{run / 'summary.json'}: its step of 50000.0 s" in err and "is outside" in err, err
    assert machine.cache_path(profile.key).read_bytes() == before
