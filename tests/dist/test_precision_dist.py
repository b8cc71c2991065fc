"""Mixed precision, clipping and sharded optimizer state in real programs, against the
one-process oracle under the same policy (runtime/execute/reference.py):

- bf16-mixed and fp16-mixed on 2 stages x 2 replicas with sharded AdamW state and clipping
  (a tie across the stages): losses, parameters and the recorded global gradient norm match the
  oracle within the policy's tolerance (partitioner/cli/verify.py TOLERANCES), replicas agree exactly;
- a checkpoint written at dp 2 with sharded state resumes at dp 1 (unsharded) and at dp 4
  (sharded, other slices) on the oracle's losses;
- a compiled plan that fits only with sharded state (dp 2 asked for, devices too small for
  replicated AdamW state) is chosen by the solver, and its program trains like the oracle.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import dataclasses

import pytest
import torch

from _runtime_folders import gpt_folder, mlp_folder, one_thread  # noqa: F401
from _shared_launch import Job, prepare
from partitioner import PartitionInfeasibleError
from partitioner import compile as compile_plan
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import load_workload
from partitioner.cli.verify import GRAD_NORM_TOLERANCE, check_run, TOLERANCES, read_grad_norms, read_program_run
from runtime.execute.reference import train_reference_from_folder

CLIP = 0.5  # below the tiny GPT's gradient norm (about 6): every step is clipped


MLP_SPEC = "mlp:features=32,hidden=256,depth=4,outputs=8,batch=4"
# Predicted peak per rank of that MLP at dp 2 (1 stage, global batch 8): 4.16 MB with replicated
# AdamW state, 3.33 MB sharded (half the 1.66 MB of state): a 3.7 MB device fits only the latter.
SMALL_DEVICE_BYTES = 3_700_000


def _small_cluster():
    base = ClusterSpec.homogeneous(2, "cpu")
    return dataclasses.replace(base, devices=tuple(dataclasses.replace(d, memory_bytes=SMALL_DEVICE_BYTES)
                                                   for d in base.devices))


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@prepare
def _precision_folders(root: Path):
    """In the session's shared launches (tests/_shared_launch.py): a new job is one more Job(world,
    [FOLDER, FLAGS...]) in the list returned below."""
    root = str(root)
    ranks = [([0], 0), ([1], 0), ([0], 1), ([1], 1)]
    folders = {}
    for prec in ("bf16-mixed", "fp16-mixed"):
        folders[prec] = os.path.join(root, prec)
        os.makedirs(folders[prec])
        gpt_folder(folders[prec], splits=[[0], [1]], ranks=ranks, dp=2, schedule="gpipe", num_microbatches=2,
                   global_batch=8, steps=3, extra={"precision": prec, "clip_grad_norm": CLIP,
                                                    "shard_optimizer": True})
    # one stage, three dp degrees: the checkpoint of dp 2 (sharded) resumed at dp 1 and dp 4
    extra = {"shard_optimizer": True, "clip_grad_norm": 1.0, "checkpoint_every": 2}
    for dp in (1, 2, 4):
        folders[f"dp{dp}"] = os.path.join(root, f"dp{dp}")
        os.makedirs(folders[f"dp{dp}"])
        mlp_folder(folders[f"dp{dp}"], splits=[[0, 1, 2, 3]], ranks=[([0], r) for r in range(dp)], dp=dp,
                   num_microbatches=2, global_batch=16, steps=4, extra=extra, plan_hash=f"test-dp{dp}")
    workload = load_workload(MLP_SPEC)
    compiled = compile_plan(workload, cluster=_small_cluster(), global_batch=8, dp=2,
                            training={"model_spec": MLP_SPEC})
    folders["fits_sharded"] = os.path.join(root, "fits_sharded")
    compiled.save(folders["fits_sharded"])
    ck = os.path.join(root, "ck_dp2")

    def copy_for(dp):  # after the world-2 launch wrote ck_dp2
        return lambda: shutil.copytree(ck, os.path.join(root, f"ck_for_dp{dp}"))

    jobs = [Job(2, [folders["dp2"], "--steps", "2", "--checkpoint-dir", ck]),
            Job(2, [folders["fits_sharded"], "--steps", "3"]),
            Job(4, [folders["bf16-mixed"]]), Job(4, [folders["fp16-mixed"]]),
            Job(4, [folders["dp4"], "--steps", "4", "--checkpoint-dir", os.path.join(root, "ck_for_dp4")],
                before=copy_for(4)),
            Job(1, [folders["dp1"], "--steps", "4", "--checkpoint-dir", os.path.join(root, "ck_for_dp1")],
                before=copy_for(1))]
    return {"root": root, **folders}, jobs


@pytest.fixture(scope="module")
def runs(shared_launches):
    context, outputs = shared_launches.result(_precision_folders)
    return {**context, "logs": "".join(out.stderr for out in outputs[2:])}


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_sharded_matches_oracle(runs, precision):
    folder = runs[precision]
    report = check_run(folder, os.path.join(folder, "run"), steps=3)  # what `partitioner verify` decides
    assert report.ok and report.precision == precision, report.text()
    norms: list[float] = []
    want_losses, state, _ = train_reference_from_folder(folder, 3, grad_norms=norms)
    losses, params, replica_diff = read_program_run(os.path.join(folder, "run"))
    loss_tol, param_tol = TOLERANCES[precision]
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= loss_tol, (losses, want_losses)
    assert max(float((params[n] - state[n]).abs().max()) for n in params) <= param_tol
    assert replica_diff == 0.0  # the all-gather leaves both replicas bit-identical
    got_norms = read_grad_norms(os.path.join(folder, "run"))
    assert len(got_norms) == 3
    for got, want in zip(got_norms, norms):  # one number: the tie counted once, replicas once
        assert got == want or abs(got - want) / want <= GRAD_NORM_TOLERANCE[precision], (got_norms, norms)
    assert all(n > CLIP for n in norms if n != float("inf"))  # clipping was active on every clean step


def test_fp16_overflow_skips_everywhere(runs):
    rows = _rows(os.path.join(runs["fp16-mixed"], "run"))
    skipped = [r["skipped"] for r in rows]
    oracle_skipped: list[bool] = []
    train_reference_from_folder(runs["fp16-mixed"], 3, skipped=oracle_skipped)
    assert skipped == oracle_skipped  # the same steps skipped as the oracle (loss scale 2**16 overflows)
    assert any(skipped), "no step overflowed: the test would pass without loss scaling"
    assert rows[0]["loss_scale"] == 2.0 ** 16
    for before, after in zip(rows, rows[1:]):
        if after["skipped"]:
            assert after["loss_scale"] == before["loss_scale"] / 2


@pytest.mark.parametrize("dp", [1, 4])
def test_sharded_checkpoint_resumes_at_another_dp(runs, dp):
    assert runs["logs"].count("resharded from plan test-dp2") == 2, runs["logs"][-3000:]
    losses = [r["loss"] for r in _rows(os.path.join(runs["dp2"], "run"))]
    losses += [r["loss"] for r in _rows(os.path.join(runs[f"dp{dp}"], "run"))]
    assert len(losses) == 4
    want, state, _ = train_reference_from_folder(runs[f"dp{dp}"], 4)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    _, params, replica_diff = read_program_run(os.path.join(runs[f"dp{dp}"], "run"))
    assert replica_diff == 0.0
    assert params and set(params) == set(state), "the run's final parameters must all be compared"
    for name, value in params.items():
        torch.testing.assert_close(value, state[name], rtol=1e-4, atol=1e-4)


def test_a_sharded_runs_final_state_holds_each_ranks_pieces(runs):
    """ZeRO-1's moments live on each rank's pieces: final/optim_rank_<r> holds them and their steps."""
    from safetensors.torch import load_file

    final = os.path.join(runs["dp2"], "run", "final")
    covered: dict[str, int] = {}
    for r in range(2):
        tensors = load_file(os.path.join(final, f"optim_rank_{r}.safetensors"))
        with open(os.path.join(final, f"optim_rank_{r}.json")) as f:
            meta = json.load(f)
        assert tensors and meta["optim_pieces"] and meta["param_steps"], (r, meta)
        assert all(step == 2.0 for step in meta["param_steps"].values())  # two steps trained
        for name, (start, end) in meta["optim_pieces"].items():
            assert tensors[f"optim_shard/{name}/exp_avg"].numel() == end - start
            covered[name] = covered.get(name, 0) + end - start
    params = load_file(os.path.join(final, "rank_0.safetensors"))
    assert covered == {name: t.numel() for name, t in params.items()}  # the replicas' pieces tile every parameter


def test_plan_that_fits_only_sharded_is_chosen_and_runs(runs):
    from partitioner.solver.plan import Plan

    plan = Plan.load(runs["fits_sharded"])
    assert plan.dp == 2 and plan.decisions.shard_optimizer is True
    assert all(s.peak_memory_bytes <= SMALL_DEVICE_BYTES for s in plan.stages)
    with pytest.raises(PartitionInfeasibleError):  # replicated state does not fit these devices
        compile_plan(load_workload(MLP_SPEC), cluster=_small_cluster(), global_batch=8, dp=2, shard_optimizer="off")
    with open(os.path.join(runs["fits_sharded"], "plan.json")) as f:
        assert json.load(f)["program"]["shard_optimizer"] is True  # the program does what the plan says
    report = check_run(runs["fits_sharded"], os.path.join(runs["fits_sharded"], "run"), steps=3)
    assert report.ok, report.text()
