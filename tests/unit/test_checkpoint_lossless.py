"""Lossless incremental checkpoints (Note [lossless deltas] in runtime/resilience/checkpoint/delta.py): the
codec is bit-exact for every dtype; a chain of deltas restores every rank bit for bit and
reshards; a chain whose base is missing or corrupt falls back like any corrupt checkpoint;
retention keeps the bases a kept delta needs; SIGKILLs during a delta's persist leave the
previous checkpoint or the new one."""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch

from _checkpoint_helpers import set_plan_fields
from _runtime_folders import mlp_folder, one_thread  # noqa: F401
from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint.delta import decode_tensor, encode_snapshot, encode_tensor
from runtime.resilience.checkpoint.load import read_shard
from tests.drivers.checkpoint_drills import (FakeTrainer, count_commit, drill_writes, killed_commit, lossless_snaps,
                                       newest_for_all, random_point, same_state, trainers_at)
from runtime.program.spec import load_program

FINGERPRINT = "mlp-8-32-32-32-4"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8])
def test_the_codec_is_bit_exact_with_and_without_a_base(dtype):
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(17, 5, generator=g) * 100).to(dtype)
    new = (base.float() + torch.randn(17, 5, generator=g) * 1e-3).to(dtype)
    for b in (None, base):
        got = decode_tensor(encode_tensor(new, b), dtype, new.shape, b)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8) if dtype != torch.uint8 else got,
                                                  new.view(torch.uint8) if dtype != torch.uint8 else new)
    empty = torch.zeros(0, 3, dtype=dtype)
    assert decode_tensor(encode_tensor(empty, None), dtype, (0, 3), None).shape == (0, 3)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mlp2x2"))
    mlp_folder(folder, splits=[[0, 1], [2, 3]], dp=2, ranks=[([0], 0), ([1], 0), ([0], 1), ([1], 1)])
    set_plan_fields(folder, model_fingerprint=FINGERPRINT, plan_hash="plan-2x2")
    return folder


def _chain(folder, ckpt_dir, steps, *, keep=8, full_every=8):
    """Commit a lossless checkpoint after each of ``steps`` fake steps, as the Checkpointer does;
    returns the whole snapshots of every step (what each load must equal) and the encoded ones."""
    program = load_program(folder)
    trainers = trainers_at(folder, 0)
    writes = drill_writes(trainers, program)
    base, base_step, chain, whole, encoded = None, None, 0, {}, {}
    for step in range(1, steps + 1):
        for t in trainers:
            t.fake_step(step)
        if base is not None and chain + 1 >= full_every:
            base, base_step = None, None
        snaps = lossless_snaps(trainers, writes, base, base_step)
        ck.commit_local(ckpt_dir, snaps, program, keep=keep, writes=writes)
        chain = 0 if base_step is None else chain + 1
        base = {t.rank: ck.snapshot(t, writes[t.rank]).tensors for t in trainers}
        base_step = step
        whole[step] = [ck.snapshot(t) for t in trainers]
        encoded[step] = snaps
    return program, trainers, writes, whole, encoded


def test_a_delta_chain_restores_every_rank_bit_for_bit_and_reshards(dp2, tmp_path):
    program, trainers, _, whole, encoded = _chain(dp2, str(tmp_path), 3)
    m = [ck.read_manifest(str(tmp_path), s) for s in (1, 2, 3)]
    assert [x.get("base_step") for x in m] == [None, 1, 2] and all(x["compression"] == "lossless" for x in m)
    for step in (1, 2, 3):
        loaded_step, loads = newest_for_all(str(tmp_path), program) if step == 3 else (step, {
            r: ck.load_for_rank(str(tmp_path), step, program, r, ck.state_names(program, program.layout.stages_of_rank[r]))
            for r in range(program.world_size)})
        assert loaded_step == step
        assert all(same_state(loads[r], whole[step][r]) for r in loads)
    # a delta is smaller than the full encoding of the same state
    assert sum(len(ck.serialize(s)) for s in encoded[3]) < sum(len(ck.serialize(s)) for s in encoded[1])
    # every rank resumes and trains on like the uninterrupted one
    for rank, trainer in enumerate(trainers):
        fresh = FakeTrainer(dp2, rank, program)
        ck.restore(fresh, ck.load_for_rank(str(tmp_path), 3, program, rank, ck.needed_names(fresh)))
        for name, p in fresh.named_parameters().items():
            assert torch.equal(p.detach(), trainer.named_parameters()[name].detach())
    one = str(tmp_path / "one")
    mlp_folder(one, splits=[[0, 1, 2, 3]], ranks=[([0], 0)])
    set_plan_fields(one, model_fingerprint=FINGERPRINT, plan_hash="plan-1")
    other = load_program(one)
    fresh = FakeTrainer(one, 0, other)
    ck.restore(fresh, ck.load_for_rank(str(tmp_path), 3, other, 0, ck.needed_names(fresh)))
    saved = {k: v for s in whole[3] for k, v in s.tensors.items()}
    for name, p in fresh.named_parameters().items():
        assert torch.equal(p.detach(), saved[f"param/{name}"])
        assert torch.equal(fresh.optimizer.state[p]["exp_avg"], saved[f"optim/{name}/exp_avg"])


def test_a_delta_is_read_against_its_own_writers_base_when_other_shards_hold_the_name(dp2, tmp_path):
    """Several shards can hold one name with different bytes: under tensor parallelism each rank of
    a tensor group writes its piece of a split parameter under the parameter's name. A writer's
    delta is against its own previous shard, so it must be read against that shard of the base
    step, not the lowest rank's holding the name (which failed every piece but rank 0's sha256 and
    made recovery fall back to the chain's full checkpoint). Here the replicas of each stage all
    write their stage (no one-writer split) and hold different values, as tensor pieces do."""
    program = load_program(dp2)
    trainers = trainers_at(dp2, 0)
    base = None
    for step in (1, 2):
        for t in trainers:
            t.fake_step(step)
            with torch.no_grad():
                for p in t.named_parameters().values():
                    p.add_(1e-3 * (t.rank + 1))
        snaps = lossless_snaps(trainers, None, base, None if base is None else 1)
        ck.commit_local(str(tmp_path), snaps, program, keep=8)
        base = {t.rank: ck.snapshot(t).tensors for t in trainers}
    assert ck.read_manifest(str(tmp_path), 2)["base_step"] == 1
    for t in trainers:
        needed = ck.state_names(program, program.layout.stages_of_rank[t.rank])
        assert same_state(ck.load_for_rank(str(tmp_path), 2, program, t.rank, needed), ck.snapshot(t)), t.rank


def test_a_delta_of_sharded_optimizer_state_is_read_against_its_base(dp2, tmp_path):
    """ZeRO-1 writes a rank's pieces of AdamW state as optim_shard/<name>/<key> (optim_tp_shard/...
    under tensor parallelism). The reader took such a key's name to be "<name>/<key>", found no
    shard of the base holding it, and refused every delta of a sharded run as corrupt: a resume
    fell back to the chain's full checkpoint (tests/e2e/test_combination_matrix.py, ZeRO with
    lossless checkpoints)."""
    program = load_program(dp2)
    trainers = trainers_at(dp2, 0)
    base = None
    for step in (1, 2):
        shares = []
        for t in trainers:
            t.fake_step(step)
            share = ck.snapshot(t)
            renamed = {(f"optim_{'tp_' if i % 2 else ''}shard/" + k.split("/", 1)[1]) if k.startswith("optim/")
                       else k: v for i, (k, v) in enumerate(share.tensors.items())}
            shares.append(dataclasses.replace(share, tensors=renamed))
        encoded = [encode_snapshot(s, None if base is None else base[s.rank], None if base is None else 1)
                   for s in shares]
        ck.commit_local(str(tmp_path), encoded, program, keep=8)
        base = {s.rank: s.tensors for s in shares}
    manifest = ck.read_manifest(str(tmp_path), 2)
    assert manifest["base_step"] == 1
    sharded = [k for k in base[0] if k.startswith(("optim_shard/", "optim_tp_shard/"))]
    assert sharded and all(encoded[0].meta["encoding"]["tensors"][k]["delta"] for k in sharded)
    for entry in manifest["shards"]:
        tensors, _ = read_shard(str(tmp_path), manifest, entry)
        want = base[entry["rank"]]
        assert sorted(tensors) == sorted(want) and all(torch.equal(tensors[k], want[k]) for k in want), entry["rank"]


@pytest.mark.parametrize("harm", ["missing", "corrupt"])
def test_a_chain_whose_base_is_missing_or_corrupt_falls_back(dp2, tmp_path, harm):
    program, *_ = _chain(dp2, str(tmp_path), 4, full_every=3)  # 1 full, 2 and 3 deltas, 4 full
    shutil.rmtree(tmp_path / ck.step_dirname(4))
    step_dir = tmp_path / ck.step_dirname(2)
    if harm == "missing":
        shutil.rmtree(step_dir)
    else:
        path = step_dir / ck.shard_filename(2)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 4
        path.write_bytes(bytes(data))
    warnings = []
    valid, newest = ck.find_valid(str(tmp_path), program, 0, ck.state_names(program, (0,)), warn=warnings.append)
    assert valid == [1] and newest.step == 1  # 3 needs 2; 2 is gone or corrupt
    assert any(ck.step_dirname(3) in w and ck.step_dirname(2) in w for w in warnings), warnings
    from partitioner.inspect import checkpoints as view

    statuses = {e["step"]: e["status"] for e in view.scan(str(tmp_path), program=program)["checkpoints"]}
    assert statuses[3] == "corrupt" and statuses[1] == "valid"


def test_retention_keeps_every_base_a_kept_delta_needs(dp2, tmp_path):
    _chain(dp2, str(tmp_path), 3, keep=1)
    assert ck.list_step_dirs(str(tmp_path)) == [3, 2, 1]  # keep 1, but 3 reads 2 reads 1
    _chain(dp2, str(tmp_path / "b"), 5, keep=1, full_every=3)  # 4 is full, 5 a delta on it
    assert ck.list_step_dirs(str(tmp_path / "b")) == [5, 4]


def test_sigkill_during_a_delta_persist_leaves_the_previous_or_the_new(dp2, tmp_path):
    program, trainers, writes, whole, _ = _chain(dp2, str(tmp_path / "base"), 2, keep=2)
    for t in trainers:
        t.fake_step(3)
    # the delta's base: each rank's committed share of step 2, as the Checkpointer keeps it
    _, loads_2 = newest_for_all(str(tmp_path / "base"), program)
    snaps = lossless_snaps(trainers, writes, {r: _share(loads_of(loads_2[r]), writes[r]) for r in loads_2}, 2)
    assert all(s.meta["encoding"]["base_step"] == 2 for s in snaps)
    assert any(e["delta"] for s in snaps for e in s.meta["encoding"]["tensors"].values())
    new = [ck.snapshot(t) for t in trainers]
    total_bytes, total_ops = count_commit(str(tmp_path / "base"), snaps, program, keep=2, writes=writes)
    shard_bytes = sum(len(ck.serialize(s)) for s in snaps)
    rng = random.Random(0)
    for trial in range(12):
        work = str(tmp_path / "trial")
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(tmp_path / "base", work)
        point = random_point(rng, trial, total_bytes, total_ops, shard_bytes)
        assert killed_commit(work, snaps, program, keep=2, writes=writes, **point)
        step, loads = newest_for_all(work, program)
        assert step in (2, 3), (trial, point, step)
        want = whole[2] if step == 2 else new
        assert all(same_state(loads[r], want[r]) for r in loads), (trial, point)


def loads_of(loaded) -> dict:
    """A LoadedCheckpoint's tensors under their shard keys."""
    out = {f"param/{n}": t for n, t in loaded.params.items()}
    for n, st in loaded.optim.items():
        out.update({f"optim/{n}/{k}": v for k, v in st.items()})
    out.update({f"buffer/{n}": t for n, t in loaded.buffers.items()})
    return out


def _share(tensors: dict, names) -> dict:
    return {k: v for k, v in tensors.items() if k.split("/", 1)[1].rsplit("/", 1)[0] in names or
            k.split("/", 1)[1] in names}
