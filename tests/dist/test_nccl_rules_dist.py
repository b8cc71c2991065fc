"""The runtime's collectives under NCCL's device rules (Note [NCCL emulation] in
runtime/parallel/nccl_emulation.py): one torchrun launch of 2 gloo ranks with
PARTITIONER_EMULATE_NCCL=1, whose default group and pipeline/data-parallel groups refuse any
tensor that would be on the host on a GPU, a lone isend, and a host AdamW step in the fused kernel.
It trains, in the same workers: dp 2 with the replica check and compute canaries and checkpoints
(start-up recovery with none yet), its resume (start-up recovery restoring, then the restored
AdamW steps in the fused kernel), ZeRO-1 at dp 2 with --mtbf (the Young/Daly interval agreed after
the first snapshot) and its resume, a 2-stage pipeline (batched point-to-point), and a run with
the memory tier and its resume (start-up recovery through the tiers). Each job
would stop at its first CPU-tensor collective under NCCL, as they did before the control group
(Note [the control group] in runtime/parallel/control.py)."""

from __future__ import annotations

import json
import os
import subprocess

from _runtime_folders import child_env, gpt_folder, mlp_folder
from runtime.launch.torchrun import torchrun_command
from runtime.parallel.nccl_emulation import ENV
from tests.drivers import RUN_MANY


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_runtime_keeps_to_nccls_device_rules(tmp_path):
    root = str(tmp_path)
    dp2, zero, pipe = f"{root}/mlp_dp2", f"{root}/mlp_zero", f"{root}/gpt_pp2"
    two = [([0], 0), ([0], 1)]
    mlp_folder(dp2, splits=[[0, 1, 2, 3]], ranks=two, dp=2, num_microbatches=2, global_batch=8, steps=6)
    mlp_folder(zero, splits=[[0, 1, 2, 3]], ranks=two, dp=2, num_microbatches=2, global_batch=8, steps=6,
               extra={"shard_optimizer": True})
    gpt_folder(pipe, splits=[[0], [1]], ranks=[([0], 0), ([1], 0)], steps=2)
    jobs = [[dp2, "--steps", "4", "--checkpoint-every", "2", "--sdc-every", "2", "--sdc-canary-every", "2",
             "--checkpoint-dir", f"{root}/ck_dp2", "--run-dir", f"{root}/dp2_a"],
            [dp2, "--steps", "6", "--checkpoint-every", "2", "--sdc-every", "2", "--sdc-canary-every", "2",
             "--checkpoint-dir", f"{root}/ck_dp2", "--run-dir", f"{root}/dp2_b"],
            [zero, "--steps", "3", "--mtbf", "1h", "--checkpoint-dir", f"{root}/ck_zero", "--run-dir", f"{root}/zero_a"],
            [zero, "--steps", "5", "--checkpoint-every", "1", "--checkpoint-dir", f"{root}/ck_zero",
             "--run-dir", f"{root}/zero_b"],
            [pipe, "--steps", "2", "--checkpoint-dir", f"{root}/ck_pipe", "--run-dir", f"{root}/pipe"],
            *[[dp2, "--steps", str(n), "--checkpoint-every", "2", "--memory-tier", "copy", "--hosts", "0,1",
               "--sdc-every", "0", "--checkpoint-dir", f"{root}/ck_mem", "--run-dir", f"{root}/mem_{n}"] for n in (2, 3)]]
    args = [a for job in jobs for a in ["--", *job]][1:]
    env = {**child_env(), ENV: "1"}
    done = subprocess.run(torchrun_command(RUN_MANY, 2, args=args), env=env, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "No backend type" not in out and "batch_isend_irecv" not in out
    # every feature ran: canaries and replica checks, the resume, the chosen interval, ZeRO's resume
    assert json.load(open(f"{root}/dp2_a/canary_stats_rank_0.json"))["canaries"] == 2
    assert json.load(open(f"{root}/dp2_b/canary_stats_rank_1.json"))["canaries"] == 1
    assert json.load(open(f"{root}/dp2_a/sdc_stats_rank_0.json"))["checks"] >= 2
    assert "resuming from checkpoint" in out and "at step 4" in out and "at step 3" in out
    assert len(_rows(f"{root}/dp2_b/metrics.jsonl")) == 2 and len(_rows(f"{root}/zero_b/metrics.jsonl")) == 2
    assert json.load(open(f"{root}/zero_a/checkpoint_interval.json"))["every"] >= 1
    assert len(_rows(f"{root}/pipe/metrics.jsonl")) == 2
    assert os.path.exists(f"{root}/pipe/final/rank_1.safetensors")
    assert [r["step"] for r in _rows(f"{root}/mem_3/recovery.jsonl")] == [2, 2]  # recover_any, either tier
