"""The memory tier in one real torchrun job (gloo, 4 ranks) of a compiled 2 x 2 GPT program with
dropout, whose plan chose the memory tier (2 nodes: a full copy on the peer node). The job trains
three runs of the same program, one after another in the same workers (tests/drivers/run_many.py),
and torchrun restarts it after each failure (--max-restarts 4); a finished run re-entered after a
restart resumes at its last step and trains nothing:

    ref   uninterrupted, no memory tier: the oracle
    A     hosts 0,0,1,1, the plan's copy mode: rank 1 SIGKILLed before step 3 (attempt 0: a worker
          crash -> own memory); host 1 lost before step 5 (attempt 1: ranks 2, 3 killed, host 1's
          shared memory wiped -> the peer copies)
    B     hosts 0,1,2,3, parity over the 4 hosts: host 2 lost before step 3 (attempt 2 -> rebuilt from
          parity); hosts 0 and 1 lost before step 5 (attempt 3: two in one parity group -> disk)

Every recovery is asserted by the tier each rank used (RUN_DIR/recovery.jsonl), memory recoveries
read no disk shard, and A and B end bit-exact with ref (losses, parameters, optimizer state).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest
import torch
from safetensors.torch import load_file

from _runtime_folders import child_env
from partitioner import compile as compile_plan
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from tests.drivers import RUN_MANY
from runtime.launch.torchrun import torchrun_command

STEPS, EVERY, WORLD = 6, 2, 4


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("memtier"))
    folder = os.path.join(root, "p22")
    model = gpt(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=0.1)
    plan = compile_plan(model, cluster=ClusterSpec.homogeneous(WORLD, "cpu", devices_per_node=2), global_batch=8,
                        num_stages=2, dp=2, microbatches=4, training={"memory_tier": "auto"})
    plan.save(folder)
    shm = f"/dev/shm/partitioner-test-{uuid.uuid4().hex[:8]}" if os.path.isdir("/dev/shm") else f"{root}/shm"
    common = [folder, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--quiet"]
    args = [RUN_MANY,
            *common, "--memory-tier", "off", "--run-dir", f"{root}/ref", "--checkpoint-dir", f"{root}/ck_ref", "--",
            *common, "--hosts", "0,0,1,1", "--run-dir", f"{root}/A", "--checkpoint-dir", f"{root}/ck_A",
            "--memory-dir", f"{shm}-A", "--fail-at", "1:3:kill", "--fail-host", "1:5:1", "--",
            *common, "--hosts", "0,1,2,3", "--memory-tier", "parity", "--parity-group", "4",
            "--run-dir", f"{root}/B", "--checkpoint-dir", f"{root}/ck_B", "--memory-dir", f"{shm}-B",
            "--fail-host", "2:3:2", "--fail-host", "0:5:3", "--fail-host", "1:5:3"]
    cmd = torchrun_command(args[0], WORLD, args=args[1:], max_restarts=4)
    try:
        result = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=400)
        # --memory-dir is the user's: kept, with nothing of the tier left in it (its own folder went)
        leftover = [p for p in (shm + "-A", shm + "-B") if not os.path.isdir(p) or os.listdir(p)]
    finally:
        for suffix in ("-A", "-B"):
            shutil.rmtree(shm + suffix, ignore_errors=True)
    assert result.returncode == 0, f"failed:\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    return {"root": root, "plan": plan, "out": result.stdout + result.stderr, "leftover": leftover}


def _recoveries(run_dir, attempt):
    with open(os.path.join(run_dir, "recovery.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = sorted((r for r in rows if r["attempt"] == attempt), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(WORLD)), rows
    assert len({r["step"] for r in rows}) == 1, rows  # every rank resumed from the same step
    return rows


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(STEPS))
    return [r["loss"] for r in rows]


def _assert_bit_exact(run_dir, ref_dir):
    assert _losses(run_dir) == _losses(ref_dir)  # exact fp32 values, every step
    for r in range(WORLD):
        for name in (f"rank_{r}.safetensors", f"optim_rank_{r}.safetensors"):
            got, want = (load_file(os.path.join(d, "final", name)) for d in (run_dir, ref_dir))
            assert sorted(got) == sorted(want)
            for key in want:
                assert torch.equal(got[key], want[key]), (r, name, key)
        with open(os.path.join(run_dir, "final", f"optim_rank_{r}.json")) as a, \
                open(os.path.join(ref_dir, "final", f"optim_rank_{r}.json")) as b:
            got, want = json.load(a), json.load(b)
        assert got["param_steps"] == want["param_steps"] and got["lr_scheduler"] == want["lr_scheduler"]


def test_plan_chooses_a_peer_copy_across_its_two_nodes(job):
    choice = job["plan"].decisions.memory_tier
    assert choice["mode"] == "copy" and choice["hosts"] == [0, 0, 1, 1]
    assert all(len(g) == 2 and choice["hosts"][g[0]] != choice["hosts"][g[1]] for g in choice["groups"])
    assert "memory tier" in job["plan"].summary() and "full copy on a peer host" in job["plan"].summary()
    assert not job["leftover"]  # a run that finishes removes its memory tier


def test_worker_crash_resumes_from_its_own_host_memory_bit_exact(job):
    rows = _recoveries(f"{job['root']}/A", 1)
    assert [r["tier"] for r in rows] == ["memory"] * WORLD
    assert rows[0]["step"] in (2, 3) and all(r["disk_shards_read"] == 0 for r in rows)
    assert f"recovered step {rows[0]['step']} from tier=memory in" in job["out"]
    _assert_bit_exact(f"{job['root']}/A", f"{job['root']}/ref")


def test_host_loss_recovers_from_the_peer_copy_without_reading_disk(job):
    rows = _recoveries(f"{job['root']}/A", 2)
    assert {r["rank"]: r["tier"] for r in rows} == {0: "memory", 1: "memory", 2: "peer", 3: "peer"}
    assert rows[0]["step"] in (4, 5) and all(r["disk_shards_read"] == 0 for r in rows)
    # (bit-exact at the end of A: test_worker_crash_... compares the whole run, both recoveries in it)


def test_host_loss_recovers_from_parity_bit_exact(job):
    rows = _recoveries(f"{job['root']}/B", 3)
    assert {r["rank"]: r["tier"] for r in rows} == {0: "memory", 1: "memory", 2: "parity", 3: "memory"}
    assert rows[0]["step"] in (2, 3) and all(r["disk_shards_read"] == 0 for r in rows)
    _assert_bit_exact(f"{job['root']}/B", f"{job['root']}/ref")


def test_two_hosts_lost_in_one_parity_group_fall_back_to_disk(job):
    rows = _recoveries(f"{job['root']}/B", 4)
    assert [r["tier"] for r in rows] == ["disk"] * WORLD and rows[0]["step"] == 4
    assert all(r["disk_shards_read"] > 0 for r in rows)
    # Two reasons are right, depending on timing: the parity group is short of two members, or (on a
    # loaded machine, where the disk checkpoint commits before the kill) the disk is already as new
    # as memory's newest step and recovery never looks at memory (runtime/resilience/recovery.py).
    assert "recovering from disk" in job["out"]
    assert ("parity group [0, 1, 2, 3] lost 2 members" in job["out"]
            or "the disk holds step 4, as new as memory's newest (4)" in job["out"]), job["out"][-3000:]
    # and never a wrong answer: B ends bit-exact with the uninterrupted run (test above)
