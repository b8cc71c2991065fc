"""The memory tier in one process (no process group): snapshot into shared memory and restore bit
for bit, whole-or-absent slots, XOR parity encode and reconstruction, bit flips in a shard or in
the parity detected, the recovery choice falling through the tiers, the redundancy groups the plan
picks and what they cost."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from safetensors.torch import load_file

from _checkpoint_helpers import assert_trains_identically, two_stage_mlp_folder
from _runtime_folders import one_thread  # noqa: F401
from runtime.resilience import checkpoint as ck
from runtime.resilience import memtier as mt
from runtime.resilience import recovery
from tests.drivers.checkpoint_drills import FakeTrainer, trainers_at
from runtime.program.spec import load_program
from runtime.program.parts import MemoryTierPlan
from runtime.launch.run_options import RunOptions


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    return two_stage_mlp_folder(str(tmp_path_factory.mktemp("mlp2_mem")),
                                model_fingerprint="mlp-mem", plan_hash="plan-mem")


def _store(root, rank, hosts=(0, 1), mode="copy"):
    red = mt.plan_redundancy(hosts, mode=mode)
    return mt.LocalStore(str(root), rank, red, "plan-mem")


def _snap_commit(store, trainer):
    slot, nbytes, stall = store.snapshot(trainer)
    sha = store.commit_own(slot, trainer.steps_done, nbytes)
    return slot, nbytes, sha


def test_snapshot_round_trip_is_bit_exact_and_a_valid_shard(two_rank, tmp_path):
    program = load_program(two_rank)
    trainer = trainers_at(two_rank, 3)[1]
    random.seed(5)
    torch.manual_seed(6)
    store = _store(tmp_path, 1)
    slot, nbytes, sha = _snap_commit(store, trainer)
    want_py, want_torch = random.random(), torch.rand(2)
    # the slot is a safetensors shard in the disk format, with the disk tier's tensors and meta
    disk = ck.snapshot(trainer)
    on_shm = load_file(slot.data_path)
    assert sorted(on_shm) == sorted(disk.tensors)
    for name, value in on_shm.items():
        if not name.startswith("rng/"):
            assert torch.equal(value, disk.tensors[name]), name
    rec = slot.record()
    assert rec["step"] == 3 and rec["bytes"] == nbytes and rec["sha256"] == sha
    data = slot.verify(rec)
    assert data is not None and hashlib.sha256(data).hexdigest() == sha
    loaded = ck.loaded_from_bytes(data, step=3, program=program, rank=1, needed=list(trainer.named_parameters()),
                                  where="test")
    fresh = FakeTrainer(two_rank, 1, program)
    random.seed(0)
    ck.restore(fresh, loaded)
    assert fresh.steps_done == 3 and fresh.lr_scheduler.last_epoch == trainer.lr_scheduler.last_epoch
    assert random.random() == want_py and torch.equal(torch.rand(2), want_torch)  # RNG states too
    assert_trains_identically(trainer, fresh, 42)


def test_slots_alternate_and_are_whole_or_absent(two_rank, tmp_path):
    trainer = trainers_at(two_rank, 1)[0]
    store = _store(tmp_path, 0)
    _snap_commit(store, trainer)               # step 1
    trainer.fake_step(1)
    _snap_commit(store, trainer)               # step 2, the other slot
    assert store.inventory()["own"].keys() == {1, 2}
    trainer.fake_step(2)
    # step 3 is copied over the older slot (step 1) but never committed: a crash mid-snapshot
    slot, nbytes, _ = store.snapshot(trainer)
    assert slot.record() is None
    assert store.inventory()["own"].keys() == {2}  # step 1 is gone, step 3 absent, step 2 whole
    rec = mt.find_slot(store.own, 2)[1]
    assert mt.find_slot(store.own, 2)[0].verify(rec) is not None
    # committing makes it present; the next snapshot goes over step 2, never over step 3
    store.commit_own(slot, 3, nbytes)
    assert store.inventory()["own"].keys() == {2, 3}
    assert mt.pick_slot(store.own).record()["step"] == 2
    store.invalidate_newer(2)
    assert store.inventory()["own"].keys() == {2}


def test_bit_flip_in_a_memory_shard_is_detected(two_rank, tmp_path):
    trainer = trainers_at(two_rank, 2)[0]
    store = _store(tmp_path, 0)
    slot, nbytes, _ = _snap_commit(store, trainer)
    rec = slot.record()
    with open(slot.data_path, "r+b") as fh:
        fh.seek(nbytes - 7)
        byte = fh.read(1)
        fh.seek(nbytes - 7)
        fh.write(bytes([byte[0] ^ 0x10]))
    assert slot.verify(rec) is None
    # the recovery choice then takes the next tier for that rank: the peer copy
    red = mt.plan_redundancy((0, 1), mode="copy")
    own, held = [{2: nbytes}, {2: nbytes}], [{2: nbytes}, {2: nbytes}]
    assert recovery.choose_step(own, held, red, set()) == (2, {0: "memory", 1: "memory"})
    assert recovery.choose_step(own, held, red, {(0, 2, "memory")}) == (2, {0: "peer", 1: "memory"})
    assert recovery.choose_step(own, held, red, {(0, 2, "memory"), (0, 2, "peer")}) is None  # -> disk


def _shards(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [bytes(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).numpy()) for n in sizes]


@pytest.mark.parametrize("sizes", [[1000, 1000, 1000, 1000], [4096, 777, 2500], [64, 64]])
def test_xor_parity_rebuilds_any_one_lost_member(sizes):
    shards = _shards(sizes)
    g = len(shards)
    c, stripes = mt.encode_parity(shards)
    assert c == mt.chunk_bytes(sizes) and all(len(s) == c for s in stripes)
    assert c * (g - 1) >= max(sizes) and c < max(sizes) / (g - 1) + 8  # 1/(g-1) of a shard per member
    for lost in range(g):
        pieces = [mt.survivor_piece(torch.frombuffer(bytearray(shards[i]), dtype=torch.uint8),
                                    torch.frombuffer(bytearray(stripes[i]), dtype=torch.uint8), i, lost, g, c)
                  for i in range(g) if i != lost]
        assert mt.reconstruct(pieces, sizes[lost]) == shards[lost]


def test_bit_flip_in_parity_gives_a_wrong_rebuild_that_the_checksum_catches():
    shards = _shards([3000, 3000, 3000], seed=1)
    c, stripes = mt.encode_parity(shards)
    flipped = bytearray(stripes[2])
    flipped[5] ^= 1
    pieces = [mt.survivor_piece(torch.frombuffer(bytearray(shards[i]), dtype=torch.uint8),
                                torch.frombuffer(bytearray(flipped if i == 2 else stripes[i]), dtype=torch.uint8),
                                i, 0, 3, c) for i in (1, 2)]
    rebuilt = mt.reconstruct(pieces, 3000)
    assert rebuilt != shards[0]
    assert hashlib.sha256(rebuilt).hexdigest() != hashlib.sha256(shards[0]).hexdigest()


def test_parity_slot_with_a_flipped_bit_fails_its_record(tmp_path):
    slot = mt.Slot(str(tmp_path / "parity_rank_0"), "slot_0")
    data = _shards([256])[0]
    slot.writable(256).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    slot.commit({"kind": "parity", "step": 4, "bytes": 256, "chunk_bytes": 256,
                 "sha256": hashlib.sha256(data).hexdigest()})
    assert slot.verify(slot.record()) is not None
    slot.tensor[100] ^= 4
    assert slot.verify(slot.record()) is None


def test_choice_falls_through_memory_peer_parity_then_disk():
    red = mt.plan_redundancy((0, 1, 2, 3), mode="parity", group_size=4)
    assert red.groups == ((0, 1, 2, 3),)
    both = {5: 100, 6: 100}
    own = [dict(both) for _ in range(4)]
    held = [{5: 40, 6: 40} for _ in range(4)]
    assert recovery.choose_step(own, held, red, set())[0] == 6
    own[2], held[2] = {}, {}                         # host 2 lost: parity rebuilds rank 2
    assert recovery.choose_step(own, held, red, set()) == (6, {0: "memory", 1: "memory", 2: "parity", 3: "memory"})
    held[0] = {5: 40}                                # rank 0's parity of step 6 never arrived: step 5
    assert recovery.choose_step(own, held, red, set())[0] == 5
    own[1], held[1] = {}, {}                         # two hosts of one group lost: disk
    assert recovery.choose_step(own, held, red, set()) is None
    assert "lost 2 members" in recovery.why_not(own, held, red, 6)
    # memory older than the newest disk checkpoint is not taken
    assert recovery.choose_step([dict(both)] * 4, held, red, set(), not_before=7) is None


def test_groups_follow_hosts_and_stages_and_cost_what_they_say():
    # 2 x 2 plan, ranks 0,1 on host 0 and 2,3 on host 1; stages (0,), (1,), (0,), (1,)
    keys = [((0,), 0), ((1,), 0), ((0,), 1), ((1,), 1)]
    red = mt.plan_redundancy((0, 0, 1, 1), keys)
    assert red.mode == "copy" and red.groups == ((0, 2), (1, 3))  # same stage: equal shards
    assert red.holder_of(0) == 2 and red.holder_of(2) == 0
    cost = mt.memory_cost(red, [100, 300, 100, 300])
    assert cost["redundancy_over_shard"] == [1.0] * 4 and cost["per_host_bytes"] == [2 * 800, 2 * 800]
    par = mt.plan_redundancy((0, 1, 2, 3, 4), mode="auto")
    assert par.mode == "parity" and par.groups == ((0, 1, 2, 3, 4),)  # a lone 5th host joins the group
    assert mt.plan_redundancy((0, 1, 2, 3, 4, 5, 6, 7), group_size=4).groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    cost = mt.memory_cost(mt.plan_redundancy((0, 1, 2, 3), group_size=4), [3000] * 4)
    assert cost["redundancy_over_shard"] == [pytest.approx(1 / 3, abs=0.01)] * 4
    assert mt.plan_redundancy((0, 0, 0)).mode == "none"
    with pytest.raises(ValueError, match="one host number"):
        mt.parse_hosts("0,1", 4)


def test_settings_from_program_and_flags():
    assert mt.settings_from(None, RunOptions()) is None
    s = mt.settings_from(MemoryTierPlan(mode="parity", group_size=3, every=2), RunOptions())
    assert (s.mode, s.group_size, s.every) == ("parity", 3, 2)
    assert mt.settings_from(MemoryTierPlan(mode="copy"), RunOptions(memory_tier="off")) is None
    s = mt.settings_from(None, RunOptions.parse(["--memory-tier", "auto", "--fail-host", "1:3", "--fail-host", "2:5:1",
                                                 "--hosts", "0,0,1,1"]))
    assert s.fail_hosts == ((1, 3, 0), (2, 5, 1)) and s.hosts == "0,0,1,1"
    with pytest.raises(ValueError, match="HOST:STEP"):  # refused when the options are read, before the tier
        RunOptions.parse(["--memory-tier", "copy", "--fail-host", "x"])


def test_shards_parse_without_copy_or_pickle_and_refuse_bad_offsets(two_rank, tmp_path):
    from safetensors.torch import save

    trainer = trainers_at(two_rank, 1)[0]
    snap = ck.snapshot(trainer)
    data = bytearray(ck.serialize(snap))  # a shard as the disk tier writes it (st_save's layout)
    tensors, meta = ck.parse_shard(data)
    assert meta["step"] == 1 and sorted(tensors) == sorted(snap.tensors)
    for name, value in snap.tensors.items():
        assert torch.equal(tensors[name], value), name
    odd = bytearray(save({"a": torch.arange(3, dtype=torch.uint8), "b": torch.ones(2)}, metadata={"meta": "{}"}))
    got, _ = ck.parse_shard(odd)
    assert torch.equal(got["b"], torch.ones(2)) and torch.equal(got["a"], torch.arange(3, dtype=torch.uint8))
    with pytest.raises(ValueError):
        ck.parse_shard(data[:-4])  # truncated
