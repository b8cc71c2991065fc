"""Note [no replica check on sharded state] in runtime/resilience/sdc.py: with ZeRO-1 the replicas agree even on
a corrupted state, so a sharded program runs no replica check, and asking for one is refused with
the fix instead of running and seeing nothing (issue: dp 3, --shard-optimizer on, --flip-bit 0:5
was never reported and trained a different model)."""

from __future__ import annotations

import pytest

import partitioner
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import mlp
from partitioner.solver.plan import Plan


def _compile(tmp_path, name, **options):
    compiled = partitioner.compile(mlp(), cluster=ClusterSpec.homogeneous(3, "cpu"), global_batch=6, num_stages=1,
                                   dp=3, **options)
    compiled.save(tmp_path / name)
    return tmp_path / name


def test_a_sharded_plan_runs_no_replica_check_and_says_why(tmp_path, capsys):
    folder = _compile(tmp_path, "zero", shard_optimizer="on")
    plan = Plan.load(folder)
    assert plan.decisions.shard_optimizer is True and plan.decisions.sdc_every == 0
    assert plan.predicted["sdc_check_s_per_step"] == 0.0
    assert main(["inspect", str(folder)]) == 0
    assert "replica check   off: the optimizer state is sharded" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--flip-bit", "0:5"], ["--sdc-every", "5"]])
def test_run_refuses_a_replica_check_on_sharded_state_before_any_worker(tmp_path, capsys, flags):
    folder = _compile(tmp_path, "zero", shard_optimizer="on")
    assert main(["run", str(folder), "--steps", "8", *flags]) != 0
    err = capsys.readouterr().err
    assert "the replica check cannot see corruption when the optimizer state is sharded" in err
    assert "--shard-optimizer off" in err and "Traceback" not in err
    assert not (folder / "run").exists()  # nothing started


def test_asking_for_the_check_keeps_the_state_replicated_or_is_refused(tmp_path):
    folder = _compile(tmp_path, "asked", training={"sdc_every": 5})  # shard_optimizer auto
    plan = Plan.load(folder)
    assert plan.decisions.shard_optimizer is False and plan.decisions.sdc_every == 5
    with pytest.raises(ValueError, match="replica check cannot see corruption when the optimizer state is sharded"):
        _compile(tmp_path, "both", shard_optimizer="on", training={"sdc_every": 5})
