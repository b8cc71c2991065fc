"""The zero-bubble schedules (zb, zbv; Note [zero-bubble schedules] in partitioner/solver/zero_bubble.py)
with what the combination matrix's pairwise cells do not hold (tests/e2e/test_combination_matrix.py
covers zb and zbv with tp 2, ZeRO-1, each precision, the replica check, the memory tier and
lossless checkpoints, each cell killed, resumed and verified), each a compiled program trained under
torchrun (gloo) in the session's shared launches (tests/_shared_launch.py):

- fp16-mixed under zb (a tiny Llama): the loss scale 2**16 overflows, and a skipped step skips every stage's
  weight-gradient update too (the oracle skips the same steps, its parameters are compared);
- the in-memory checkpoint tier and lossless delta checkpoints under zb: a rank SIGKILLed, the
  job resumed (from host memory; from a delta on disk: the manifest read is a delta's), bit for bit
  the uninterrupted run.

Dropout is on everywhere (keyed: the same masks in every layout). tests/e2e/test_zero_bubble_e2e.py
holds zb and zbv with a tie, recompute, dp 2, 4 pipeline ranks and a disk resume.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _shared_launch import Job, prepare
from partitioner import compile as compile_plan
from partitioner.cli.verify import check_run
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt, hf_llama
from runtime.execute.reference import train_reference_from_folder
from runtime.resilience.checkpoint.shard import step_dirname

STEPS = 3  # the oracle cells
KILL_STEPS = 5  # the checkpoint cells (steps 0..4): a checkpoint every step, a kill before step 3 (memory) or 4
# (lossless: the resume is then from a delta, step 1 being its chain's full checkpoint)


def _gpt():
    return gpt(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=0.1)


def _llama():  # under fp16-mixed its first step overflows the loss scale 2**16 (the tiny GPT's never does)
    return hf_llama(layers=4, width=32, heads=4, vocab=64, seq=16, batch=2, dropout=0.1)


def _workload(name: str):
    return _llama() if name == "zb_fp16" else _gpt()


# name -> (ranks, global batch, compile keywords): 4 stages (2 per pipeline rank) everywhere
CELLS = {
    "zb_fp16": (2, 8, dict(dp=1, schedule="zb", precision="fp16-mixed")),
    "zb_ck": (2, 8, dict(dp=1, schedule="zb", training={"memory_tier": "auto"})),
}


def _compile(name: str):
    devices, batch, options = CELLS[name]
    return compile_plan(_workload(name), cluster=ClusterSpec.homogeneous(devices, "cpu"), global_batch=batch,
                        num_stages=4, microbatches=4, **options)


@prepare
def _zero_bubble_cells(root: Path):
    plans = {}
    for name in CELLS:
        plans[name] = _compile(name)
        plans[name].save(root / name)
    jobs = [Job(CELLS[name][0], [root / name, "--steps", STEPS, "--quiet", "--run-dir", root / name / "run"])
            for name in CELLS if name != "zb_ck"]
    ck = root / "zb_ck"
    every = ["--steps", KILL_STEPS, "--checkpoint-every", 1, "--quiet"]
    jobs += [Job(2, [ck, *every, "--memory-tier", "off", "--run-dir", root / "clean", "--checkpoint-dir",
                     root / "ck_clean"]),
             Job(2, [ck, *every, "--memory-tier", "none", "--fail-at", "1:3:kill", "--run-dir", root / "memtier",
                     "--checkpoint-dir", root / "ck_memtier"], restarts=1),
             # every checkpoint kept: the delta resumed from and its base are still there to be read
             Job(2, [ck, *every, "--memory-tier", "off", "--checkpoint-compression", "lossless",
                     "--keep-checkpoints", 8, "--fail-at", "0:4:kill", "--run-dir", root / "lossless",
                     "--checkpoint-dir", root / "ck_lossless"], restarts=1)]
    names = [name for name in CELLS if name != "zb_ck"] + ["clean", "memtier", "lossless"]
    return (root, plans, names), jobs


@pytest.fixture(scope="module")
def cells(shared_launches):
    (root, plans, names), outputs = shared_launches.result(_zero_bubble_cells)
    return root, plans, dict(zip(names, outputs))


def _metrics(run_dir: Path) -> list[dict]:
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():  # a re-run step overwrites the lost one
        row = json.loads(line)
        by_step[row["step"]] = row
    return [by_step[k] for k in sorted(by_step)]


def _finals(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted((run_dir / "final").glob("*.safetensors"))}


def _bit_exact(got_dir: Path, want_dir: Path) -> None:
    assert [r["loss"] for r in _metrics(got_dir)] == [r["loss"] for r in _metrics(want_dir)]
    got, want = _finals(got_dir), _finals(want_dir)
    assert sorted(got) == sorted(want) and want
    for file, tensors in want.items():
        assert sorted(got[file]) == sorted(tensors), file
        assert all(torch.equal(got[file][k], t) for k, t in tensors.items()), file


def test_fp16_under_zb_trains_like_the_oracle(cells):
    name = "zb_fp16"
    root, plans, _out = cells
    plan, (_devices, _batch, options) = plans[name], CELLS[name]
    assert (plan.schedule, plan.num_stages, plan.dp, plan.tensor_parallel) == \
        (options["schedule"], 4, options["dp"], options.get("tensor_parallel", 1))
    assert plan.decisions.precision == options.get("precision", "fp32")
    assert plan.decisions.shard_optimizer is (options.get("shard_optimizer") == "on")
    report = check_run(root / name, root / name / "run", steps=STEPS, workload=_workload(name))
    assert report.ok, f"{name}:\n{report.text()}"


def test_fp16_overflow_under_zb_skips_the_weight_gradient_update_too(cells):
    """The overflowing step is skipped on every stage: were a W applied on some stage, its
    parameters would leave the oracle's (which skips the same steps)."""
    root, _plans, _out = cells
    rows = _metrics(root / "zb_fp16" / "run")
    oracle_skipped: list[bool] = []
    train_reference_from_folder(str(root / "zb_fp16"), STEPS, skipped=oracle_skipped)
    assert [r["skipped"] for r in rows] == oracle_skipped
    assert any(oracle_skipped), "no step overflowed: the test would pass without loss scaling"
    assert not all(oracle_skipped), "no step trained: the parameters compared would be the initial ones"
    for before, after in zip(rows, rows[1:]):
        assert after["loss_scale"] == before["loss_scale"] / (2 if after["skipped"] else 1)


def test_zb_resumes_from_the_memory_tier_bit_exact(cells):
    root, _plans, out = cells
    text = out["memtier"].stdout + out["memtier"].stderr
    assert "fault injection: kill before step 3" in text and "restarting it" in text, text[-3000:]
    recoveries = [json.loads(line) for line in (root / "memtier" / "recovery.jsonl").read_text().splitlines()]
    assert sorted(r["rank"] for r in recoveries) == [0, 1] and len({(r["step"], r["tier"]) for r in recoveries}) == 1
    if recoveries[0]["tier"] == "memory":
        assert {r["disk_shards_read"] for r in recoveries} == {0}, recoveries
    else:  # Note [memory tier fallback] in tests/e2e/test_combination_matrix.py: only with the reason said
        assert re.search(r"memory tier: (.*): recovering from disk", text), (recoveries, text[-3000:])
    _bit_exact(root / "memtier", root / "clean")


def test_zb_resumes_from_a_lossless_delta_bit_exact(cells):
    root, _plans, out = cells
    text = out["lossless"].stdout + out["lossless"].stderr
    assert "fault injection: kill before step 4" in text and "restarting it" in text, text[-3000:]
    found = re.findall(r"resuming from checkpoint \S+ at step (\d+)", text)
    assert found, text[-3000:]
    resumed = int(found[-1])
    manifest = json.loads((root / "ck_lossless" / step_dirname(resumed) / "manifest.json").read_text())
    assert manifest["compression"] == "lossless" and manifest["base_step"] is not None, manifest
    _bit_exact(root / "lossless", root / "clean")
    report = check_run(root / "zb_ck", root / "lossless", steps=KILL_STEPS, workload=_gpt())
    assert report.ok, report.text()
