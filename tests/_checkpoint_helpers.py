"""What checkpoint tests assert and edit beyond the drills of tests/drivers/checkpoint_drills.py."""

from __future__ import annotations

import hashlib
import json
import os

import torch

import pytest

from tests.drivers.checkpoint_drills import FakeTrainer, trainers_at
from runtime.program.spec import load_program
from runtime.resilience import checkpoint as ck


def assert_trains_identically(trainer: FakeTrainer, fresh: FakeTrainer, step: int) -> None:
    """One more identical step on both: bit-identical parameters and Adam state."""
    trainer.fake_step(step)
    fresh.fake_step(step)
    for (n, p), (_, q) in zip(trainer.named_parameters().items(), fresh.named_parameters().items()):
        assert torch.equal(p, q), n
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(trainer.optimizer.state[p][key], fresh.optimizer.state[q][key]), (n, key)


def set_plan_fields(folder: str, **fields) -> None:
    """Edit plan.json's top level (hand-written test folders have no fingerprint)."""
    path = os.path.join(folder, "plan.json")
    with open(path) as f:
        plan = json.load(f)
    plan.update(fields)
    if "plan_hash" in fields:
        plan["program"]["plan_hash"] = fields["plan_hash"]
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    from runtime.program.spec import seal_folder

    seal_folder(folder)  # an edited plan.json is refused unless resealed



def two_stage_mlp_folder(folder: str, *, model_fingerprint: str, plan_hash: str) -> str:
    """A hand-made 2-stage MLP program (2 ranks) whose checkpoints record these identities."""
    from _runtime_folders import mlp_folder

    mlp_folder(folder, splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    set_plan_fields(folder, model_fingerprint=model_fingerprint, plan_hash=plan_hash)
    return folder


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    """A two-stage MLP program folder, one per test module (the hardening tests' common ground)."""
    return two_stage_mlp_folder(str(tmp_path_factory.mktemp("mlp2")),
                                model_fingerprint="mlp-8-32-32-32-4", plan_hash="plan-two-stages")


def two_checkpoints(folder: str, ckpt: str):
    """Checkpoints at steps 1 and 2 (keeping both); returns the program and the trainers at step 2."""
    program = load_program(folder)
    trainers = trainers_at(folder, 1)
    ck.commit_local(ckpt, [ck.snapshot(t) for t in trainers], program)
    for t in trainers:
        t.fake_step(1)
    ck.commit_local(ckpt, [ck.snapshot(t) for t in trainers], program)
    return program, trainers


def rehash_manifest(ckpt: str, step: int, edit) -> None:
    path = os.path.join(ckpt, ck.step_dirname(step), ck.MANIFEST)
    manifest = json.load(open(path))
    manifest.pop("manifest_sha256")
    edit(manifest)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    with open(path, "w") as fh:
        json.dump(manifest, fh)


def lie(ckpt: str, step: int, rank: int, edit) -> None:
    """Rewrite rank's shard of ``step`` with ``edit(header, meta)`` applied to its safetensors
    header (tensor entries) and meta, then give the manifest the new size and sha256: the bytes
    verify, only what they say is wrong."""
    path = os.path.join(ckpt, ck.step_dirname(step), ck.shard_filename(rank))
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"]["meta"])
    meta = edit(header, meta) or meta
    header["__metadata__"]["meta"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 64)  # keep the data aligned
    new = len(raw).to_bytes(8, "little") + raw + data[8 + n:]
    with open(path, "wb") as fh:
        fh.write(new)

    def entry(manifest):
        e = next(e for e in manifest["shards"] if e["rank"] == rank)
        e.update(bytes=len(new), sha256=hashlib.sha256(new).hexdigest())
    rehash_manifest(ckpt, step, entry)
