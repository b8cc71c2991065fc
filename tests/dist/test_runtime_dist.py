"""Real multi-process runs of hand-made program folders (torchrun + gloo), checked against the
one-process oracle ``runtime.execute.reference.train_reference`` on the unpartitioned model."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _runtime_folders import (OPTIMIZER, child_env, gpt_folder, mlp_folder,  # noqa: F401
                              one_thread, skip_folder,
                              read_final, read_metrics)
from _shared_launch import Job, prepare
from runtime.data.synthetic import causal_lm_loss, mse_loss, regression_batch, token_batch
from runtime.execute.reference import train_reference, train_reference_from_folder
from runtime.launch.torchrun import free_port
from runtime.execute.train import lr_factor
from safetensors.torch import load_file

TOL = dict(rtol=1e-5, atol=1e-6)


def _assert_params(got: dict, want: dict):
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], **TOL, msg=lambda m: f"{name}: {m}")


@prepare
def _hand_made_folders(root: Path):
    """In the session's shared launches (tests/_shared_launch.py), 2 workers train three folders: a
    2-stage MLP under 1F1B, a 4-stage GPT under interleaved 1F1B (2 stages per rank) with dropout,
    and a 2-stage model whose boundary carries three tensors under GPipe; 4 workers train a GPT as
    2 stages x 2 replicas."""
    mlp, gpt, skip, gpt22 = (str(root / name) for name in ("mlp_1f1b", "gpt_interleaved", "skip_gpipe", "gpt_2x2"))
    mlp_model, _ = mlp_folder(mlp, splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)],
                              schedule="1f1b", num_microbatches=4, global_batch=16, steps=4)
    gpt_model, _ = gpt_folder(gpt, splits=[[0], [1], [2], [3]], ranks=[([0, 2], 0), ([1, 3], 0)],
                              dp=1, schedule="interleaved", num_microbatches=4, global_batch=8,
                              steps=3, dropout=0.1)
    skip_model, _ = skip_folder(skip, schedule="gpipe")
    gpt22_model, _ = gpt_folder(gpt22, splits=[[0], [1]], ranks=[([0], 0), ([1], 0), ([0], 1), ([1], 1)], dp=2,
                                schedule="gpipe", num_microbatches=2, global_batch=8, steps=3)
    context = {"mlp": (mlp, mlp_model), "gpt": (gpt, gpt_model), "skip": (skip, skip_model),
               "gpt_2x2": (gpt22, gpt22_model)}
    return context, [Job(2, [mlp]), Job(2, [gpt]), Job(2, [skip]), Job(4, [gpt22])]


@pytest.fixture(scope="module")
def two_rank_runs(shared_launches):
    context, outputs = shared_launches.result(_hand_made_folders)
    return {**context, "stdout": "".join(out.stdout for out in outputs[:3])}


def test_gpipe_with_three_tensors_between_stages(two_rank_runs):
    """Stage 0 forwards an activation, the raw input (float, no gradient) and an int64 mask."""
    folder, model = two_rank_runs["skip"]
    make_batch = functools.partial(regression_batch, features=8, outputs=4)
    losses, state, _ = train_reference(model, make_batch, mse_loss, OPTIMIZER, 8, 4, 3, 0)
    torch.testing.assert_close([m["loss"] for m in read_metrics(folder)], losses, **TOL)
    _assert_params({**read_final(folder, 0), **read_final(folder, 1)}, state)


def test_mlp_two_stages_1f1b_matches_reference(two_rank_runs):
    folder, model = two_rank_runs["mlp"]
    make_batch = functools.partial(regression_batch, features=8, outputs=4, seed=0)
    losses, state, opt_state = train_reference(model, make_batch, mse_loss, OPTIMIZER, 16, 4, 4, 0)

    metrics = read_metrics(folder)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    torch.testing.assert_close([m["loss"] for m in metrics], losses, **TOL)
    for m in metrics:
        assert m["lr"] == pytest.approx(OPTIMIZER["lr"] * lr_factor(m["step"], OPTIMIZER))
        assert m["step_time_s"] > 0 and m["samples_per_s"] > 0
    assert "step 4/4 loss" in two_rank_runs["stdout"]
    final = {**read_final(folder, 0), **read_final(folder, 1)}
    assert sorted(final) == sorted(state)
    _assert_params(final, state)
    optim = {**load_file(f"{folder}/run/final/optim_rank_0.safetensors"),
             **load_file(f"{folder}/run/final/optim_rank_1.safetensors")}
    for name, st in opt_state.items():
        torch.testing.assert_close(optim[f"{name}.exp_avg"], st["exp_avg"], **TOL)
        torch.testing.assert_close(optim[f"{name}.exp_avg_sq"], st["exp_avg_sq"], rtol=1e-4, atol=1e-9)


def test_gpt_two_stages_two_replicas_gpipe_with_tie(two_rank_runs):
    """2 pipeline stages x 2 data-parallel replicas; the output head reuses the token embedding
    (a tie between stage 0 and stage 1). (Trained in the 4-worker shared launch.)"""
    folder, model = two_rank_runs["gpt_2x2"]
    make_batch = functools.partial(token_batch, vocab=64, seq=8, seed=0)
    losses, state, _ = train_reference(model, make_batch, causal_lm_loss, OPTIMIZER, 8, 2 * 2, 3, 0)

    torch.testing.assert_close([m["loss"] for m in read_metrics(folder)], losses, **TOL)
    finals = [read_final(folder, r) for r in range(4)]
    for final in finals:
        _assert_params(final, state)
    # the tied copies, and both replicas, hold the same values
    torch.testing.assert_close(finals[0]["tok_emb.weight"], finals[1]["tok_emb.weight"], rtol=0, atol=0)
    for r in (0, 1):
        for name in finals[r]:
            torch.testing.assert_close(finals[r][name], finals[r + 2][name], rtol=0, atol=0)


def test_gpt_interleaved_with_dropout_matches_stage_chain(two_rank_runs):
    """Interleaved 1F1B, 2 ranks x 2 stages each, dropout on: the oracle chains the stage modules
    in one process and draws the same dropout masks (Note [randomness per microbatch])."""
    folder, model = two_rank_runs["gpt"]
    assert "F0.s2" in two_rank_runs["stdout"]  # rank 0 printed the interleaved schedule
    losses, state, _ = train_reference_from_folder(folder, 3)
    torch.testing.assert_close([m["loss"] for m in read_metrics(folder)], losses, **TOL)
    final0, final1 = read_final(folder, 0), read_final(folder, 1)
    _assert_params({**final0, **final1}, state)
    torch.testing.assert_close(final0["tok_emb.weight"], final1["tok_emb.weight"], rtol=0, atol=0)
    # dropout did act: the dropout-free model gives other losses
    plain, _, _ = train_reference(_without_dropout(model),
                                  functools.partial(token_batch, vocab=64, seq=8, seed=0),
                                  causal_lm_loss, OPTIMIZER, 8, 4, 1, 0)
    assert abs(plain[0] - losses[0]) > 1e-4


def _without_dropout(model):
    for blk in model.blocks:
        blk.p = 0.0
    return model


def _start_ranks(folder, world):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(child_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE=str(world), RANK=str(r), LOCAL_RANK=str(r))
        out = open(os.path.join(folder, f"out_{r}.txt"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(folder, "train.py")],
                                      env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_dead_or_hung_rank_makes_the_others_exit(tmp_path, sig):
    """A killed peer (sockets close) or a hung one (sockets stay open; the collective timeout must
    fire) makes the survivor exit non-zero, never hang."""
    folder = str(tmp_path)
    mlp_folder(folder, splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)], steps=10**6, timeout_s=5)
    procs = _start_ranks(folder, 2)
    try:
        metrics = os.path.join(folder, "run", "metrics.jsonl")
        deadline = time.time() + 60
        while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 2):
            assert time.time() < deadline, "training never started"
            assert all(p.poll() is None for p in procs), open(f"{folder}/out_0.txt").read()[-3000:]
            time.sleep(0.05)
        procs[1].send_signal(getattr(signal, sig))
        t0 = time.time()
        rc = procs[0].wait(timeout=60)
        waited = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = open(os.path.join(folder, "out_0.txt")).read()
    assert rc != 0, out[-2000:]
    assert "[rank 0]" in out
    assert "Traceback" not in out and "[rank 0] a peer rank" in out, out[-2000:]  # one line
    assert waited < (3 if sig == "SIGKILL" else 5 + 15), waited


def test_partitioner_run_says_torchruns_failure_in_one_line(tmp_path):
    """A killed rank under `partitioner run`: the ranks' own lines, then one line for torchrun's
    failure report, never its traceback and box (Note [torchrun's failure box])."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import mlp

    folder = tmp_path / "mlp"
    partitioner.compile(mlp(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4, num_stages=2,
                        microbatches=2).save(folder)
    done = subprocess.run([sys.executable, "-m", "partitioner", "run", str(folder), "--steps", "3", "--fail-at",
                           "1:1:kill", "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ck"),
                           "--quiet"], env=child_env(), capture_output=True, text=True, timeout=300)
    said = [line for line in done.stderr.splitlines() if line.startswith("[run] torchrun:")]
    assert done.returncode != 0 and "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, \
        done.stderr[-3000:]
    assert "[rank 1] fault injection: kill before step 1" in done.stderr and "[rank 0] a peer rank died" in done.stderr
    assert len(said) == 1 and "rank 1 was killed (SIGKILL)" in said[0] and "rank 0 exited with code" in said[0], \
        done.stderr[-3000:]
