"""Hardening of the memory tier's shared-memory folder (issue 14; Note [memory tier trust] in
runtime/resilience/memtier/slots.py): the tier works only in a 0700 folder it creates inside --memory-dir and
removes only that; planted folders, links and snapshots of another run are refused or ignored; a
full /dev/shm turns the tier off with a warning instead of SIGBUS; stale folders go; a fresh
checkpoint directory starts fresh; a one-host plan's settings work; a malformed slot fails before
the ranks agree. One process, a one-rank gloo group (no torchrun)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from _checkpoint_helpers import set_plan_fields
from _runtime_folders import mlp_folder, one_thread  # noqa: F401
from runtime.resilience import memtier as mt
from runtime.resilience import recovery
from tests.drivers.checkpoint_drills import trainers_at
from runtime.resilience.memtier import slots as slots_mod
from runtime.resilience.memtier import tier as tier_mod
from runtime.program.parts import MemoryTierPlan
from runtime.launch.run_options import RunOptions


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mlp1_mem"))
    mlp_folder(folder, splits=[[0, 1, 2, 3]], ranks=[([0], 0)])
    set_plan_fields(folder, model_fingerprint="mlp-mem1", plan_hash="plan-mem1")
    return folder


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    rdzv = tmp_path_factory.mktemp("rdzv")
    dist.init_process_group("gloo", init_method=f"file://{rdzv}/rdzv", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tier(folder, memory_dir, ckpt_dir, steps=2, mode="auto"):
    trainer = trainers_at(folder, steps)[0]
    settings = mt.Settings(mode, 1, None, None, str(memory_dir) if memory_dir else None)
    return trainer, mt.MemoryTier(trainer, settings, ckpt_dir=str(ckpt_dir))


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


# --- --memory-dir X: the tier's own folder, X kept ------------------------------------------------


def test_memory_dir_itself_and_its_other_contents_survive_a_clean_run(one_rank, world1, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "keep.txt").write_text("the user's")
    (shm / "other-job").mkdir()
    trainer, tier = _tier(one_rank, shm, tmp_path / "ck")
    assert os.path.dirname(tier.root) == str(shm) and tier.root != str(shm)
    assert tier.enabled
    tier.snapshot(trainer.steps_done)
    tier._join()
    assert tier.store.inventory()["own"] == {trainer.steps_done: tier.store.layout.total_bytes}
    # private: the tier's folders 0700, its files 0600
    for d, dirs, files in os.walk(tier.root):
        assert _mode(d) == 0o700, d
        for f in files:
            assert _mode(os.path.join(d, f)) == 0o600, f
    tier.finish()
    assert not os.path.exists(tier.root)
    assert (shm / "keep.txt").read_text() == "the user's" and (shm / "other-job").is_dir()


# --- a guessable, trusted folder --------------------------------------------------------------------


def test_planted_folder_link_or_foreign_owner_is_refused(tmp_path, monkeypatch):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(mt.UnsafeMemoryDir, match="mode 0o755"):
        slots_mod.secure_dir(str(loose))
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(mt.UnsafeMemoryDir, match="not a folder"):
        slots_mod.secure_dir(str(link))
    mine = tmp_path / "mine"
    slots_mod.secure_dir(str(mine))
    assert _mode(mine) == 0o700
    monkeypatch.setattr(os, "getuid", lambda: os.lstat(mine).st_uid + 4242)
    with pytest.raises(mt.UnsafeMemoryDir, match="belongs to uid"):
        slots_mod.secure_dir(str(mine))


def test_planted_folder_at_the_tiers_path_stops_the_tier(one_rank, world1, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    ck = tmp_path / "ck"
    run_id = slots_mod.run_id_for(str(ck))
    root = slots_mod.default_root(str(ck), "plan-mem1", run_id, base=str(shm))
    os.mkdir(root, 0o777)
    os.chmod(root, 0o777)
    with pytest.raises(mt.UnsafeMemoryDir, match=os.path.basename(root)):
        _tier(one_rank, shm, ck)


def test_planted_link_as_a_data_file_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    store = mt.LocalStore(str(tmp_path / "root"), 0, mt.plan_redundancy((0,), mode="none"), "p")
    os.makedirs(store.own[0].dir, mode=0o700)
    os.chmod(os.path.dirname(store.own[0].dir), 0o700)
    os.symlink(victim, store.own[0].data_path)
    with pytest.raises(OSError):
        store.own[0].writable(4096)
    assert victim.read_bytes() == b"precious"
    # and a record that is a link is not read
    os.symlink(victim, store.own[1].record_path)
    assert store.own[1].record() is None


def test_snapshot_of_another_run_or_plan_is_ignored(one_rank, tmp_path):
    trainer = trainers_at(one_rank, 3)[0]
    red = mt.plan_redundancy((0,), mode="none")
    planted = mt.LocalStore(str(tmp_path), 0, red, "plan-mem1", "0123456789abcdef")
    slot, nbytes, _ = planted.snapshot(trainer)
    planted.commit_own(slot, 3, nbytes)
    assert planted.inventory()["own"] == {3: nbytes}
    for other in (mt.LocalStore(str(tmp_path), 0, red, "plan-mem1", "fedcba9876543210"),
                  mt.LocalStore(str(tmp_path), 0, red, "another-plan", "0123456789abcdef")):
        assert other.inventory()["own"] == {} and other.find(other.own, 3) is None
    assert json.loads(open(slot.record_path).read())["run_id"] == "0123456789abcdef"


# --- a full /dev/shm ------------------------------------------------------------------------------


def test_full_shared_memory_turns_the_tier_off_with_a_warning(one_rank, world1, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tier_mod, "free_bytes", lambda path: 64 << 10, raising=False)
    shm = tmp_path / "shm"
    _, tier = _tier(one_rank, shm, tmp_path / "ck")
    out = capsys.readouterr()
    assert not getattr(tier, "enabled", True)
    assert "memory tier off" in out.out + out.err and "MiB free" in out.out + out.err
    assert not os.path.exists(tier.root) and shm.is_dir()
    monkeypatch.undo()
    _, tier = _tier(one_rank, shm, tmp_path / "ck")
    assert tier.enabled
    tier.finish()


def test_host_need_counts_every_rank_of_the_host():
    assert slots_mod.host_need([10, 20, 30], [0, 0, 1], "none", 0) == 60
    assert slots_mod.host_need([10, 20, 30], [0, 0, 1], "copy", 1) == 120


# --- stale folders, a fresh checkpoint directory ----------------------------------------------------


def test_stale_folders_go_live_and_foreign_ones_stay(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    uid = os.getuid()
    mine = base / f"{slots_mod.MEMDIR_PREFIX}u{uid}-aaaaaaaaaaaa-run2"
    superseded = base / f"{slots_mod.MEMDIR_PREFIX}u{uid}-aaaaaaaaaaaa-run1"
    dead = base / f"{slots_mod.MEMDIR_PREFIX}u{uid}-bbbbbbbbbbbb-run1"
    live = base / f"{slots_mod.MEMDIR_PREFIX}u{uid}-cccccccccccc-run1"
    unowned_new = base / f"{slots_mod.MEMDIR_PREFIX}u{uid}-dddddddddddd-run1"
    someone_else = base / f"{slots_mod.MEMDIR_PREFIX}u{uid + 1}-eeeeeeeeeeee-run1"
    not_ours = base / "partitioner-test-x"
    for d in (mine, superseded, dead, live, unowned_new, someone_else, not_ours):
        d.mkdir(mode=0o700)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = slots_mod._host_tag()
    (dead / f"owner_{here}_{gone.pid}").touch()
    (live / f"owner_{here}_{os.getpid()}").touch()
    other_container = base / f"{slots_mod.MEMDIR_PREFIX}u{uid}-ffffffffffff-run1"
    other_container.mkdir(mode=0o700)
    (other_container / f"owner_{here}x_{gone.pid}").touch()  # a pid of another pid namespace: not judged
    old_unowned = base / f"{slots_mod.MEMDIR_PREFIX}u{uid}-999999999999-run1"
    old_unowned.mkdir(mode=0o700)
    os.utime(old_unowned, (1, 1))
    removed = slots_mod.clear_stale(str(base), str(mine))
    assert sorted(removed) == sorted([str(superseded), str(dead), str(old_unowned)])
    for d in (mine, live, unowned_new, someone_else, not_ours, other_container):
        assert d.is_dir(), d


def test_a_fresh_checkpoint_dir_does_not_resume_from_a_leftover_memory_snapshot(one_rank, world1, tmp_path):
    shm, ck = tmp_path / "shm", tmp_path / "ck"
    trainer, tier = _tier(one_rank, shm, ck)
    tier.snapshot(trainer.steps_done)
    tier._join()  # the job dies here: no finish, its memory stays
    assert tier.store.inventory()["own"]
    again_trainer, again = _tier(one_rank, shm, ck)  # a restart of the same job finds it
    assert again.root == tier.root and again.store.inventory()["own"]
    shutil.rmtree(ck)  # start over
    _, fresh = _tier(one_rank, shm, ck)
    assert fresh.run_id != tier.run_id and fresh.store.inventory() == {"own": {}, "held": {}}
    assert not os.path.exists(tier.root)  # superseded: cleared
    assert recovery.recover_memory(fresh, str(ck)) is None
    fresh.finish()


# --- a one-host plan --------------------------------------------------------------------------------


def test_one_host_plan_with_a_memory_tier_gives_settings_the_runtime_accepts():
    from partitioner.compiler import memory_tier_choice

    stage = SimpleNamespace(memory=SimpleNamespace(params_bytes=100, optimizer_bytes=200))
    assignment = SimpleNamespace(num_stages=2, pipeline_ranks=2, dp=1, rank_of=lambda s, r: s,
                                 device_of_stage_replica=[[0], [1]])
    cluster = SimpleNamespace(devices=[SimpleNamespace(node=0), SimpleNamespace(node=0)])
    for request in ("auto", "none", {"mode": "auto", "every": 2}):
        choice = memory_tier_choice(request, [stage, stage], cluster, assignment)
        assert choice["mode"] == "none" and choice["group_size"] is None
        plan = MemoryTierPlan(mode=choice["mode"], every=choice["every"], group_size=choice["group_size"])
        s = mt.settings_from(plan, RunOptions())
        assert s is not None and s.mode == "none" and s.group_size is None
    # plans compiled before this fix say group_size 1: still accepted (the user never passed it)
    assert mt.settings_from(MemoryTierPlan(mode="none", group_size=1), RunOptions()).group_size is None
    with pytest.raises(ValueError, match="--parity-group 1"):
        mt.settings_from(MemoryTierPlan(mode="none"), RunOptions(parity_group=1))
    # four hosts: parity groups keep their size
    cluster4 = SimpleNamespace(devices=[SimpleNamespace(node=n) for n in range(4)])
    a4 = SimpleNamespace(num_stages=1, pipeline_ranks=1, dp=4, rank_of=lambda s, r: r, device_of_stage_replica=[[0, 1, 2, 3]])
    choice = memory_tier_choice("parity", [stage], cluster4, a4)
    assert choice["mode"] == "parity" and choice["group_size"] >= 2


def test_one_host_tier_runs_on_its_own_memory(one_rank, world1, tmp_path):
    trainer, tier = _tier(one_rank, tmp_path / "shm", tmp_path / "ck", mode="none")
    assert tier.enabled and tier.red.mode == "none"
    tier.snapshot(trainer.steps_done)
    tier._join()
    fresh = trainers_at(one_rank, 0)[0]
    tier.trainer = fresh
    result = recovery.recover_memory(tier, str(tmp_path / "ck"))
    assert result is not None and result.step == trainer.steps_done and result.tier == "memory"
    for name, p in trainer.named_parameters().items():
        assert torch.equal(p, fresh.named_parameters()[name]), name
    tier.finish()


# --- a malformed slot fails before the ranks agree ------------------------------------------------


def test_slot_with_wrong_meta_fails_verification_and_recovery_moves_on(one_rank, world1, tmp_path, capsys):
    trainer, tier = _tier(one_rank, tmp_path / "shm", tmp_path / "ck", steps=3)
    slot, nbytes, _ = tier.store.snapshot(trainer)
    # the bytes hash as the record says, but their meta is step 3, the record says 5
    tier.store.commit_own(slot, 5, nbytes)
    result = recovery.recover_memory(tier, str(tmp_path / "ck"))
    assert result is None  # the disk tier recovers; no exception after agreeing, no loop
    out = "".join(capsys.readouterr())
    assert "failed verification" in out and "unusable" in out
    tier.finish()


@pytest.mark.parametrize("edit", [
    {"sha256": "not-hex"}, {"bytes": "12"}, {"step": -1}, {"step": True}, {"kind": "what"},
    {"kind": "parity", "chunk_bytes": 4, "members": [{"rank": 0}]},
])
def test_malformed_record_counts_as_absent(tmp_path, edit):
    store = mt.LocalStore(str(tmp_path), 0, mt.plan_redundancy((0,), mode="none"), "p", "r")
    slot = store.own[0]
    data = bytes(range(64))
    slot.writable(64).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    good = {"kind": "own", "rank": 0, "step": 2, "bytes": 64, "sha256": hashlib.sha256(data).hexdigest(),
            "plan_hash": "p", "run_id": "r"}
    slot.commit(good)
    assert store.inventory()["own"] == {2: 64}
    slot.commit({**good, **edit})
    assert slot.record() is None and store.inventory()["own"] == {}
