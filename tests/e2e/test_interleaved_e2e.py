"""A compiled interleaved 1F1B program (Note [interleaved pricing] in
partitioner/solver/interleaved.py) under torchrun (gloo): 4 stages on 2 ranks, a GPT with dropout
on. It trains like the one-process oracle, and a run stopped after a checkpoint and resumed is
bit for bit the uninterrupted run. Every job in the session's 2-worker shared launch
(tests/_shared_launch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _shared_launch import Job, prepare
from partitioner import compile as compile_plan
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from partitioner.cli.verify import check_run

STEPS, EVERY = 4, 2


def _losses(run_dir, start=0):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(start, start + len(rows)))
    return [r["loss"] for r in rows]


@prepare
def _interleaved_program(root: Path):
    workload = gpt(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=0.1)
    plan = compile_plan(workload, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=4,
                        dp=1, microbatches=4, schedule="interleaved")
    folder = root / "program"
    plan.save(folder)
    flags = ["--checkpoint-every", str(EVERY)]
    jobs = [Job(2, [folder, "--steps", str(STEPS), *flags, "--run-dir", root / "full",
                    "--checkpoint-dir", root / "ck_full"]),
            Job(2, [folder, "--steps", str(EVERY), *flags, "--run-dir", root / "part", "--checkpoint-dir", root / "ck"]),
            Job(2, [folder, "--steps", str(STEPS), *flags, "--run-dir", root / "resumed",
                    "--checkpoint-dir", root / "ck"])]
    return (root, folder, plan, workload), jobs


@pytest.fixture(scope="module")
def interleaved(shared_launches):
    """Trained in the session's 2-worker shared launch (tests/_shared_launch.py)."""
    (root, folder, plan, workload), outputs = shared_launches.result(_interleaved_program)
    return root, folder, plan, workload, sum(outputs[1:], outputs[0])


def test_compiled_interleaved_plan_holds_two_stages_per_rank(interleaved, capsys):
    from partitioner.cli import main

    _root, folder, plan, _workload, _done = interleaved
    assert plan.schedule == "interleaved" and plan.num_stages == 4 and plan.world_size == 2
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (0,), (1,)]
    program = json.loads((folder / "plan.json").read_text())["program"]
    assert sorted(tuple(r["stages"]) for r in program["ranks"]) == [(0, 2), (1, 3)]
    peaks = plan.predicted["rank_peak_memory_bytes"]  # a rank's two stages share its device
    assert len(peaks) == 2 and all(peaks[pos] > plan.stages[pos].peak_memory_bytes for pos in range(2))
    assert main(["inspect", str(folder)]) == 0
    assert "rank position 0 (stages 0, 2; ranks 0): peak" in capsys.readouterr().out


def test_interleaved_program_trains_like_the_one_process_oracle_with_dropout(interleaved):
    root, folder, _plan, workload, _done = interleaved
    report = check_run(folder, root / "full", workload=workload)
    assert report.oracle == "unpartitioned traced graph (keyed randomness)"
    assert report.ok, report.text()


def test_interleaved_program_resumes_bit_exact(interleaved):
    root, _folder, _plan, _workload, done = interleaved
    assert f"at step {EVERY}" in done.stderr + done.stdout
    assert _losses(root / "part") + _losses(root / "resumed", EVERY) == _losses(root / "full")
    for rank in range(2):
        for name in (f"rank_{rank}.safetensors", f"optim_rank_{rank}.safetensors"):
            got, want = load_file(root / "resumed" / "final" / name), load_file(root / "full" / "final" / name)
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[k], want[k]) for k in want), (rank, name)
