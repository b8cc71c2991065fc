"""One flag table for `partitioner run` and train.py (Note [one flag table] in runtime/launch/run_options.py):
an unknown flag is refused by both, naming the nearest known one; a bad value is refused by both alike."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from partitioner.cli import main
from runtime.launch.run_options import FEATURE_FLAGS, FLAGS, FlagError, RunOptions
from runtime.launch.torchrun import run_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("flags") / "one"
    assert main(["compile", "mlp", "-o", str(out), "--devices", "1", "-q"]) == 0
    return out


def _env() -> dict:
    env = run_env(pythonpath=ROOT)  # the launched program imports this checkout
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def test_the_table_and_the_options_name_the_same_settings():
    # a feature's flags are its module's (Note [one feature, one module]): RunOptions.features holds them
    assert [f.dest for f in FLAGS if f.dest not in FEATURE_FLAGS] == [f.name for f in dataclasses.fields(RunOptions)
                                                                      if f.name != "features"]
    assert len({f.name for f in FLAGS}) == len(FLAGS)


def test_what_partitioner_run_passes_on_is_what_a_rank_reads_back():
    given = ["--steps", "7", "--checkpoint-every", "3", "--keep-checkpoints", "2", "--fail-at", "0:2:kill",
             "--fail-at", "1:4", "--sdc-every", "0", "--collective-timeout", "30.5", "--memory-tier", "copy",
             "--hosts", "0,1", "--measure-memory", "--quiet", "--log-every", "2", "--elastic",
             "--fail-host", "1:3:permanent"]
    options = RunOptions.parse(given, side="run")
    assert options.fail_at == ("0:2:kill", "1:4") and options.collective_timeout == 30.5
    assert RunOptions.parse(options.to_argv(), side="rank") == options
    with_restarts = RunOptions.parse(["--max-restarts", "2"], side="run")
    assert with_restarts.max_restarts == 2 and with_restarts.to_argv() == []  # torchrun's, no rank's
    timed = RunOptions.parse(["--elastic", "--host-timeout", "3"], side="run")
    assert timed.host_timeout == 3.0 and timed.to_argv() == ["--elastic"]  # the agents' setting, no rank's
    with pytest.raises(FlagError, match="unknown flag --max-restarts"):
        RunOptions.parse(["--max-restarts", "2"], side="rank")


def test_a_misspelt_flag_is_refused_with_the_nearest_one():
    with pytest.raises(FlagError, match=r"unknown flag --chekpoint-every: did you mean --checkpoint-every\?"):
        RunOptions.parse(["--chekpoint-every", "5"])
    with pytest.raises(FlagError, match="unknown flag --checkpoint-ev"):  # no abbreviations: one spelling
        RunOptions.parse(["--checkpoint-ev", "5"])
    with pytest.raises(FlagError, match="unknown flag --zzz: see train.py --help"):
        RunOptions.parse(["--zzz"])


def test_partitioner_run_refuses_an_unknown_flag(one_rank):
    done = subprocess.run([sys.executable, "-m", "partitioner", "run", str(one_rank), "--chekpoint-every", "5"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr.strip() == ("error: partitioner run: unknown flag --chekpoint-every: did you mean "
                                   "--checkpoint-every?"), done.stderr
    assert not (one_rank / "run").exists() and not (one_rank / "checkpoints").exists()  # nothing started


def test_train_py_refuses_an_unknown_flag(one_rank):
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    done = subprocess.run([sys.executable, str(one_rank / "train.py"), "--steps", "1", "--chekpoint-every", "5"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done
    lines = done.stderr.strip().splitlines()
    assert lines == ["[rank 0] FlagError: train.py: unknown flag --chekpoint-every: did you mean "
                     "--checkpoint-every?"], done.stderr
    assert not (one_rank / "run").exists()  # refused before a step


@pytest.mark.parametrize("flags, needle", [
    (["--keep-checkpoints", "0"], "--keep-checkpoints 0: keep at least 1"),
    (["--fail-at", "1:2"], "--fail-at 1:2: rank 1 does not exist"),
    (["--memory-every", "0"], "--memory-every 0: snapshot every 1 or more steps"),
    (["--log-every", "3"], "--log-every 3 thins the step lines of --quiet: add --quiet"),
    (["--eval-every", "0"], "--eval-every 0: evaluate every 1 or more steps"),
    (["--eval-every", "2", "--eval-batches", "0"], "--eval-batches 0: evaluate on 1 or more validation batches"),
    (["--sdc-canary-every", "-1"], "--sdc-canary-every -1: give a number of steps >= 0"),
    (["--fault-matmul", "1:2"], "--fault-matmul 1:2: rank 1 step 2 is never reached"),
    (["--fail-host", "0:2:permanent"], "--fail-host 0:2:permanent: a host lost for good needs --elastic"),
])
def test_partitioner_run_and_a_rank_refuse_a_value_alike(one_rank, capsys, flags, needle):
    assert main(["run", str(one_rank), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1, err
    options = None
    with pytest.raises(FlagError) as refused:
        options = RunOptions.parse(flags)
        options.check_for(world_size=1, sharded=False)
    assert needle in str(refused.value)


def test_partitioner_run_refuses_canaries_without_a_second_replica(one_rank, capsys):
    # the one-rank program has no replica to re-run a stage on (Note [compute canaries])
    assert main(["run", str(one_rank), "--sdc-canary-every", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sdc-canary-every 3: the program has dp 1" in err and len(err.splitlines()) == 1, err
    assert not (one_rank / "run").exists()
