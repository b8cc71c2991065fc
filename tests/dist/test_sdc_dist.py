"""Silent data corruption in a real torchrun job (gloo, 3 ranks, 1 stage x dp 3): one bit flipped
in replica 1's parameter (--flip-bit) is found within K steps, blamed on replica 1 by majority,
and the job rolls back to the newest checkpoint whose digests agreed and trains on, ending bit for
bit where the same run without the flip ends (losses, parameters, optimizer state); also with
lossless delta checkpoints, where the rollback restores from a delta chain. K is the program
object's sdc_every (what `partitioner compile --sdc-every` writes): the flipped run passes no
--sdc-every, the others pass the same K as a flag."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _runtime_folders import mlp_folder, one_thread  # noqa: F401
from _shared_launch import Job, prepare

STEPS, EVERY, K, FLIP = 8, 2, 3, "1:4"  # checks after steps 2, 3, 4, 6, 8: the flip before step 4 is seen at 6


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@prepare
def _sdc_jobs(root: Path):
    """Three jobs in the session's 3-worker shared launch (tests/_shared_launch.py)."""
    folder = str(root / "mlp_dp3")
    mlp_folder(folder, splits=[[0, 1, 2, 3]], ranks=[([0], 0), ([0], 1), ([0], 2)], dp=3,
               global_batch=24, num_microbatches=2, steps=STEPS, extra={"sdc_every": K})
    plan_k = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY)]  # K from the program object
    common = [*plan_k, "--sdc-every", str(K)]
    jobs = [Job(3, [folder, *common, "--run-dir", f"{root}/clean", "--checkpoint-dir", f"{root}/ck_clean"]),
            Job(3, [folder, *plan_k, "--run-dir", f"{root}/flip", "--checkpoint-dir", f"{root}/ck_flip",
                    "--flip-bit", FLIP]),
            Job(3, [folder, *common, "--run-dir", f"{root}/lossless", "--checkpoint-dir", f"{root}/ck_lossless",
                    "--flip-bit", FLIP, "--checkpoint-compression", "lossless", "--checkpoint-full-every", "3",
                    "--keep-checkpoints", "1"])]
    return str(root), jobs


@pytest.fixture(scope="module")
def runs(shared_launches):
    root, outputs = shared_launches.result(_sdc_jobs)
    return root, sum(outputs[1:], outputs[0])


def test_a_flipped_bit_is_found_within_k_steps_and_blamed_on_its_replica(runs):
    root, result = runs
    assert not os.path.exists(f"{root}/clean/sdc.jsonl")  # the clean run's replicas always agree
    for r in range(3):  # the flipped run checked at the program's K, given no flag
        assert json.load(open(f"{root}/flip/sdc_stats_rank_{r}.json"))["every"] == K
    finding, rollback = _rows(f"{root}/flip/sdc.jsonl")
    flip_rank, flip_step = (int(x) for x in FLIP.split(":"))
    assert flip_step < finding["step"] <= flip_step + K  # detected within K steps of the flip
    assert finding["odd_ranks"] == [flip_rank] and finding["odd_replicas"] == [1]
    assert finding["stages"] == [0] and finding["ranks"] == [0, 1, 2] and "parameters" in finding["what"]
    assert finding["last_agreed_step"] == 4
    assert rollback == {**rollback, "rolled_back_to": 4, "detected_at": finding["step"]}
    assert "odd one out by majority: rank 1 (replica 1)" in result.stderr
    assert "rolled back to the checkpoint of step 4" in result.stderr


@pytest.mark.parametrize("run", ["flip", "lossless"])
def test_the_recovered_run_ends_bit_identical_to_the_clean_run(runs, run):
    root, _ = runs
    clean, flip = _rows(f"{root}/clean/metrics.jsonl"), _rows(f"{root}/{run}/metrics.jsonl")
    assert [r["step"] for r in flip] == list(range(STEPS))
    assert [r["loss"] for r in flip] == [r["loss"] for r in clean]
    for r in range(3):
        for name in ("rank", "optim_rank"):
            got = load_file(f"{root}/{run}/final/{name}_{r}.safetensors")
            want = load_file(f"{root}/clean/final/{name}_{r}.safetensors")
            assert sorted(got) == sorted(want)
            for key in want:
                assert torch.equal(got[key], want[key]), (r, name, key)


def test_lossless_checkpoints_are_delta_chains_that_the_rollback_restored_from(runs):
    from runtime.resilience import checkpoint as ck

    root, _ = runs
    assert _rows(f"{root}/lossless/sdc.jsonl")[1]["rolled_back_to"] == 4
    ckpt = f"{root}/ck_lossless"
    # keep 1, but the newest (8, a delta on 6) keeps its chain; every 3rd is full
    chain = {s: ck.read_manifest(ckpt, s).get("base_step") for s in ck.list_step_dirs(ckpt)}
    assert chain == {8: 6, 6: None}, chain
    stats = [row for r in range(3) for row in _rows(f"{root}/lossless/checkpoint_stats_rank_{r}.jsonl")]
    assert any(row["base_step"] is not None for row in stats)
