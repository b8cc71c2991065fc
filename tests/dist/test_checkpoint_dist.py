"""Checkpoint and recovery in real torchrun jobs (gloo) of compiled GPT programs:

- bit-exact resume: a rank SIGKILLed at a seeded random step, torchrun restarts the job
  (--max-restarts 1), and per-step losses, final parameters and optimizer state are torch.equal to
  an uninterrupted run; for a 2-stage plan and a 2 x 2 plan of a model with dropout;
- resharded resume: saved under 4 stages and resumed under 2 x 2 (losses and parameters match the
  one-process oracle, fp tolerance); a model with dropout saved under 2 stages and resumed under 3
  draws the uninterrupted 2-stage run's masks (Note [randomness keyed by meaning] in
  runtime/execute/randomness.py): its losses and parameters match that run's;
- `partitioner run` refuses an unwritable checkpoint directory before starting anything.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _runtime_folders import child_env, one_thread  # noqa: F401
from partitioner import compile as compile_plan
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from runtime.execute.reference import train_reference_from_folder
from _shared_launch import Job, prepare

STEPS, EVERY = 6, 2
TOL = dict(rtol=1e-5, atol=1e-6)
# Parameters after 6 AdamW steps: the key bias of qkv gets an exactly-zero gradient in exact
# arithmetic, so Adam normalizes summation-order noise (1e-9) into updates of lr-size; compare those
# to lr * steps.
PARAM_TOL = dict(rtol=1e-4, atol=1e-3 * STEPS)
CLI = os.path.join(os.path.dirname(sys.executable), "partitioner")


def _compile(folder, *, stages, dp, dropout):
    model = gpt(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=dropout)
    plan = compile_plan(model, cluster=ClusterSpec.homogeneous(stages * dp, "cpu"), global_batch=8,
                        num_stages=stages, dp=dp, microbatches=4)
    plan.save(folder)
    return str(folder)


@prepare
def _checkpoint_programs(root: Path):
    """The compiled plans, and the jobs of the session's shared launches (tests/_shared_launch.py):
    2 workers train the 2-stage dropout program uninterrupted, then the same program for 4 steps
    (the checkpoint the 3-stage program resumes from, in the 3-worker launch); 4 workers train 4
    stages for 4 steps, then 2 x 2 resuming from its checkpoint, then the 2 x 2 dropout program
    uninterrupted."""
    spec = {"p2d": (2, 1, 0.1), "p22d": (2, 2, 0.1), "p4": (4, 1, 0.0), "p22": (2, 2, 0.0),
            "p3d": (3, 1, 0.1)}
    out = {name: _compile(root / name, stages=s, dp=d, dropout=p) for name, (s, d, p) in spec.items()}
    out["root"] = root = str(root)
    every = ["--checkpoint-every", str(EVERY)]
    jobs = [Job(2, [out["p2d"], "--steps", str(STEPS), *every, "--run-dir", f"{root}/p2d_full",
                    "--checkpoint-dir", f"{root}/ck_p2d_full"]),
            Job(2, [out["p2d"], "--steps", "4", *every, "--run-dir", f"{root}/p2d_part",
                    "--checkpoint-dir", f"{root}/ck_two"]),
            Job(3, [out["p3d"], "--steps", str(STEPS), *every, "--checkpoint-dir", f"{root}/ck_two"]),
            Job(4, [out["p4"], "--steps", "4", *every, "--checkpoint-dir", f"{root}/ck_four"]),
            Job(4, [out["p22"], "--steps", str(STEPS), *every, "--checkpoint-dir", f"{root}/ck_four"]),
            Job(4, [out["p22d"], "--steps", str(STEPS), *every, "--run-dir", f"{root}/p22d_full",
                    "--checkpoint-dir", f"{root}/ck_p22d_full"])]
    return out, jobs


@pytest.fixture(scope="module")
def plans(shared_launches):
    return shared_launches.result(_checkpoint_programs)[0]


@pytest.fixture(scope="module")
def two_rank_jobs(shared_launches):
    return shared_launches.result(_checkpoint_programs)[1][0:2]


@pytest.fixture(scope="module")
def three_rank_job(shared_launches):
    return shared_launches.result(_checkpoint_programs)[1][2]


@pytest.fixture(scope="module")
def four_rank_jobs(shared_launches):
    outputs = shared_launches.result(_checkpoint_programs)[1][3:]
    return sum(outputs[1:], outputs[0])


def _cli_run(args, *, timeout=150):
    return _check(subprocess.run([CLI, "run", *args], env=child_env(), capture_output=True, text=True,
                                 timeout=timeout))


def _check(result):
    assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _losses(run_dir, start=0):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(start, start + len(rows))), [r["step"] for r in rows]
    return [r["loss"] for r in rows]


def _finals(run_dir, world):
    final = os.path.join(run_dir, "final")
    return ([load_file(os.path.join(final, f"rank_{r}.safetensors")) for r in range(world)],
            [load_file(os.path.join(final, f"optim_rank_{r}.safetensors")) for r in range(world)])


def _assert_bit_exact(full_run, killed_run, world):
    assert _losses(killed_run) == _losses(full_run)  # exact fp32 values, every step
    (p_got, o_got), (p_want, o_want) = _finals(killed_run, world), _finals(full_run, world)
    for r in range(world):
        for part_got, part_want in ((p_got[r], p_want[r]), (o_got[r], o_want[r])):
            assert sorted(part_got) == sorted(part_want)
            for name in part_want:
                assert torch.equal(part_got[name], part_want[name]), (r, name)
    with open(os.path.join(killed_run, "final", "optim_rank_0.json")) as a, \
            open(os.path.join(full_run, "final", "optim_rank_0.json")) as b:
        got, want = json.load(a), json.load(b)
    assert got["param_steps"] == want["param_steps"] and got["lr_scheduler"] == want["lr_scheduler"]


def _committed(ckpt_dir):
    from runtime.resilience.checkpoint import list_step_dirs, read_manifest

    return [s for s in list_step_dirs(ckpt_dir) if read_manifest(ckpt_dir, s)]


@pytest.mark.parametrize("name,world,seed", [("p2d", 2, 4), ("p22d", 4, 5)])
def test_killed_rank_resumes_bit_exact(plans, two_rank_jobs, four_rank_jobs, name, world, seed):
    root = plans["root"]
    rng = random.Random(seed)
    # after the first checkpoint, so that every kill exercises a restore (seeds 4, 5: rank 0 before
    # step 4; rank 2 before step 5, while the checkpoint of step 4 may still be persisting)
    rank, step = rng.randrange(world), rng.randrange(EVERY + 1, STEPS)
    killed = f"{root}/{name}_killed"
    result = _cli_run([plans[name], "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
                       "--max-restarts", "1", "--fail-at", f"{rank}:{step}:kill",
                       "--checkpoint-dir", f"{root}/ck_{name}_killed", "--run-dir", killed])
    out = result.stdout + result.stderr
    assert f"fault injection: kill before step {step}" in out
    with open(os.path.join(killed, "faults.jsonl")) as f:
        assert [json.loads(line)["rank"] for line in f] == [rank]  # fired once: first attempt only
    _assert_bit_exact(f"{root}/{name}_full", killed, world)
    assert _committed(f"{root}/ck_{name}_killed")[0] == STEPS  # the last step is committed
    # (usually "resuming from checkpoint ... at step 2 or 4"; a persist slower than two steps would
    # make it step 0, which must be bit-exact too)


def _assert_params_close(params, state):
    """Every rank's final parameters against the one-process reference (key bias: PARAM_TOL)."""
    for part in params:
        for name, value in part.items():
            tol = PARAM_TOL if name.endswith("attn.qkv.bias") else dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(value, state[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_reshard_four_stages_to_two_by_two(plans, four_rank_jobs):
    assert "resharded from plan" in four_rank_jobs.stderr
    losses = _losses(os.path.join(plans["p4"], "run")) + _losses(os.path.join(plans["p22"], "run"), 4)
    want, state, _ = train_reference_from_folder(plans["p22"], STEPS)
    torch.testing.assert_close(losses, want, **TOL)
    params, _ = _finals(os.path.join(plans["p22"], "run"), 4)
    _assert_params_close(params, state)


def test_reshard_two_stages_to_three_with_dropout(plans, three_rank_job):
    """Steps 4 and 5 run on 3 stages after a resume: with keyed dropout they are the uninterrupted
    2-stage run's steps (per-stage or per-process masks would differ by ~1e-3 in loss)."""
    root = plans["root"]
    result = three_rank_job  # after the 2-worker launch that wrote ck_two
    assert "resharded from plan" in result.stderr and "at step 4" in result.stderr
    losses = _losses(f"{root}/p2d_part") + _losses(os.path.join(plans["p3d"], "run"), 4)
    torch.testing.assert_close(losses, _losses(f"{root}/p2d_full"), **TOL)
    params, _ = _finals(os.path.join(plans["p3d"], "run"), 3)
    uninterrupted = {n: t for part in _finals(f"{root}/p2d_full", 2)[0] for n, t in part.items()}
    _assert_params_close(params, uninterrupted)


def test_run_refuses_an_unwritable_checkpoint_dir(plans, tmp_path, capsys):
    from partitioner.cli import main as cli_main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert cli_main(["run", plans["p2d"], "--checkpoint-dir", str(blocker / "ck")]) == 2
    err = capsys.readouterr().err
    assert "not writable" in err and str(blocker / "ck") in err
