"""A user's own model, as README "Bring your own model" shows it: a file with a model class, build(), module-level
make_batch and loss, no Workload.source, compiled, run and verified from the CLI in the user's
folder; a Hugging Face model whose batches are dicts of keyword inputs (input_ids, attention_mask,
labels; it computes its own loss), compiled with a job file and flags.

The model files are tests/own_model/*.py, copied into a temporary folder that is no package and
not on sys.path, as a user's would be.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

OWN = Path(__file__).resolve().parent.parent / "own_model"


def cli(*args, cwd, timeout=600):
    done = subprocess.run([sys.executable, "-m", "partitioner", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"partitioner {' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    home = tmp_path_factory.mktemp("user")
    for name in ("my_model.py", "hf_labels_model.py", "job.toml"):
        shutil.copy(OWN / name, home / name)
    return home


def test_own_model_file_compiles_runs_and_verifies_from_the_cli(user_dir, tmp_path):
    cli("compile", "my_model.py:build", "-o", "out", "--devices", "2", "--stages", "2", "--global-batch", "8",
        "-q", cwd=user_dir)
    plan = json.loads((user_dir / "out" / "plan.json").read_text())
    # Note [user code travels] holds: the file went into the folder, hashed, and the program names the copy.
    assert plan["program"]["data"]["make_batch"][0] == "user/my_model.py:make_batch"
    assert plan["program"]["data"]["loss_fn"][0] == "user/my_model.py:loss"
    assert "user/my_model.py" in plan["files"]
    # The folder runs wherever it is: moved away from the user's file, run and verified from a third place.
    moved = tmp_path / "elsewhere" / "out"
    shutil.copytree(user_dir / "out", moved)
    done = cli("verify", moved, "--steps", "2", cwd=tmp_path)
    assert "verdict: PASS" in done.stdout, done.stdout


def test_dict_batch_model_with_a_job_file_runs_and_verifies(user_dir, tmp_path):
    from partitioner.cli.verify import check_run

    cli("compile", "hf_labels_model.py:build", "-o", "dout", "--job", "job.toml", "--lr", "0.003", "--stages", "2",
        "--global-batch", "8", "-q", cwd=user_dir)
    plan = json.loads((user_dir / "dout" / "plan.json").read_text())
    program = plan["program"]
    assert program["world_size"] == 2  # the job file's cluster: 2 cpu devices
    assert program["data"]["keywords"] == ["input_ids", "attention_mask", "labels"]
    # Note [training settings merge] holds: the flag beats the job file, the job file beats the defaults,
    # and what neither says keeps its default.
    optimizer = program["optimizer"]
    assert optimizer["lr"] == 0.003
    assert optimizer["betas"] == [0.8, 0.9] and optimizer["lr_schedule"] == "linear"
    assert optimizer["total_steps"] == 4 and optimizer["warmup_steps"] == 1
    assert program["clip_grad_norm"] == 1.0
    assert optimizer["weight_decay"] == 0.1 and optimizer["eps"] == 1e-8
    assert program["checkpoint_every"] == 2
    run_dir = tmp_path / "run"
    # `run` takes train.py's memory-tier and host flags: two "hosts" here, one folder they share.
    done = cli("run", user_dir / "dout", "--steps", "3", "--run-dir", run_dir, "--checkpoint-dir", tmp_path / "ckpt",
               "--memory-tier", "none", "--hosts", "0,1", cwd=tmp_path)
    said = done.stdout + done.stderr
    assert "memory tier every 1 step(s)" in said and "(hosts 0,1)" in said, said
    assert "not shared across nodes" not in done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(" eta " in line and " mfu " in line for line in lines), done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert len(r["peak_memory_bytes"]) == 2 and min(r["peak_memory_bytes"]) > 0
        assert r["model_flops"] > 0 and r["achieved_flops_per_s"] > 0 and 0 < r["mfu"] < 1
    assert records[-1]["eta_s"] == 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))  # tensorboard is in the test extras
    report = check_run(user_dir / "dout", run_dir)  # verify's verdict: the one-process oracle, keyword inputs
    assert report.ok, report.text()
    # GPT-2's default dropout: the oracle is the traced graph with keyed random ops, fed by position
    assert report.oracle == "unpartitioned traced graph (keyed randomness)"
