"""The checkpoint format is pinned to the byte: a fixed trainer state gives the same shard, manifest
and memory-tier slot bytes as when this test was written (Note [checkpoint format]), and a
checkpoint written then (tests/golden/checkpoint_format_1) still loads. A change that alters these
bytes changes the format: give it a new FORMAT and a reader of the old one, not a new digest."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import time
import warnings

import numpy as np
import pytest
import torch

from runtime import checkpoint as ck
from runtime import memtier as mt
from runtime.program import Program

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "checkpoint_format_1")
# sha256 of the files the format writes for ``_FixedTrainer`` (recorded before runtime/checkpoint.py
# and runtime/memtier.py became packages)
SHARD_SHA256 = "cb462d4cad27cca42eadba9aa8cbe1c24e2ccea662d3054d51d5bed68ca09fb7"
MANIFEST_SHA256 = "6933cd5ac2f705b2986368bd704912364310cc0b58806a8cff36d82eb0b25b9c"
SLOT_SHA256 = "c9864ea1a2bd7b94003820343851b5297bb739a36cd89673000ef21f6ad4ca94"
PROGRAM = Program.from_dict({
    "plan_hash": "plan-pinned", "model_fingerprint": "model-pinned", "workload": "pinned:test",
    "world_size": 1, "num_stages": 1, "dp": 1, "num_microbatches": 1, "global_batch": 1, "schedule": "1f1b",
    "ranks": [{"rank": 0, "stages": [0], "replica": 0}],
    "stages": [{"index": 0, "module": "stage_0", "class": "Stage0", "params": ["layer.weight", "layer.bias"],
                "mutable_buffers": ["norm.running_mean"], "inputs": [], "outputs": []}],
    "data": {"make_batch": ["runtime.data:regression_batch", {}], "loss_fn": ["runtime.data:mse_loss", {}]},
    "optimizer": {"name": "adamw", "lr": 0.1}})
NEEDED = ["layer.weight", "layer.bias", "norm.running_mean"]


class _FixedTrainer:
    """What a shard reads of a RankTrainer, with every value fixed (no folder, no arithmetic that
    another torch build could round differently)."""

    def __init__(self):
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 12).reshape(3, 4))
        self.bias = torch.nn.Parameter(torch.arange(3, dtype=torch.float32) / 7)
        self.running_mean = torch.arange(4, dtype=torch.float32) * 0.25
        self.optimizer = torch.optim.AdamW([self.weight, self.bias], lr=0.1)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        for k, p in enumerate((self.weight, self.bias)):
            self.optimizer.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.full_like(p, 0.125 * (k + 1)),
                                       "exp_avg_sq": torch.full_like(p, 0.0625 * (k + 1))}
        with warnings.catch_warnings():  # (stepped without an optimizer step: the state is set by hand)
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.step()
            self.lr_scheduler.step()
        self.program, self.rank, self.stage_ids, self.replica, self.steps_done = PROGRAM, 0, [0], 0, 2

    def named_parameters(self):
        return {"layer.weight": self.weight, "layer.bias": self.bias}

    def named_mutable_buffers(self):
        return {"norm.running_mean": self.running_mean}


def _seed_everything():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)


def _sha(path: str, nbytes: int | None = None) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read() if nbytes is None else fh.read(nbytes)).hexdigest()


def _write_disk(ckpt_dir: str, monkeypatch) -> dict:
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)  # the manifest's created_unix
    _seed_everything()
    return ck.commit_local(ckpt_dir, [ck.snapshot(_FixedTrainer())], PROGRAM)


def test_disk_checkpoint_bytes_are_pinned(tmp_path, monkeypatch):
    _write_disk(str(tmp_path), monkeypatch)
    step_dir = tmp_path / ck.step_dirname(2)
    assert sorted(os.listdir(step_dir)) == [ck.MANIFEST, ck.shard_filename(0)]
    assert _sha(str(step_dir / ck.shard_filename(0))) == SHARD_SHA256
    assert _sha(str(step_dir / ck.MANIFEST)) == MANIFEST_SHA256


def test_memory_slot_bytes_are_pinned(tmp_path):
    store = mt.LocalStore(str(tmp_path), 0, mt.plan_redundancy((0,), mode="none"), PROGRAM.plan_hash)
    _seed_everything()
    slot, nbytes, _ = store.snapshot(_FixedTrainer())
    sha = store.commit_own(slot, 2, nbytes)
    assert sha == _sha(slot.data_path, nbytes) == SLOT_SHA256


def test_a_checkpoint_written_by_format_1_still_loads():
    want = _FixedTrainer()
    loaded = ck.load_for_rank(GOLDEN, 2, PROGRAM, 0, NEEDED)
    assert loaded.step == 2 and loaded.rng_tensors is not None
    for name, value in {**want.named_parameters(), **want.named_mutable_buffers()}.items():
        got = loaded.params.get(name, loaded.buffers.get(name))
        assert torch.equal(got, value), name
    for k, p in enumerate((want.weight, want.bias)):
        name = ["layer.weight", "layer.bias"][k]
        assert loaded.param_steps[name] == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded.optim[name][key], want.optimizer.state[p][key]), (name, key)
    assert loaded.lr_scheduler["last_epoch"] == 2


def write_golden() -> None:
    """(Re)write the golden checkpoint, only with a format change:
    ``python tests/unit/test_checkpoint_bytes.py --write-golden``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        _write_disk(tmp, monkeypatch)
        shutil.rmtree(GOLDEN, ignore_errors=True)
        shutil.copytree(tmp, GOLDEN)


if __name__ == "__main__" and "--write-golden" in __import__("sys").argv:
    write_golden()
