"""The checkpoint format is pinned to the byte: a fixed trainer state gives the same shard, manifest
and memory-tier slot bytes as when this test was written (Note [checkpoint format]), and the
checkpoints written by every earlier format (tests/golden/checkpoint_format_<n>) still load. A
change that alters these bytes changes the format: give it a new FORMAT and a reader of the old
one, not a new digest.

Format 2 (streamed shards, one writer per name) changed the pins deliberately: the shard is no
longer safetensors.torch.save's layout, and the slot differs from format 1's only in its meta's
"format" string (the slot's layout was already ShardLayout's)."""

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

from runtime.resilience import checkpoint as ck
from runtime.resilience import memtier as mt
from runtime.program.spec import Program

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden")
GOLDEN = os.path.join(GOLDEN_DIR, "checkpoint_format_1")
GOLDEN_2 = os.path.join(GOLDEN_DIR, "checkpoint_format_2")
# sha256 of the files format 2 writes for ``_FixedTrainer``. Format 1's were shard cb462d4c...,
# manifest 6933cd5a..., slot c9864ea1... (tests/golden/checkpoint_format_1 holds its files).
SHARD_SHA256 = "86536a9694af10fa7846294875f7057f02a7628a37404bff3c5b41392c0450e3"
MANIFEST_SHA256 = "22bf9b05cd30dfd9f878dcdac860720010e6e083de9f691e322413042b696886"
SLOT_SHA256 = "f82bbe3611b4376f3df5207af4b95e9e3814fd1890b77d0df744a5ecf592d564"
PROGRAM = Program.from_dict({
    "plan_hash": "plan-pinned", "model_fingerprint": "model-pinned", "workload": "pinned:test",
    "world_size": 1, "num_stages": 1, "dp": 1, "num_microbatches": 1, "global_batch": 1, "schedule": "1f1b",
    "ranks": [{"rank": 0, "stages": [0], "replica": 0}],
    "stages": [{"index": 0, "module": "stage_0", "class": "Stage0", "params": ["layer.weight", "layer.bias"],
                "mutable_buffers": ["norm.running_mean"], "inputs": [], "outputs": []}],
    "data": {"make_batch": ["runtime.data.synthetic:regression_batch", {}], "loss_fn": ["runtime.data.synthetic:mse_loss", {}]},
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


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_2], ids=["format_1", "format_2"])
def test_a_checkpoint_written_by_each_format_still_loads(golden):
    want = _FixedTrainer()
    loaded = ck.load_for_rank(golden, 2, PROGRAM, 0, NEEDED)
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
    """Write the golden checkpoint of the current format, only with a format change (the older
    formats' stay as they are): ``python tests/unit/test_checkpoint_bytes.py --write-golden``."""
    import tempfile

    target = os.path.join(GOLDEN_DIR, "checkpoint_format_" + ck.FORMAT.rsplit("/", 1)[1])
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        _write_disk(tmp, monkeypatch)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp, target)


if __name__ == "__main__" and "--write-golden" in __import__("sys").argv:
    write_golden()
