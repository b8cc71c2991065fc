"""What `run --elastic` does with a canary's exclusion (Note [excluding a host] in
runtime/resilience/exclusion.py), in one process: which host goes, which exclusions stop the job
with exit 4 and the line saying why, the record kept, the restarted round refused, the drills
renumbered, the closing note. The run itself: tests/dist/test_exclude_dist.py."""

from __future__ import annotations

import json
import os
import time

import pytest

from partitioner import compile as compile_plan
from partitioner.cli.elastic import _exclude
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from partitioner.solver.plan import Plan
from runtime.launch.elastic import closing_note, renumbered_faults
from runtime.launch.run_options import RunOptions
from runtime.resilience import exclusion


def _write(run_dir, **body):
    os.makedirs(run_dir, exist_ok=True)
    full = {"exclude_ranks": [3], "step": 5, "good_step": 4, "certain": True, "hosts_of_ranks": [1],
            "time_unix": time.time(), **body}
    with open(os.path.join(run_dir, exclusion.EXCLUDE_FILE), "w") as fh:
        json.dump(full, fh)
    return exclusion.load(os.path.join(run_dir, exclusion.EXCLUDE_FILE))


def test_a_certain_blame_drops_the_whole_host(tmp_path):
    exc = _write(str(tmp_path))
    drop, line = exclusion.hosts_to_drop(exc, [0, 0, 1, 1], set())
    assert drop == [1]
    assert line.startswith("[run] elastic: host(s) 1 excluded:") and "rank(s) 3" in line and "step 4" in line


def test_an_uncertain_pair_on_one_host_drops_that_host(tmp_path):
    exc = _write(str(tmp_path), exclude_ranks=[2, 3], hosts_of_ranks=[1], certain=False)
    drop, line = exclusion.hosts_to_drop(exc, [0, 0, 1, 1], set())
    assert drop == [1] and "rank(s) 2, 3 (one of them: both on this host)" in line, line


@pytest.mark.parametrize("body,gone,needle", [
    ({"certain": False, "exclude_ranks": [1, 3], "hosts_of_ranks": [0, 1]}, set(), "no host is excluded on a guess"),
    ({"hosts_of_ranks": None}, set(), "not their hosts"),
    ({}, {0}, "no other host is left"),
    ({"hosts_of_ranks": [0, 1]}, set(), "no other host is left"),
])
def test_an_exclusion_that_cannot_be_acted_on_stops_with_exit_4(tmp_path, body, gone, needle):
    drop, line = exclusion.hosts_to_drop(_write(str(tmp_path), **body), [0, 0, 1, 1], gone)
    assert drop is None and needle in line and "exit 4" in line, line


def test_fresh_means_written_in_this_round(tmp_path):
    run = str(tmp_path)
    _write(run)
    assert exclusion.fresh(run, time.time() + 60) is None
    got = exclusion.fresh(run, time.time() - 60)
    assert got is not None and got.ranks == (3,) and got.good_step == 4 and not got.set_aside
    assert exclusion.fresh(str(tmp_path / "none"), 0.0) is None


def test_a_restarted_worker_of_an_excluded_round_leaves_with_exit_4(tmp_path, monkeypatch):
    run = str(tmp_path)
    monkeypatch.setenv(exclusion.ROUND_ENV, repr(time.time() - 60))
    exclusion.stop_if_excluded(run)  # nothing yet: it trains
    _write(run)
    with pytest.raises(exclusion.ExcludedRound) as got:
        exclusion.stop_if_excluded(run)
    assert got.value.exit_code == 4
    monkeypatch.delenv(exclusion.ROUND_ENV)
    exclusion.stop_if_excluded(run)  # not an elastic round: the launcher's exit code handles it


def test_fault_drills_follow_the_survivors_new_ranks():
    assert renumbered_faults(("3:3:permanent", "1:5", "0:2"), (0, 1)) == ("1:5", "0:2")
    assert renumbered_faults(("3:3",), (2, 3)) == ("1:3",)


@pytest.fixture(scope="module")
def p22(tmp_path_factory):
    folder = tmp_path_factory.mktemp("p22") / "p22"
    compile_plan(gpt(layers=4, width=32, heads=2, vocab=64, seq=16), cluster=ClusterSpec.homogeneous(4, "cpu"),
                 global_batch=8, num_stages=2, dp=2, microbatches=4).save(folder)
    return folder, Plan.load(folder)


def test_the_launcher_relaunches_without_the_host_and_keeps_the_record(p22, tmp_path, capsys):
    folder, plan = p22
    run = str(tmp_path / "run")
    exc = _write(run, exclude_ranks=[2], hosts_of_ranks=[1])
    gone, env = _exclude(folder, RunOptions(hosts="0,0,1,1"), plan, exc, frozenset(), run, {"X": "1"})
    assert gone == {1} and env[exclusion.EXCLUSION_ENV] == os.path.join(run, exclusion.HANDLED_FILE)
    assert env["X"] == "1" and not os.path.exists(os.path.join(run, exclusion.EXCLUDE_FILE))
    row = json.loads(open(os.path.join(run, "recovery.jsonl")).read().splitlines()[-1])
    assert (row["kind"], row["excluded_hosts"], row["survivors"], row["good_step"]) == ("exclusion", [1], [0, 1], 4)
    assert "host(s) 1 excluded" in capsys.readouterr().err


def test_the_launcher_stops_when_the_ranks_left_cannot_hold_the_stages(p22, tmp_path, capsys):
    folder, plan = p22
    run = str(tmp_path / "run")
    exc = _write(run, exclude_ranks=[2], hosts_of_ranks=[1])
    gone, env = _exclude(folder, RunOptions(hosts="0,1,1,1"), plan, exc, frozenset(), run, {})
    assert gone == frozenset() and exclusion.EXCLUSION_ENV not in env
    err = capsys.readouterr().err
    assert "the ranks left (0) cannot go on" in err and "pipeline stages" in err and "exit 4" in err, err
    assert os.path.exists(os.path.join(run, exclusion.EXCLUDE_FILE))  # kept: `run` exits 4 on it


def test_an_uncertain_blame_is_not_acted_on(p22, tmp_path, capsys):
    folder, plan = p22
    run = str(tmp_path / "run")
    exc = _write(run, exclude_ranks=[1, 3], hosts_of_ranks=[0, 1], certain=False)
    gone, env = _exclude(folder, RunOptions(hosts="0,0,1,1"), plan, exc, frozenset(), run, {})
    assert gone == frozenset() and exclusion.EXCLUSION_ENV not in env
    assert "either may be the faulty one" in capsys.readouterr().err


def test_the_closing_note_says_the_host_was_excluded(tmp_path):
    run = str(tmp_path)
    row = {"kind": "elastic", "rank": 0, "step": 4, "tier": "disk", "lost_hosts": [1], "new_plan": "b",
           "folder": "DIR.elastic-h0", "since_loss_s": 2.0, "good_step": 4, "time_unix": time.time(),
           "plan": {"num_stages": 1, "dp": 2, "num_microbatches": 4, "schedule": "1f1b", "world_size": 2}}
    with open(os.path.join(run, "recovery.jsonl"), "w") as fh:
        fh.write(json.dumps(row) + "\n")
    note = closing_note(run)
    assert note.startswith("[run] elastic: host(s) 1 excluded by a compute canary") and "after step 4" in note
