"""Re-planning for the ranks left (partitioner/replan.py, Note [re-plan on the same cuts]) and what
`run --elastic` refuses before any agent starts (partitioner/cli/elastic.py, Note [elastic run]):
one process, real compiles of tiny GPTs, the cost model pricing every candidate."""

from __future__ import annotations

import dataclasses
import json

import pytest

from partitioner import compile as compile_plan
from partitioner import replan as replan_module
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from partitioner.replan import ElasticRefusal, refusal_for, replan, write_replanned
from partitioner.solver.plan import Plan
from partitioner.cli.elastic import check_elastic
from runtime.launch.elastic import ElasticRefusalError, hosts_and_counts, used_ranks
from runtime.launch.run_options import FlagError, RunOptions
from runtime.program.spec import load_program
from runtime.resilience import faults


def _compile(folder, **request):
    model = gpt(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=0.1)
    compile_plan(model, cluster=ClusterSpec.homogeneous(4, "cpu", devices_per_node=2), global_batch=8,
                 training={"memory_tier": "auto"}, **request).save(folder)
    return folder


@pytest.fixture(scope="module")
def p22(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("replan") / "p22", num_stages=2, dp=2, microbatches=4)


@pytest.fixture(scope="module")
def p14(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("replan") / "p14", num_stages=1, dp=4, microbatches=1)


def test_two_survivors_of_a_2x2_plan_run_2_stages_x_dp_1_on_the_same_batch(p22, tmp_path):
    result = replan(p22, [0, 1])
    plan = result.plan
    assert (plan.num_stages, plan.dp, plan.num_microbatches, plan.world_size) == (2, 1, 8, 2)
    assert plan.global_batch == 8 and plan.microbatch_size == 1  # the same samples per step
    old = Plan.load(p22)
    assert [r.stage for r in plan.regions] == [r.stage for r in old.regions]  # the same cuts
    assert plan.decisions.memory_tier["mode"] == "none"  # one host left: no peer to copy to
    assert {c.schedule for c in result.candidates} == {"1f1b", "gpipe"}
    out = write_replanned(p22, result, tmp_path / "p22.elastic-h0")
    program = load_program(str(out))  # its files hash as plan.json says (Note [folder integrity])
    assert program.world_size == 2 and [r.stages for r in program.ranks] == [(0,), (1,)]
    assert not list(out.glob("rank_*.py")) and (out / "train.py").read_text().count("WORLD_SIZE = 2") == 1
    for k in (0, 1):  # the stage code is the old one, under the new plan's hash
        new_text = (out / f"stage_{k}.py").read_text()
        assert new_text == (p22 / f"stage_{k}.py").read_text().replace(result.old_plan_hash, plan.content_hash())
    record = json.loads((out / "elastic.json").read_text())
    assert record["survivors"] == [0, 1] and record["old_plan_hash"] == result.old_plan_hash


def test_three_survivors_of_a_2x2_plan_leave_one_rank_idle(p22):
    plan = replan(p22, [0, 1, 3]).plan
    assert (plan.dp, plan.world_size, plan.num_microbatches) == (1, 2, 8)


def test_dp_must_divide_the_global_batch_in_whole_microbatches(p14):
    # 1 stage x dp 4, microbatch 2: 3 survivors cannot share 8 samples in microbatches of 2 (dp 3
    # needs 6 or 12), so dp 2 with 2 microbatches each
    result = replan(p14, [0, 1, 2])
    assert (result.plan.dp, result.plan.num_microbatches, result.plan.microbatch_size) == (2, 2, 2)
    assert all(c.dp != 3 for c in result.candidates)


def test_refusals_name_the_value_and_the_fix(p22):
    with pytest.raises(ElasticRefusal, match="1 surviving rank cannot hold the 2 pipeline stages"):
        replan(p22, [2])
    with pytest.raises(ElasticRefusal, match="give distinct ranks of the program's 4"):
        replan(p22, [0, 7])
    plan = Plan.load(p22)
    assert "tensor parallelism 2" in refusal_for(dataclasses.replace(plan, tensor_parallel=2), [0, 1])
    assert "--schedule 1f1b or gpipe" in refusal_for(dataclasses.replace(plan, schedule="interleaved"), [0, 1])
    assert refusal_for(plan, [0, 1]) is None


def test_no_candidate_that_fits_memory_is_refused(p22, monkeypatch):
    real = replan_module.survivor_cluster

    def tiny(cluster, devices):
        small = real(cluster, devices)
        return dataclasses.replace(small, devices=tuple(dataclasses.replace(d, memory_bytes=1 << 16)
                                                        for d in small.devices))

    monkeypatch.setattr(replan_module, "survivor_cluster", tiny)
    with pytest.raises(ElasticRefusal, match="fits the 2 surviving ranks' memory"):
        replan(p22, [0, 1])


def test_the_replan_command(p22, tmp_path, capsys):
    out = tmp_path / "by_hand"
    assert main(["replan", str(p22), "--ranks", "0,1", "-o", str(out)]) == 0
    assert "2 stages x dp 1, 8 microbatches" in capsys.readouterr().out
    assert load_program(str(out)).world_size == 2
    assert main(["replan", str(p22), "--ranks", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 1 surviving rank cannot hold") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flags, needle", [
    (["--elastic"], "--elastic runs one torchrun agent per host: give --hosts"),
    (["--elastic", "--hosts", "0,0,0,0"], "one host cannot lose a host and go on"),
    (["--elastic", "--hosts", "0,1,0,1"], "give each host's ranks together"),
    (["--elastic", "--hosts", "0,1,1,1", "--fail-host", "1:3:permanent"],
     "--fail-host 1:3:permanent: the survivors could not go on: 1 surviving rank cannot hold the 2"),
    (["--fail-host", "1:3:permanent", "--hosts", "0,0,1,1"], "a host lost for good needs --elastic"),
    (["--hosts", "0,0,1,1", "--host-timeout", "3"], "--host-timeout 3.0: give seconds > 0 with --elastic"),
])
def test_run_elastic_refuses_before_any_agent_starts(p22, capsys, flags, needle):
    assert main(["run", str(p22), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1], err
    assert not (p22.parent / "p22.elastic-h0").exists()  # nothing prepared, nothing started
    assert not (p22 / "run").exists() and not (p22 / "checkpoints").exists()


def test_fail_host_permanent_parses():
    assert faults.parse_fail_host("1:5:permanent") == (1, 5, faults.PERMANENT)
    assert faults.parse_fail_host("1:5") == (1, 5, 0)
    with pytest.raises(ValueError, match="HOST:STEP:permanent"):
        faults.parse_fail_host("1:5:forever")


def test_hosts_and_counts():
    assert hosts_and_counts([0, 0, 1, 1]) == {0: 2, 1: 2}
    assert hosts_and_counts([0, 1, 1]) == {0: 1, 1: 2}
    with pytest.raises(ValueError, match="each host's ranks together"):
        hosts_and_counts([1, 1, 0, 0])


def test_the_replan_may_use_fewer_ranks_than_survive_and_the_rest_stand_by(tmp_path):
    """The issue's case (Note [standing by]): dp 3 at global batch 6 (microbatch 2) on hosts 0,1,2;
    host 1 lost: dp 2 would need 6 % 4 == 0, so the 2 survivors' only plan is dp 1 on 1 rank, the
    second survivor stands by; check_elastic lets the job start (every one-host loss has a plan)."""
    folder = tmp_path / "p13"
    compile_plan(gpt(layers=2, width=32, heads=2, vocab=64, seq=16), cluster=ClusterSpec.homogeneous(
        3, "cpu", devices_per_node=1), global_batch=6, num_stages=1, dp=3, microbatches=1).save(folder)
    got = replan(folder, [0, 2])
    assert (got.plan.world_size, got.plan.dp, got.plan.num_microbatches) == (1, 1, 3)
    assert {c.dp for c in got.candidates} == {1}
    assert used_ranks(2, got.plan.world_size) == ((0,), (1,))
    assert used_ranks(2, 2) == ((0, 1), ())
    with pytest.raises(ElasticRefusalError, match="re-planned program has 3 ranks for the 2 that met"):
        used_ranks(2, 3)
    plan = Plan.from_dict(json.loads((folder / "plan.json").read_text()))
    check_elastic(folder, RunOptions.parse(["--elastic", "--hosts", "0,1,2", "--fail-host", "1:3:permanent"],
                                           side="run"), plan)


def test_check_elastic_refuses_a_host_whose_loss_has_no_plan(p22):
    """Not only a drilled host: losing host 0 of 0,0,0,1 leaves 1 rank for 2 stages, refused before
    any agent starts, in one line naming the fix."""
    plan = Plan.from_dict(json.loads((p22 / "plan.json").read_text()))
    with pytest.raises(FlagError) as got:
        check_elastic(p22, RunOptions.parse(["--elastic", "--hosts", "0,0,0,1"], side="run"), plan)
    line = str(got.value)
    assert line.startswith("--elastic --hosts 0,0,0,1: a loss of host 0 would leave rank(s) 3 no plan (1 surviving "
                           "rank cannot hold the 2 pipeline stages") and "spread the ranks over more hosts" in line
    assert "\n" not in line
