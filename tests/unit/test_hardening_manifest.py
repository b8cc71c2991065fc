"""Issue 14, manifests and retention: a malformed manifest is a corrupt one (skipped, recovery falls
back, inspect says why), restore checks shapes and dtypes, retention keeps N checkpoints that
verify, debris (discarded_step_N, *.tmp) goes at start-up and on failure, files are owner-only."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat

import pytest
import torch

from _checkpoint_helpers import two_checkpoints, two_rank  # noqa: F401 - two_rank is a fixture
from _runtime_folders import one_thread  # noqa: F401
from partitioner.inspect import checkpoints as listing
from runtime.resilience import checkpoint as ck
from tests.drivers.checkpoint_drills import FakeTrainer, newest_for_all, trainers_at
from runtime.errors import CheckpointCorruptError, PlanMismatchError
from runtime.program.spec import load_program
from runtime.resilience.recovery import agree_newest


def _rewrite_manifest(ckpt: str, step: int, edit) -> None:
    """Edit step's manifest and give it a valid hash again: only its structure is wrong."""
    path = os.path.join(ckpt, ck.step_dirname(step), ck.MANIFEST)
    manifest = json.load(open(path))
    manifest.pop("manifest_sha256")
    edit(manifest)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    with open(path, "w") as fh:
        json.dump(manifest, fh)


def _outside_copy(ckpt: str, manifest: dict) -> None:
    # an exact copy of rank 0's own shard, but outside the checkpoint folder, named by absolute path
    src = os.path.join(ckpt, ck.step_dirname(2), manifest["shards"][0]["file"])
    dst = os.path.join(os.path.dirname(ckpt), "outside.safetensors")
    shutil.copy(src, dst)
    manifest["shards"][0]["file"] = dst


MALFORMED = {
    "missing plan_hash": lambda m: m.pop("plan_hash"),
    "missing shards": lambda m: m.pop("shards"),
    "string rank": lambda m: m["shards"][0].update(rank="0"),
    "params null": lambda m: m["shards"][0].update(params=None),
    "buffers a string": lambda m: m["shards"][1].update(buffers="x"),
    "stages of strings": lambda m: m["shards"][0].update(stages=["0"]),
    "bytes a bool": lambda m: m["shards"][0].update(bytes=True),
    "shards null": lambda m: m.update(shards=None),
    "shard entry a list": lambda m: m["shards"].__setitem__(0, [1, 2]),
    "world_size a string": lambda m: m.update(world_size="2"),
    "dotdot shard name": lambda m: m["shards"][0].update(
        file=f"../{ck.step_dirname(2)}/{m['shards'][0]['file']}"),
    "absolute shard name": None,  # _outside_copy
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_is_skipped_like_a_corrupt_one(two_rank, tmp_path, case):
    ckpt = str(tmp_path / "ckpt")
    program = two_checkpoints(two_rank, ckpt)[0]
    _rewrite_manifest(ckpt, 2, MALFORMED[case] or (lambda m: _outside_copy(ckpt, m)))
    views, warnings = [], []
    for rank in range(2):
        valid, _ = ck.find_valid(ckpt, program, rank, list(program.stages[rank].params), warn=warnings.append)
        views.append(valid)
    assert agree_newest(views) == 1, views  # fell back to the older valid checkpoint
    assert all(ck.step_dirname(2) in w and "malformed" in w for w in warnings) and len(warnings) == 2
    step, _ = newest_for_all(ckpt, program)
    assert step == 1
    assert ck.newest_committed(ckpt) == 1
    with pytest.raises(CheckpointCorruptError, match="malformed"):
        ck.read_manifest(ckpt, 2)
    # inspect --checkpoints says why, and a resume picks step 1
    scanned = listing.scan(ckpt, program=program)
    assert scanned["resume"]["step"] == 1
    entries = {e["step"]: e for e in scanned["checkpoints"]}
    assert entries[2]["status"] == "corrupt" and "malformed" in entries[2]["reason"], entries[2]
    assert entries[1]["status"] == "valid"


def test_restore_checks_shape_and_dtype_naming_the_tensor(two_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    program = two_checkpoints(two_rank, ckpt)[0]
    fresh = FakeTrainer(two_rank, 0, program)
    names = list(fresh.named_parameters())
    before = {n: p.detach().clone() for n, p in fresh.named_parameters().items()}
    first = names[0]
    last = [n for n, p in fresh.named_parameters().items() if p.dim() == 2][-1]
    loaded = ck.load_for_rank(ckpt, 2, program, 0, names)
    # a trailing-dimension tensor broadcasts silently through copy_: must be refused
    live = fresh.named_parameters()[last]
    loaded.params[last] = loaded.params[last].reshape(-1)[: live.shape[-1]].clone()
    with pytest.raises(PlanMismatchError) as err:
        ck.restore(fresh, loaded)
    msg = str(err.value)
    assert repr(last) in msg and str(tuple(live.shape)) in msg and str(tuple(loaded.params[last].shape)) in msg
    assert "--checkpoint-dir" in msg
    for n, p in fresh.named_parameters().items():  # nothing was copied
        assert torch.equal(p, before[n]), n
    assert fresh.steps_done == 0
    # same shape, another dtype
    loaded = ck.load_for_rank(ckpt, 2, program, 0, names)
    loaded.params[first] = loaded.params[first].double()
    with pytest.raises(PlanMismatchError, match="float64"):
        ck.restore(fresh, loaded)
    # optimizer state of another shape
    loaded = ck.load_for_rank(ckpt, 2, program, 0, names)
    loaded.optim[first]["exp_avg"] = torch.zeros(3)
    with pytest.raises(PlanMismatchError, match="exp_avg"):
        ck.restore(fresh, loaded)
    # and the right one still restores
    ck.restore(fresh, ck.load_for_rank(ckpt, 2, program, 0, names))
    assert fresh.steps_done == 2


def _rot(ckpt: str, step: int) -> None:
    path = os.path.join(ckpt, ck.step_dirname(step), ck.shard_filename(0))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(data)


def test_retention_keeps_n_checkpoints_that_verify(two_rank, tmp_path):
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 0)
    ckpt = str(tmp_path / "ckpt")

    def commit(keep):
        for t in trainers:
            t.fake_step(t.steps_done)
        return ck.commit_local(ckpt, [ck.snapshot(t) for t in trainers], program, keep=keep)["step"]

    commit(2)
    commit(2)
    _rot(ckpt, 2)  # bit rot in the newer of the two
    commit(2)  # step 3: keeps 3 and 1 (the two that verify), drops the rotted 2
    assert ck.list_step_dirs(ckpt) == [3, 1]
    assert ck.verifies(ckpt, 1) and ck.verifies(ckpt, 3)
    # the newest itself rotted: pruning after it must not delete the last valid one
    _rot(ckpt, 3)
    assert ck.prune(ckpt, keep=1, newest=3) == []
    assert ck.list_step_dirs(ckpt) == [3, 1] and ck.verifies(ckpt, 1)
    step, _ = newest_for_all(ckpt, program)
    assert step == 1


def test_retention_still_keeps_the_newest_n(two_rank, tmp_path):
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 0)
    for _ in range(5):
        for t in trainers:
            t.fake_step(t.steps_done)
        ck.commit_local(str(tmp_path), [ck.snapshot(t) for t in trainers], program, keep=3)
    assert ck.list_step_dirs(str(tmp_path)) == [5, 4, 3]


def _debris(ckpt: str, step: int = 7) -> list[str]:
    os.makedirs(os.path.join(ckpt, "discarded_" + ck.step_dirname(9)), exist_ok=True)
    open(os.path.join(ckpt, "discarded_" + ck.step_dirname(9), "shard_rank_00000.safetensors"), "wb").write(b"x" * 100)
    os.makedirs(os.path.join(ckpt, ck.step_dirname(step)), exist_ok=True)
    open(os.path.join(ckpt, ck.step_dirname(step), "shard_rank_00001.safetensors.tmp"), "wb").write(b"x" * 100)
    return ["discarded_" + ck.step_dirname(9), os.path.join(ck.step_dirname(step), "shard_rank_00001.safetensors.tmp")]


def test_debris_is_cleaned_at_start_up_before_the_first_persist(two_rank, tmp_path, monkeypatch):
    import torch.distributed as dist

    from runtime.resilience.checkpoint.persist import Checkpointer

    ckpt = str(tmp_path / "ckpt")
    two_checkpoints(two_rank, ckpt)
    left = _debris(ckpt)
    trainer = trainers_at(two_rank, 2)[0]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        checkpointer = Checkpointer(trainer, ckpt, every=1, keep=3)
        for path in left:
            assert not os.path.exists(os.path.join(ckpt, path)), path
        assert ck.list_step_dirs(ckpt) == [7, 2, 1]  # checkpoints (and step dirs) untouched
        assert ck.verifies(ckpt, 2) and ck.verifies(ckpt, 1)

        # on failure (a full disk): the failed rank's .tmp and the debris go
        left = _debris(ckpt, step=3)  # another rank's .tmp of the failed step
        real_write = os.write

        def full_disk(fd, data):
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).endswith(".tmp"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", full_disk)
        trainer.fake_step(2)
        checkpointer.checkpoint(3)
        with pytest.raises(RuntimeError, match="No space left"):
            checkpointer._join()
        monkeypatch.setattr(os, "write", real_write)
        for path in left:
            assert not os.path.exists(os.path.join(ckpt, path)), path
        assert not [n for n in os.listdir(os.path.join(ckpt, ck.step_dirname(3))) if n.endswith(".tmp")]
        assert ck.verifies(ckpt, 2)
    finally:
        dist.destroy_process_group()


def test_a_failed_write_leaves_no_tmp(tmp_path, monkeypatch):
    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        ck.write_file_atomic(str(tmp_path / "shard"), b"x" * 10)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_commit_after_prune_leaves_a_newer_steps_tmp_alone(two_rank, tmp_path):
    """After a commit another rank may already write the next step: its .tmp is not debris yet."""
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 1)
    ckpt = str(tmp_path)
    os.makedirs(os.path.join(ckpt, ck.step_dirname(5)))
    inflight = os.path.join(ckpt, ck.step_dirname(5), "shard_rank_00001.safetensors.tmp")
    open(inflight, "wb").write(b"x")
    ck.commit_local(ckpt, [ck.snapshot(t) for t in trainers], program)
    assert os.path.exists(inflight)


def test_checkpoint_files_are_owner_only(two_rank, tmp_path):
    old = os.umask(0o022)
    try:
        ckpt = str(tmp_path / "ckpt")
        two_checkpoints(two_rank, ckpt)[0]
    finally:
        os.umask(old)
    step_dir = os.path.join(ckpt, ck.step_dirname(2))
    assert stat.S_IMODE(os.stat(step_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o700
    for name in os.listdir(step_dir):
        assert stat.S_IMODE(os.stat(os.path.join(step_dir, name)).st_mode) == 0o600, name
