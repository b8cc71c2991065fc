"""A canary's exclusion re-plans the job without the bad host (Note [excluding a host] in
runtime/resilience/exclusion.py): a compiled 1-stage GPT (dropout on) at dp 4 on 4 ranks as two
simulated hosts (--elastic --hosts 0,0,1,1: host 1 holds replicas 2 and 3), canaries every 2 steps
(at steps 1, 3, 5, 7), a checkpoint every step, the memory tier on, and a permanent faulty matmul on
rank 3 from step 3. The canary of step 3 blames rank 3 alone (two failing pairs of 4 replicas),
the job rolls back to step 2, rank 3 is caught again at step 3, and host 1 is excluded: its agent
is not started again, host 0's 2 ranks re-plan (1 stage x dp 2, 4 microbatches: the same global
batch) and resume from the disk at step 2 (the last agreeing canary), never from a checkpoint or a
memory slot written after it. The losses of all 8 steps are held to the one-process oracle within
the tolerance tests/dist/test_elastic_dist.py holds a change of dp to (the parameters differ from
the oracle's by AdamW's amplification of the sum's order, printed), and the losses and final
parameters and optimizer state are bit for bit those of the clean run re-planned at step 2 (the
same program without the fault: 2 steps on 4 ranks, then the re-planned folder resumed from that
checkpoint). Two more layouts decide the 2-replica case: 2 stages x dp 2 on hosts 0,0,1,1 (the
failing pair, stage 1's replicas, both on host 1: host 1 goes, the survivors finish as 2 stages x
dp 1, held to the oracle) and 1 stage x dp 2 on hosts 0,1 (the pair on two hosts: exit 4, no host
dropped on a guess).
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
from safetensors.torch import load_file

from _runtime_folders import child_env
from partitioner import compile as compile_plan
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from runtime.execute.reference import train_reference_from_folder
from runtime.features.canaries import EVERY as CANARY

STEPS, K, FAULT = 8, 2, "3:3:permanent"   # canaries at steps 1, 3, 5, 7; good state: step 2


@pytest.fixture(scope="module")
def excluded_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("exclude"))
    folder = os.path.join(root, "dp4")
    model = gpt(layers=2, width=32, heads=2, vocab=64, seq=16, dropout=0.1)
    compile_plan(model, cluster=ClusterSpec.homogeneous(4, "cpu", devices_per_node=2), global_batch=8,
                 num_stages=1, dp=4, microbatches=2,
                 training={"memory_tier": "auto", "sdc_every": 0, CANARY.key: K}).save(folder)
    shm = f"/dev/shm/partitioner-test-{uuid.uuid4().hex[:8]}" if os.path.isdir("/dev/shm") else f"{root}/shm"
    cmd = [sys.executable, "-m", "partitioner", "run", folder, "--elastic", "--hosts", "0,0,1,1", "--steps",
           str(STEPS), "--checkpoint-every", "1", "--fault-matmul", FAULT, "--memory-dir", shm,
           "--host-timeout", "3", "--quiet"]
    try:
        result = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=420)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {"folder": folder, "code": result.returncode, "out": result.stdout + result.stderr}


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_excluded_host_is_left_out_and_the_job_finishes_on_the_survivors(excluded_run):
    out, folder = excluded_run["out"], excluded_run["folder"]
    assert excluded_run["code"] == 0, out[-8000:]
    run = os.path.join(folder, "run")
    canary = _rows(os.path.join(run, "canary.jsonl"))
    assert [(r["step"], r["blamed_ranks"], r["repeat"]) for r in canary] == [(3, [3], False), (3, [3], True)]
    handled = json.load(open(os.path.join(run, "exclude.handled.json")))
    assert handled["exclude_ranks"] == [3] and handled["certain"] and handled["hosts_of_ranks"] == [1]
    assert handled["good_step"] == 2 and handled["set_aside"]
    assert not os.path.exists(os.path.join(run, "exclude.json"))
    said = [ln for ln in out.splitlines() if ln.startswith("[run] elastic: host(s) 1 excluded:")]
    assert len(said) == 1 and "rank(s) 3" in said[0] and "step 2" in said[0], out[-4000:]
    rows = _rows(os.path.join(run, "recovery.jsonl"))
    excl = [r for r in rows if r.get("kind") == "exclusion"]
    assert len(excl) == 1 and excl[0]["excluded_hosts"] == [1] and excl[0]["survivors"] == [0, 1], excl
    with open(folder + ".elastic-h0/plan.json") as f:
        plan = json.load(f)
    assert (plan["world_size"], plan["dp"], plan["num_stages"], plan["num_microbatches"]) == (2, 2, 1, 4)
    elastic = [r for r in rows if r.get("kind") == "elastic"]
    assert sorted(r["rank"] for r in elastic) == [0, 1], elastic
    for r in elastic:  # the disk at the last agreeing canary, nothing later; no memory slot read
        assert (r["tier"], r["step"], r["good_step"], r["memory_shards_read"]) == ("disk", 2, 2, 0), r
        assert r["lost_hosts"] == [1] and r["disk_shards_read"] > 0, r
    assert "excluded by a compute canary" in out and "the last agreeing canary, was used" in out
    assert "Traceback" not in out, out[-4000:]
    # what was written after the fault began was set aside, not resumed (checkpoint 3: after step 2 re-ran)
    assert os.path.isdir(os.path.join(folder, "checkpoints", "discarded_step_000000003")) or "moved" in out


def _run(folder, *args):
    cmd = [sys.executable, "-m", "partitioner", "run", folder, "--checkpoint-every", "1", "--memory-tier", "off",
           "--quiet", *args]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def clean_replanned(excluded_run, tmp_path_factory):
    """The same program without the fault: 2 steps on the 4 ranks, then the re-planned folder resumed
    from that checkpoint of step 2 (resharded) to the end, as the exclusion should have done."""
    assert excluded_run["code"] == 0, excluded_run["out"][-4000:]
    root, folder = str(tmp_path_factory.mktemp("clean")), excluded_run["folder"]
    _run(folder, "--steps", "2", "--run-dir", f"{root}/run4", "--checkpoint-dir", f"{root}/ck")
    _run(folder + ".elastic-h0", "--steps", str(STEPS), "--run-dir", f"{root}/run2", "--checkpoint-dir", f"{root}/ck")
    return f"{root}/run2"


def test_the_survivors_end_as_the_clean_run_replanned_at_the_good_step(excluded_run, clean_replanned):
    run = os.path.join(excluded_run["folder"], "run")
    last = {r["step"]: r["loss"] for r in _rows(os.path.join(run, "metrics.jsonl"))}
    clean = {r["step"]: r["loss"] for r in _rows(os.path.join(clean_replanned, "metrics.jsonl"))}
    assert sorted(clean) == list(range(2, STEPS)) and all(last[s] == clean[s] for s in clean), (last, clean)
    for r in (0, 1):
        for name in ("rank", "optim_rank"):
            got = load_file(os.path.join(run, "final", f"{name}_{r}.safetensors"))
            want = load_file(os.path.join(clean_replanned, "final", f"{name}_{r}.safetensors"))
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[k], want[k]) for k in want), (r, name)


def _worst_against_the_oracle(folder, steps, final_out=None):
    by_step = {}
    for row in _rows(os.path.join(folder, "run", "metrics.jsonl")):
        by_step[row["step"]] = row["loss"]  # a step re-trained after the rollback or the re-plan: its last value
    assert sorted(by_step) == list(range(steps))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute (one thread each)
    try:
        ref, final, _ = train_reference_from_folder(folder, steps)
    finally:
        torch.set_num_threads(threads)
    if final_out is not None:
        final_out.update(final)
    return max(abs(by_step[s] - ref[s]) for s in range(steps))


def test_losses_match_the_one_process_oracle(excluded_run):
    assert excluded_run["code"] == 0, excluded_run["out"][-4000:]
    folder, final = excluded_run["folder"], {}
    worst = _worst_against_the_oracle(folder, STEPS, final)
    got = load_file(os.path.join(folder, "run", "final", "rank_0.safetensors"))
    common = sorted(set(got) & set(final))
    assert common and len(common) == len(got), (sorted(got)[:5], sorted(final)[:5])
    worst_param = max(float((got[n] - final[n].detach().cpu()).abs().max()) for n in common)
    print(f"excluded run vs one-process oracle: max |loss difference| {worst:.3g} over {STEPS} steps, "
          f"max |parameter difference| {worst_param:.3g}")
    assert worst < 1e-5  # the parameters: bit for bit the clean re-planned run's (above)


def _elastic_run(folder, hosts, *extra):
    return subprocess.run([sys.executable, "-m", "partitioner", "run", folder, "--elastic", "--hosts", hosts,
                           "--checkpoint-every", "1", "--memory-tier", "off", "--host-timeout", "3", "--quiet",
                           *extra], env=child_env(), capture_output=True, text=True, timeout=300)


def test_a_pair_on_one_host_excludes_that_host_2x2(tmp_path):
    """2 stages x dp 2 on hosts 0,0,1,1: the compiler puts stage 1's two replicas (ranks 2, 3) on host
    1; the failing pair names both, either may be faulty, both are on host 1: host 1 goes, and
    host 0's ranks re-plan as 2 stages x dp 1 (no second replica: canaries off, said) and finish."""
    folder = str(tmp_path / "p22")
    compile_plan(gpt(layers=2, width=32, heads=2, vocab=64, seq=16), cluster=ClusterSpec.homogeneous(
        4, "cpu", devices_per_node=2), global_batch=8, num_stages=2, dp=2, microbatches=2,
        training={"sdc_every": 0, CANARY.key: K}).save(folder)
    done = _elastic_run(folder, "0,0,1,1", "--steps", "6", "--fault-matmul", FAULT)
    assert done.returncode == 0, done.stderr[-6000:]
    run = os.path.join(folder, "run")
    handled = json.load(open(os.path.join(run, "exclude.handled.json")))
    assert handled["exclude_ranks"] == [2, 3] and not handled["certain"] and handled["hosts_of_ranks"] == [1]
    assert "host(s) 1 excluded: the compute canary caught rank(s) 2, 3 (one of them: both on this host)" in done.stderr
    assert "no compute canaries from here on" in done.stderr
    elastic = [r for r in _rows(os.path.join(run, "recovery.jsonl")) if r.get("kind") == "elastic"]
    assert sorted(r["rank"] for r in elastic) == [0, 1] and all(r["step"] == 2 for r in elastic), elastic
    assert all(r["plan"]["num_stages"] == 2 and r["plan"]["dp"] == 1 for r in elastic), elastic
    assert _worst_against_the_oracle(folder, 6) < 1e-5


def test_a_pair_on_two_hosts_stops_with_exit_4_and_drops_no_host(tmp_path):
    """1 stage x dp 2 on hosts 0,1: the failing pair spans both hosts and either may be the faulty
    one; the job stops with exit 4 and says so, and no re-plan runs."""
    folder = str(tmp_path / "dp2")
    compile_plan(gpt(layers=2, width=32, heads=2, vocab=64, seq=16), cluster=ClusterSpec.homogeneous(
        2, "cpu", devices_per_node=1), global_batch=8, num_stages=1, dp=2, microbatches=2,
        training={"sdc_every": 0, CANARY.key: K}).save(folder)
    done = _elastic_run(folder, "0,1", "--steps", "6", "--fault-matmul", "1:3:permanent")
    assert done.returncode == 4, done.stderr[-4000:]
    assert "either may be the faulty one: no host is excluded on a guess" in done.stderr, done.stderr[-4000:]
    run = os.path.join(folder, "run")
    exclude = json.load(open(os.path.join(run, "exclude.json")))
    assert exclude["exclude_ranks"] == [0, 1] and not exclude["certain"] and exclude["good_step"] == 2
    assert exclude["hosts_of_ranks"] == [0, 1] and exclude["set_aside"]
    rows = _rows(os.path.join(run, "recovery.jsonl")) if os.path.exists(os.path.join(run, "recovery.jsonl")) else []
    assert not [r for r in rows if r.get("kind") in ("exclusion", "elastic")], rows
    assert not os.path.exists(os.path.join(folder, "checkpoints", "step_000000003"))  # set aside all the same
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
