"""Each byte of replicated state is written once (Note [one writer per byte] in
runtime/resilience/checkpoint/writers.py): the assignment (one writer per name per data-parallel group,
spread evenly), and a 2-stage x dp 3 checkpoint written that way that resumes on every rank,
reshards to other partitions, is what `inspect --checkpoints` reads, and falls back when a shard
another rank relies on is corrupt."""

from __future__ import annotations

import os

import pytest
import torch

from _checkpoint_helpers import assert_trains_identically, set_plan_fields
from _runtime_folders import mlp_folder, one_thread  # noqa: F401
from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint.writers import assign_writers, balance, write_cost, writes_of_ranks
from tests.drivers.checkpoint_drills import FakeTrainer, trainers_at
from runtime.program.spec import load_program

FINGERPRINT = "mlp-8-32-32-32-4"


def test_assign_writers_gives_each_name_one_holder_and_spreads_the_bytes():
    sizes = {f"w{i}": (i * 37) % 11 * 1000 + 10 for i in range(40)}
    holders = {n: (3, 5, 7) for n in sizes}
    holders["solo"] = (5,)
    sizes["solo"] = 50_000  # held by one rank only (sharded state): that rank writes it
    out = assign_writers(holders, sizes)
    assert set(out) == set(holders) and all(out[n] in holders[n] for n in out)
    assert out["solo"] == 5
    load = {r: sum(sizes[n] for n, w in out.items() if w == r) for r in (3, 5, 7)}
    # LPT: the most loaded writer is at most the mean plus the largest name it took
    assert max(load.values()) <= sum(load.values()) / 3 + max(sizes.values())
    assert assign_writers(holders, sizes) == out  # every rank computes the same


@pytest.fixture(scope="module")
def dp3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mlp2x3"))
    mlp_folder(folder, splits=[[0, 1], [2, 3]], dp=3, global_batch=24,
               ranks=[([0], 0), ([1], 0), ([0], 1), ([1], 1), ([0], 2), ([1], 2)])
    set_plan_fields(folder, model_fingerprint=FINGERPRINT, plan_hash="plan-2x3")
    return folder


def _write(folder, ckpt_dir, steps=2):
    program = load_program(folder)
    trainers = trainers_at(folder, steps)
    nbytes = {}
    for t in trainers:
        nbytes.update(write_cost(t))
    writes = writes_of_ranks(program, nbytes)
    snaps = [ck.snapshot(t, writes[t.rank]) for t in trainers]
    manifest = ck.commit_local(ckpt_dir, snaps, program, writes=writes)
    return program, trainers, writes, nbytes, manifest


def test_each_name_is_written_by_one_replica_and_every_rank_resumes(dp3, tmp_path):
    program, trainers, writes, nbytes, manifest = _write(dp3, str(tmp_path))
    assert manifest["format"] == ck.FORMAT
    layout = program.layout
    for group in layout.dp_groups:
        names = set(ck.state_names(program, layout.stages_of_rank[group[0]]))
        per_replica = [writes[r] for r in group]
        assert set().union(*per_replica) == names  # everything written ...
        assert sum(len(w) for w in per_replica) == len(names)  # ... once
        assert all(per_replica)  # and every replica writes a share
    stats = balance(writes, nbytes)
    for group in layout.dp_groups:  # a name is not split: the spread is within one name of even
        loads = [stats["bytes_per_rank"][r] for r in group]
        biggest = max(nbytes[n] for r in group for n in writes[r])
        assert max(loads) <= sum(loads) / len(loads) + biggest, stats
    # the manifest says what each shard holds, and the shards hold exactly that
    step_dir = tmp_path / ck.step_dirname(2)
    for entry in manifest["shards"]:
        assert set(entry["params"]) | set(entry["buffers"]) == writes[entry["rank"]]
        tensors, meta = ck.parse_shard(bytearray((step_dir / entry["file"]).read_bytes()))
        held = {k.split("/", 1)[1] for k in tensors if k.startswith("param/")}
        assert held == set(entry["params"]) and "rng/torch_cpu" in tensors
    # one copy of the model state instead of one per replica (RNG states and meta stay per rank)
    def state_bytes(tensors):
        return sum(t.numel() * t.element_size() for k, t in tensors.items() if not k.startswith("rng/"))
    full = sum(state_bytes(ck.snapshot(t).tensors) for t in trainers)
    once = sum(state_bytes(ck.parse_shard(bytearray((step_dir / e["file"]).read_bytes()))[0])
               for e in manifest["shards"])
    assert once * 3 == full, (once, full)
    for rank, trainer in enumerate(trainers):  # the same plan resumes bit for bit on every rank
        fresh = FakeTrainer(dp3, rank, program)
        loaded = ck.load_for_rank(str(tmp_path), 2, program, rank, ck.needed_names(fresh))
        assert loaded.rng_tensors is not None  # its own shard still brings its RNG states
        ck.restore(fresh, loaded)
        assert_trains_identically(trainer, fresh, 7)


def test_a_write_once_checkpoint_reshards_and_inspects(dp3, tmp_path):
    from partitioner.inspect import checkpoints as view

    _, trainers, _, _, _ = _write(dp3, str(tmp_path / "ck"))
    saved = {k: v for t in trainers for k, v in ck.snapshot(t).tensors.items() if k.startswith(("param/", "optim/"))}
    for splits, ranks in (([[0, 1, 2, 3]], [([0], 0)]), ([[0], [1, 2], [3]], [([0], 0), ([1], 0), ([2], 0)])):
        folder = str(tmp_path / f"p{len(splits)}")
        mlp_folder(folder, splits=splits, ranks=ranks)
        set_plan_fields(folder, model_fingerprint=FINGERPRINT, plan_hash=f"plan-{len(splits)}")
        other = load_program(folder)
        for rank in range(other.world_size):
            fresh = FakeTrainer(folder, rank, other)
            ck.restore(fresh, ck.load_for_rank(str(tmp_path / "ck"), 2, other, rank, ck.needed_names(fresh)))
            for name, p in fresh.named_parameters().items():
                assert torch.equal(p.detach(), saved[f"param/{name}"])
                assert torch.equal(fresh.optimizer.state[p]["exp_avg_sq"], saved[f"optim/{name}/exp_avg_sq"])
    listing = view.scan(str(tmp_path / "ck"), program=load_program(dp3))
    assert [e["status"] for e in listing["checkpoints"]] == ["valid"] and listing["resume"]["step"] == 2


def test_a_corrupt_shard_that_other_ranks_read_falls_back_for_them(dp3, tmp_path):
    program, _, writes, _, _ = _write(dp3, str(tmp_path), steps=1)
    _write(dp3, str(tmp_path), steps=2)
    # rank 2 writes some of stage 0's names: rank 0 reads them from rank 2's shard
    path = tmp_path / ck.step_dirname(2) / ck.shard_filename(2)
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    fresh = FakeTrainer(dp3, 0, program)
    warnings = []
    valid, newest = ck.find_valid(str(tmp_path), program, 0, ck.needed_names(fresh), warn=warnings.append)
    assert writes[2] and valid == [1] and newest.step == 1
    assert any(ck.shard_filename(2) in w and "sha256" in w for w in warnings), warnings


def test_shard_bytes_are_written_straight_from_the_snapshot_and_hashed_while_written(dp3, tmp_path):
    import hashlib

    trainer = trainers_at(dp3, 1)[0]
    snap = ck.snapshot(trainer)
    info = ck.persist_shard(str(tmp_path), snap)
    data = (tmp_path / ck.step_dirname(1) / info.file).read_bytes()
    assert data == ck.serialize(snap) and len(data) == info.bytes
    assert hashlib.sha256(data).hexdigest() == info.sha256
    assert not [n for n in os.listdir(tmp_path / ck.step_dirname(1)) if n.endswith(".tmp")]
