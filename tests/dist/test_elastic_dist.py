"""`partitioner run --elastic` end to end (Notes [elastic run], [memory handover]): a compiled 2 x 2
GPT program with dropout on 4 ranks as two simulated hosts (--hosts 0,0,1,1, one torchrun elastic
agent each, the memory tier's copy mode), host 1 lost for good before step 5
(--fail-host 1:5:permanent kills its ranks and its agent). The survivors' agent meets again without
it after --host-timeout, the 2 survivors re-plan (2 stages x dp 1, 8 microbatches: the same global
batch), take the state from the old layout's memory tier (their own slots and the copies of host
1's ranks they held: no disk shard read) and finish on the new folder. Losses of all steps are
held to the one-process oracle (runtime.execute.reference), the same samples and keyed dropout
masks; steps 0..4 ran at dp 2, the rest at dp 1, whose sums of microbatch gradients differ only in
order (the measured difference is printed; 0.0 on every step from memory here, with the oracle
single-threaded as the ranks are). A second run of the same program without a memory tier
recovers from the disk's step 3, resharded into the new plan, and is held to the same oracle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import torch

from _runtime_folders import child_env
from partitioner import compile as compile_plan
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from runtime.execute.reference import train_reference_from_folder

STEPS, EVERY = 8, 3  # disk at step 3 and 6; host 1 goes before step 5: memory holds step 4 or 5, newer


def _elastic(root: str, *extra: str) -> dict:
    folder = os.path.join(root, "p22")
    model = gpt(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=0.1)
    plan = compile_plan(model, cluster=ClusterSpec.homogeneous(4, "cpu", devices_per_node=2), global_batch=8,
                        num_stages=2, dp=2, microbatches=4, training={"memory_tier": "auto"})
    plan.save(folder)
    shm = f"/dev/shm/partitioner-test-{uuid.uuid4().hex[:8]}" if os.path.isdir("/dev/shm") else f"{root}/shm"
    cmd = [sys.executable, "-m", "partitioner", "run", folder, "--elastic", "--hosts", "0,0,1,1", "--steps",
           str(STEPS), "--checkpoint-every", str(EVERY), "--fail-host", "1:5:permanent",
           "--host-timeout", "3", "--quiet", *extra]
    if "off" not in extra:  # --memory-dir with the tier off is refused (run_options.check_for)
        cmd += ["--memory-dir", shm]
    try:
        result = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=420)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    return {"folder": folder, "out": result.stdout + result.stderr}


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory):
    return _elastic(str(tmp_path_factory.mktemp("elastic")))


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_finishes_on_the_survivors_with_a_replanned_plan_from_memory(elastic_run):
    folder = elastic_run["folder"]
    new = folder + ".elastic-h0"
    with open(os.path.join(new, "plan.json")) as f:
        plan = json.load(f)
    assert (plan["world_size"], plan["dp"], plan["num_stages"], plan["num_microbatches"]) == (2, 1, 2, 8)
    rows = [r for r in _rows(os.path.join(folder, "run", "recovery.jsonl")) if r.get("kind") == "elastic"]
    assert sorted(r["rank"] for r in rows) == [0, 1], rows
    for r in rows:
        assert r["tier"] == "memory" and r["disk_shards_read"] == 0, r
        assert r["lost_hosts"] == [1] and r["plan"]["world_size"] == 2, r
        assert r["tiers"] == {"0": "memory", "1": "memory", "2": "peer", "3": "peer"}, r
        assert r["step"] > 3  # newer than the disk's newest checkpoint (step 3)
        assert r["since_loss_s"] is not None and r["since_loss_s"] > 0
    assert "elastic: recovered step" in elastic_run["out"]
    closing = [ln for ln in elastic_run["out"].splitlines() if ln.startswith("[run] elastic: host(s) 1 lost for good")]
    assert closing and "from memory, recovered" in closing[-1] and "s after the loss" in closing[-1], closing


def test_losses_match_the_one_process_oracle(elastic_run):
    _held_to_the_oracle(elastic_run["folder"])


def test_without_a_memory_tier_the_disk_serves_resharded(tmp_path_factory):
    run = _elastic(str(tmp_path_factory.mktemp("elastic_disk")), "--memory-tier", "off")
    rows = [r for r in _rows(os.path.join(run["folder"], "run", "recovery.jsonl")) if r.get("kind") == "elastic"]
    assert sorted(r["rank"] for r in rows) == [0, 1], rows
    assert all(r["tier"] == "disk" and r["step"] == 3 and r["disk_shards_read"] > 0 for r in rows), rows
    assert "resharded from plan" in run["out"]
    _held_to_the_oracle(run["folder"])


def _held_to_the_oracle(folder):
    by_step = {}
    for row in _rows(os.path.join(folder, "run", "metrics.jsonl")):
        by_step[row["step"]] = row["loss"]  # a step re-trained after the loss: its last value
    assert sorted(by_step) == list(range(STEPS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute (one thread each): the same reduction order in each op
    try:
        ref, _, _ = train_reference_from_folder(folder, STEPS)
    finally:
        torch.set_num_threads(threads)
    worst = max(abs(by_step[s] - ref[s]) for s in range(STEPS))
    print(f"elastic run vs one-process oracle: max |loss difference| {worst:.3g} over {STEPS} steps")
    assert worst < 1e-5, (by_step, ref)
