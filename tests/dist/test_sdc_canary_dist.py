"""Compute-fault canaries in real gloo jobs (Note [compute canaries] in runtime/resilience/canary.py):
a 2-stage pipeline x dp 2 (TinyGPT, dropout on, tied embedding) and 1 stage x dp 3 (an MLP, fp32 and
bf16-mixed). Clean runs with canaries find nothing and train exactly as without them (the MLP with
the replica check on as well); a faulty matmul on one rank (--fault-matmul, transient: gone after
the rollback) is caught within K steps, named (by majority with 3 replicas, the pair with 2), rolled back to the newest checkpoint before it, and the run ends
with the clean run's losses and parameters bit for bit. A permanent fault is caught again after
the rollback: RUN_DIR/exclude.json names the rank and `partitioner run` exits 4 (its own launch:
the shared launch would stop at its exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _runtime_folders import child_env, gpt_folder, mlp_folder
from _shared_launch import Job, prepare

from runtime.features.canaries import EVERY as CANARY

STEPS, EVERY, K = 8, 2, 3      # canaries at steps 2 and 5 (0-based; (s + 1) % K == 0), checkpoints every 2
GPT_FAULT, MLP_FAULT = "3:3", "1:4"  # rank 3 (stage 1, replica 1) from step 3: caught at 5, back to 2 (3)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@prepare
def _canary_jobs(root: Path):
    gpt, mlp = str(root / "gpt_2x2"), str(root / "mlp_dp3")
    gpt_folder(gpt, splits=[[0], [1]], ranks=[([0], 0), ([1], 0), ([0], 1), ([1], 1)], dp=2, dropout=0.1,
               num_microbatches=2, global_batch=8, steps=STEPS)
    mlp_folder(mlp, splits=[[0, 1, 2, 3]], ranks=[([0], 0), ([0], 1), ([0], 2)], dp=3, global_batch=24,
               num_microbatches=2, steps=STEPS)
    bf16 = str(root / "mlp_dp3_bf16")
    mlp_folder(bf16, splits=[[0, 1, 2, 3]], ranks=[([0], 0), ([0], 1), ([0], 2)], dp=3, global_batch=24,
               num_microbatches=2, steps=STEPS, extra={"precision": "bf16-mixed"})
    common = ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--sdc-every", "0"]

    def job(world, folder, name, *more):
        return Job(world, [folder, *common, "--run-dir", f"{root}/{name}", "--checkpoint-dir", f"{root}/ck_{name}",
                           *more])

    canary = ["--sdc-canary-every", str(K)]
    jobs = [job(4, gpt, "gpt_plain"), job(4, gpt, "gpt_clean", *canary),
            job(4, gpt, "gpt_fault", *canary, "--fault-matmul", GPT_FAULT),
            # with the replica check on too (its last agreeing check is not what a canary rolls back to)
            job(3, mlp, "mlp_clean", *canary, "--sdc-every", "3"),
            job(3, mlp, "mlp_fault", *canary, "--sdc-every", "3", "--fault-matmul", MLP_FAULT),
            # bf16-mixed, the GPU default: a 1e-3 product fault rounded away there (Note [a faulty matmul])
            job(3, bf16, "bf16_fault", *canary, "--fault-matmul", MLP_FAULT)]
    return str(root), jobs


@pytest.fixture(scope="module")
def runs(shared_launches):
    root, outputs = shared_launches.result(_canary_jobs)
    return root, sum(outputs[1:], outputs[0])


def _same_final(root, a, b, world):
    for r in range(world):
        for name in ("rank", "optim_rank"):
            got, want = load_file(f"{root}/{a}/final/{name}_{r}.safetensors"), load_file(
                f"{root}/{b}/final/{name}_{r}.safetensors")
            assert sorted(got) == sorted(want)
            for key in want:
                assert torch.equal(got[key], want[key]), (a, r, name, key)


def test_clean_canaries_find_nothing_and_change_nothing(runs):
    root, _ = runs
    for run, world in (("gpt_clean", 4), ("mlp_clean", 3)):
        assert not os.path.exists(f"{root}/{run}/canary.jsonl")
        for r in range(world):
            stats = json.load(open(f"{root}/{run}/canary_stats_rank_{r}.json"))
            assert stats["every"] == K and stats["canaries"] == STEPS // K
    plain, clean = _rows(f"{root}/gpt_plain/metrics.jsonl"), _rows(f"{root}/gpt_clean/metrics.jsonl")
    assert [r["loss"] for r in clean] == [r["loss"] for r in plain]  # the re-run leaves no trace
    _same_final(root, "gpt_clean", "gpt_plain", 4)


@pytest.mark.parametrize("model,world,fault,blamed", [("gpt", 4, GPT_FAULT, [1, 3]), ("mlp", 3, MLP_FAULT, [1])])
def test_a_faulty_matmul_is_caught_within_k_steps_rolled_back_and_ends_as_the_clean_run(runs, model, world,
                                                                                        fault, blamed):
    root, result = runs
    rank, step = (int(x) for x in fault.split(":"))
    finding, rollback = _rows(f"{root}/{model}_fault/canary.jsonl"), _rows(f"{root}/{model}_fault/sdc.jsonl")
    assert len(finding) == 1 and step <= finding[0]["step"] < step + K
    assert finding[0]["blamed_ranks"] == blamed and not finding[0]["repeat"]
    assert rank in {p["owner"] for p in finding[0]["pairs"]}
    back = rollback[0]["rolled_back_to"]
    assert back <= step and back % EVERY == 0
    assert "compute canary at step" in result.stderr and f"rolled back to the checkpoint of step {back}" in result.stderr
    clean, faulty = _rows(f"{root}/{model}_clean/metrics.jsonl"), _rows(f"{root}/{model}_fault/metrics.jsonl")
    assert [r["step"] for r in faulty] == list(range(STEPS))
    assert [r["loss"] for r in faulty] == [r["loss"] for r in clean]
    _same_final(root, f"{model}_fault", f"{model}_clean", world)


def test_a_faulty_matmul_is_caught_under_bf16_mixed(runs):
    """The drill faults in the GPU's default precision too: caught within K steps, rank 1 blamed by
    majority, rolled back (before the fix the bf16 products rounded back and no canary fired)."""
    root, _ = runs
    rank, step = (int(x) for x in MLP_FAULT.split(":"))
    finding = _rows(f"{root}/bf16_fault/canary.jsonl") if os.path.exists(f"{root}/bf16_fault/canary.jsonl") else []
    assert len(finding) == 1 and step <= finding[0]["step"] < step + K, finding
    assert finding[0]["blamed_ranks"] == [rank]
    assert _rows(f"{root}/bf16_fault/sdc.jsonl")[0]["rolled_back_to"] <= step
    assert [r["step"] for r in _rows(f"{root}/bf16_fault/metrics.jsonl")] == list(range(STEPS))


def test_a_permanent_fault_is_caught_again_and_the_rank_excluded(tmp_path):
    """A compiled program whose plan asks for canaries (no flag), run by `partitioner run`: exit 4."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import mlp

    folder = tmp_path / "mlp_dp3"
    partitioner.compile(mlp(), cluster=ClusterSpec.homogeneous(3, "cpu"), global_batch=12, num_stages=1, dp=3,
                        microbatches=2, training={"sdc_every": 0, CANARY.key: K}).save(folder)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "partitioner", "run", str(folder), "--steps", str(STEPS),
                           "--checkpoint-every", str(EVERY), "--run-dir", str(run_dir), "--fault-matmul",
                           "2:3:permanent", "--quiet"], env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 4, done.stderr[-3000:]
    exclude = json.load(open(run_dir / "exclude.json"))
    assert exclude["exclude_ranks"] == [2] and exclude["certain"] is True and exclude["hosts_of_ranks"] == [0]
    rows = _rows(run_dir / "canary.jsonl")
    assert [r["repeat"] for r in rows] == [False, True] and all(r["blamed_ranks"] == [2] for r in rows)
    assert "stopped for a re-plan" in done.stderr
