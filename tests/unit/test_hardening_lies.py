"""Issue 29, hardening third round: a checkpoint whose bytes verify (sha256 re-made to match) but
whose contents lie is not valid on that rank, decided before the ranks agree, so a resume falls
back to the older valid one (Note [valid means restorable]); a resume trains at the plan's
learning rate, never the checkpoint's (Note [the plan's learning rate])."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from _checkpoint_helpers import assert_trains_identically, lie, two_checkpoints, two_rank  # noqa: F401 - two_rank is a fixture
from _runtime_folders import one_thread  # noqa: F401
from runtime.program.spec import load_program, seal_folder
from runtime.resilience.checkpoint.delta import CODEC
from runtime.resilience import checkpoint as ck
from runtime.resilience.recovery import agree_newest, valid_for
from tests.drivers.checkpoint_drills import FakeTrainer, trainers_at


def _a_2d_param(header) -> str:
    return next(k for k, v in sorted(header.items()) if k.startswith("param/") and len(v["shape"]) == 2
                and v["shape"][0] != v["shape"][1])


def _shape(header, meta):
    key = _a_2d_param(header)
    header[key]["shape"] = header[key]["shape"][::-1]


def _dtype(header, meta):
    header[_a_2d_param(header)]["dtype"] = "I32"


def _scheduler(header, meta):
    meta["lr_scheduler"]["optimizer"] = 1


def _counter(header, meta):
    meta["lr_scheduler"]["last_epoch"] = "two"


def _python_rng(header, meta):
    meta["python_random"] = [3, [1, 2, 3], None]


def _torch_rng(header, meta):
    header["rng/torch_cpu"]["dtype"] = "I8"


def _tp_piece(header, meta):
    meta["tp_pieces"] = {meta["params"][0]: "x"}


def _encoding(header, meta):
    meta["encoding"] = {"codec": CODEC, "base_step": None, "tensors": [1]}


def _param_steps(header, meta):
    meta["param_steps"] = {k: "1" for k in meta["param_steps"]}


LIES = {
    "lying shape": _shape, "lying dtype": _dtype, "meta a list": lambda h, m: [m],
    "scheduler holds optimizer": _scheduler, "scheduler counter a string": _counter,
    "python rng": _python_rng, "torch rng": _torch_rng, "tp piece a string": _tp_piece,
    "encoding tensors a list": _encoding, "param_steps of strings": _param_steps,
}


def _resume_views(folder: str, program, ckpt: str):
    """Each rank's valid steps (what ``recover`` all-gathers), the warnings, and fresh trainers."""
    views, warnings, fresh = [], [], []
    for rank in range(program.world_size):
        trainer = FakeTrainer(folder, rank, program)
        valid, _ = valid_for(trainer, ckpt, warn=warnings.append)
        views.append(valid)
        fresh.append(trainer)
    return views, warnings, fresh


@pytest.mark.parametrize("case", sorted(LIES))
def test_a_lying_newest_checkpoint_falls_back_to_the_older_valid_one(two_rank, tmp_path, case):
    ckpt = str(tmp_path / "ckpt")
    program, _ = two_checkpoints(two_rank, ckpt)
    lie(ckpt, 2, 0, LIES[case])
    assert ck.verifies(ckpt, 2)  # the bytes check out
    views, warnings, fresh = _resume_views(two_rank, program, ckpt)
    assert views[0] == [1] and views[1] == [2, 1], views
    assert agree_newest(views) == 1
    assert len(warnings) == 1 and ck.step_dirname(2) in warnings[0] and "Traceback" not in warnings[0]
    assert "\n" not in warnings[0], warnings[0]
    # and step 1 restores and trains on every rank (the same as a run that stopped at step 1)
    reference = trainers_at(two_rank, 1)
    for rank, trainer in enumerate(fresh):
        needed = ck.needed_names(trainer)
        ck.restore(trainer, ck.load_for_rank(ckpt, 1, program, rank, needed))
        assert trainer.steps_done == 1
        assert_trains_identically(reference[rank], trainer, 1)


def test_a_huge_sparse_shard_is_refused_before_it_is_allocated(two_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    program, _ = two_checkpoints(two_rank, ckpt)
    path = os.path.join(ckpt, ck.step_dirname(2), ck.shard_filename(0))
    os.truncate(path, 64 << 30)  # 64 GiB, sparse: nothing on disk
    views, warnings, _ = _resume_views(two_rank, program, ckpt)
    assert agree_newest(views) == 1 and views[0] == [1]
    assert str(64 << 30) in warnings[0] and path in warnings[0]


def test_the_memory_tiers_check_refuses_a_lying_slot_before_agreeing(two_rank, tmp_path):
    """The memory tier's bytes go through the same checks (``_fetch`` counts them as a failed tier)."""
    ckpt = str(tmp_path / "ckpt")
    program, trainers = two_checkpoints(two_rank, ckpt)
    lie(ckpt, 2, 0, _shape)
    data = bytearray(open(os.path.join(ckpt, ck.step_dirname(2), ck.shard_filename(0)), "rb").read())
    fresh = FakeTrainer(two_rank, 0, program)
    loaded = ck.loaded_from_bytes(data, step=2, program=program, rank=0, needed=ck.needed_names(fresh),
                                  where="memory tier (memory) step 2 of rank 0")
    with pytest.raises(ck.CheckpointCorruptError, match="checkpoint step 2 holds parameter"):
        ck.check_restorable(fresh, loaded)
    data = bytearray(ck.serialize(ck.snapshot(trainers[0])))
    with pytest.raises(ck.CheckpointCorruptError, match="meta field 'params'"):
        bad = ck.snapshot(trainers[0])
        bad.meta["params"] = "all"
        ck.loaded_from_bytes(bytearray(ck.serialize(bad)), step=2, program=program, rank=0,
                             needed=ck.needed_names(fresh), where="slot")


# ---------------------------------------------------------------------------------------------
# The learning rate (Note [the plan's learning rate])


def _lrs(trainer) -> list[float]:
    return [g["lr"] for g in trainer.optimizer.param_groups]


def test_a_shards_learning_rate_never_reaches_the_optimizer(two_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    program, trainers = two_checkpoints(two_rank, ckpt)

    def huge(header, meta):
        meta["lr_scheduler"].update(base_lrs=[1e6], _last_lr=[1e6])
    lie(ckpt, 2, 0, huge)
    views, _, fresh = _resume_views(two_rank, program, ckpt)
    assert agree_newest(views) == 2  # a number where a number belongs: valid, but not obeyed
    ck.restore(fresh[0], ck.load_for_rank(ckpt, 2, program, 0, ck.needed_names(fresh[0])))
    assert _lrs(fresh[0]) == _lrs(trainers[0]) and max(_lrs(fresh[0])) < 1
    assert fresh[0].lr_scheduler.get_last_lr() == _lrs(trainers[0])
    assert fresh[0].lr_scheduler.last_epoch == 2
    assert_trains_identically(trainers[0], fresh[0], 2)  # bit for bit as the run that never stopped


def test_a_recompiled_learning_rate_wins_over_the_checkpoints(two_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    program, _ = two_checkpoints(two_rank, ckpt)
    folder = str(tmp_path / "lr05")
    shutil.copytree(two_rank, folder)
    with open(os.path.join(folder, "plan.json")) as fh:
        plan = json.load(fh)
    old_lr = plan["program"]["optimizer"]["lr"]
    plan["program"]["optimizer"]["lr"] = 0.5
    with open(os.path.join(folder, "plan.json"), "w") as fh:
        json.dump(plan, fh, indent=1)
    seal_folder(folder)
    recompiled = load_program(folder)
    assert recompiled.optimizer.lr == 0.5 != old_lr
    uninterrupted = trainers_at(folder, 2)  # the new lr's schedule at step 2
    for rank in range(2):
        fresh = FakeTrainer(folder, rank, recompiled)
        ck.restore(fresh, ck.load_for_rank(ckpt, 2, recompiled, rank, ck.needed_names(fresh)))
        assert _lrs(fresh) == _lrs(uninterrupted[rank]), (_lrs(fresh), old_lr)
        assert fresh.lr_scheduler.last_epoch == 2 and fresh.steps_done == 2
        expected = [0.5 * f(2) for f in fresh.lr_scheduler.lr_lambdas]
        assert _lrs(fresh) == pytest.approx(expected)
