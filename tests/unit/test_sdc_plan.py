"""The replica check as a plan setting (Note [replica digests] in runtime/resilience/sdc.py): ``sdc_every``
is priced in the predicted step by ``evaluate`` (Note [cost model]; K = 0 removes the term), and
travels compile -> plan.json -> the program object the generated program runs; `partitioner
compile --sdc-every` and the job file set it, `inspect` says it."""

from __future__ import annotations

import json

import pytest

import partitioner
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import mlp
from partitioner.solver.plan import Plan
from partitioner.solver import problem as sp
from partitioner.solver.evaluate import evaluate
from partitioner.solver.sdc_cost import DIGEST_BYTES_PER_S, default_every
from runtime.program.spec import load_program
from runtime.resilience.sdc import DEFAULT_EVERY


def _problem_dp2():
    """Two regions (the second with 4x the state) on 1 stage x dp 2 and 2 stages x dp 2."""
    regions = (sp.RegionCost("a", 1e6, 2e6, 4_000_000, 4_000_000, 8_000_000, 1024, 1024),
               sp.RegionCost("b", 1e6, 2e6, 16_000_000, 16_000_000, 32_000_000, 1024, 1024))
    problem = sp.PartitionProblem(regions, (sp.Edge(0, 1, 512),), input_bytes_per_sample=64)
    one = sp.Assignment(stage_of_region=(0, 0), recompute=(False, False), device_of_stage_replica=((0, 1),),
                        num_stages=1, dp=2, num_microbatches=2, microbatch_size=2, schedule="1f1b")
    two = sp.Assignment(stage_of_region=(0, 1), recompute=(False, False), device_of_stage_replica=((0, 2), (1, 3)),
                        num_stages=2, dp=2, num_microbatches=2, microbatch_size=2, schedule="1f1b")
    return problem, one, two


def test_the_predicted_step_includes_the_check_and_k_0_removes_it():
    problem, one, two = _problem_dp2()
    cluster = ClusterSpec.homogeneous(4, "cpu", cores=4)
    for a, state_bytes in ((one, (4e6 + 8e6) + (16e6 + 32e6)), (two, 16e6 + 32e6)):  # the stage with most state
        off = evaluate(problem, cluster, a)
        assert off.sdc_check_s == 0.0 and evaluate(problem, cluster, a, sdc_every=0) == off
        on = evaluate(problem, cluster, a, sdc_every=5)
        digest_s = state_bytes / DIGEST_BYTES_PER_S["cpu"]
        assert on.sdc_check_s > digest_s / 5  # the digest, amortised, plus the all_gather's latencies
        assert on.sdc_check_s < (digest_s + 1e-2) / 5
        assert on.step_time_s == pytest.approx(off.step_time_s + on.sdc_check_s, rel=1e-12)
        assert evaluate(problem, cluster, a, sdc_every=10).sdc_check_s == pytest.approx(on.sdc_check_s / 2)
        assert on.pipeline_s == off.pipeline_s and on.dp_allreduce_s == off.dp_allreduce_s  # a term of its own
    no_replicas = sp.Assignment(stage_of_region=(0, 0), recompute=(False, False), device_of_stage_replica=((0,),),
                                num_stages=1, dp=1, num_microbatches=2, microbatch_size=2, schedule="1f1b")
    assert evaluate(problem, cluster, no_replicas, sdc_every=5).sdc_check_s == 0.0  # nothing to compare
    assert default_every(2) == DEFAULT_EVERY and default_every(1) == 0


def _compile(tmp_path, name, **training):
    plan = partitioner.compile(mlp(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=1,
                               dp=2, microbatches=2, training=training or None)
    plan.save(tmp_path / name)
    return tmp_path / name


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sdc_plan")
    return {"default": _compile(tmp, "default"), "k5": _compile(tmp, "k5", sdc_every=5),
            "off": _compile(tmp, "off", sdc_every=0)}


def test_sdc_every_travels_from_compile_to_the_program_object(folders):
    cost = {}
    for name, k in (("default", DEFAULT_EVERY), ("k5", 5), ("off", 0)):
        body = json.loads((folders[name] / "plan.json").read_text())
        plan = Plan.load(folders[name])
        assert plan.decisions.sdc_every == k and body["program"]["sdc_every"] == k
        assert load_program(str(folders[name])).sdc_every == k  # what runtime/launch/rank.py runs
        cost[name] = plan.predicted["sdc_check_s_per_step"]
        assert load_program(str(folders[name])).predicted_step_time_s == plan.predicted["step_time_s"]
    assert cost["off"] == 0.0 and cost["k5"] > 0.0
    assert cost["default"] == pytest.approx(cost["k5"] * 5 / DEFAULT_EVERY)
    step = {n: Plan.load(folders[n]).predicted["step_time_s"] for n in folders}
    # Same partition, so the steps differ by exactly the check's term (the "predicted X s/step" a run prints).
    assert step["k5"] - step["off"] == pytest.approx(cost["k5"], rel=1e-9)
    assert step["default"] - step["off"] == pytest.approx(cost["default"], rel=1e-9)


def test_inspect_says_the_interval_and_its_cost(folders, capsys):
    assert main(["inspect", str(folders["k5"])]) == 0
    out = capsys.readouterr().out
    cost_ms = Plan.load(folders["k5"]).predicted["sdc_check_s_per_step"] * 1e3
    assert f"replica check   digests of the 2 replicas compared every 5 steps, {cost_ms:.3f} ms/step" in out
    assert main(["inspect", str(folders["off"])]) == 0
    assert "replica check   off (sdc_every = 0)" in capsys.readouterr().out
    assert main(["inspect", str(folders["k5"]), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["sdc_every"] == 5 and body["predicted"]["sdc_check_s_per_step"] == pytest.approx(cost_ms / 1e3)


def test_compile_flag_and_job_file_set_it(tmp_path, capsys):
    (tmp_path / "job.toml").write_text("[training]\nsdc_every = 7\n")
    assert main(["compile", "mlp", "-o", str(tmp_path / "job"), "--dp", "2", "--stages", "1", "--quiet",
                 "--job", str(tmp_path / "job.toml")]) == 0
    assert load_program(str(tmp_path / "job")).sdc_every == 7
    assert main(["compile", "mlp", "-o", str(tmp_path / "flag"), "--dp", "2", "--stages", "1", "--quiet",
                 "--job", str(tmp_path / "job.toml"), "--sdc-every", "3"]) == 0  # the flag wins
    assert load_program(str(tmp_path / "flag")).sdc_every == 3
    capsys.readouterr()
    assert main(["compile", "mlp", "-o", str(tmp_path / "bad"), "--sdc-every", "-1"]) != 0
    err = capsys.readouterr().err
    assert "--sdc-every -1: give a number of steps >= 0" in err and not (tmp_path / "bad").exists()
