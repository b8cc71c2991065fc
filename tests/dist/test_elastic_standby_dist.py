"""`partitioner run --elastic` when the re-plan uses fewer ranks than survive (Note [standing by] in
runtime/launch/elastic.py): a tiny GPT compiled for 3 devices at dp 3, global batch 6 (microbatch
2), one rank on each of hosts 0, 1, 2; host 1 is lost for good before step 3. The two survivors'
only plan is dp 1 (dp 2 would need 6 % (2 x 2) == 0): rank 0 runs it, the survivor of host 2
stands by and leaves with exit 0, and the job finishes with exit 0, its losses held to the
one-process oracle. Before the stand-by every restart met as 2 ranks on a 1-rank program
(LaunchError) until the restarts ran out, exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from _runtime_folders import child_env
from partitioner import compile as compile_plan
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from runtime.execute.reference import train_reference_from_folder

STEPS = 6


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_survivors_beyond_the_replan_stand_by_and_the_job_finishes(tmp_path):
    folder = str(tmp_path / "p13")
    compile_plan(gpt(layers=2, width=32, heads=2, vocab=64, seq=16), cluster=ClusterSpec.homogeneous(
        3, "cpu", devices_per_node=1), global_batch=6, num_stages=1, dp=3, microbatches=1).save(folder)
    done = subprocess.run([sys.executable, "-m", "partitioner", "run", folder, "--elastic", "--hosts", "0,1,2",
                           "--steps", str(STEPS), "--checkpoint-every", "2", "--memory-tier", "off",
                           "--fail-host", "1:3:permanent", "--host-timeout", "3", "--quiet"],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    with open(folder + ".elastic-h0_2/plan.json") as f:
        plan = json.load(f)
    assert (plan["world_size"], plan["dp"], plan["num_microbatches"]) == (1, 1, 3), plan["world_size"]
    assert "rank(s) 1 (old 2) stand by, the re-plan uses 1 of them" in done.stderr, done.stderr[-4000:]
    assert "elastic: standing by (old rank 2)" in done.stderr
    assert "LaunchError" not in done.stderr
    rows = [r for r in _rows(os.path.join(folder, "run", "recovery.jsonl")) if r.get("kind") == "elastic"]
    assert [(r["rank"], r["tier"], r["plan"]["world_size"], r["lost_hosts"]) for r in rows] == \
        [(0, "disk", 1, [1])], rows
    by_step = {row["step"]: row["loss"] for row in _rows(os.path.join(folder, "run", "metrics.jsonl"))}
    assert sorted(by_step) == list(range(STEPS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute (one thread each)
    try:
        ref, _, _ = train_reference_from_folder(folder, STEPS)
    finally:
        torch.set_num_threads(threads)
    worst = max(abs(by_step[s] - ref[s]) for s in range(STEPS))
    print(f"stand-by elastic run vs one-process oracle: max |loss difference| {worst:.3g} over {STEPS} steps")
    assert worst < 1e-5, (by_step, ref)
