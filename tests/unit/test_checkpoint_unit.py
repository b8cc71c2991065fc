"""Checkpoint format, persist protocol and recovery choice, in one process (no process group):
round trip, crash consistency under SIGKILL at seeded random points, bit flips, resharded loads,
refusal of another model's checkpoint, unwritable directories, the Young/Daly interval."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch

from _checkpoint_helpers import assert_trains_identically, set_plan_fields, two_stage_mlp_folder
from _runtime_folders import mlp_folder, one_thread  # noqa: F401
from runtime.resilience import checkpoint as ck
from runtime.resilience import faults
from tests.drivers.checkpoint_drills import FakeTrainer, count_commit, killed_commit, newest_for_all, random_point, same_state, trainers_at
from runtime.errors import PlanMismatchError
from runtime.program.spec import load_program
from runtime.resilience.recovery import agree_newest
from runtime.execute.train import keep_metrics_before

FINGERPRINT = "mlp-8-32-32-32-4"


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    """A 2-stage MLP program (2 ranks) with a fingerprint."""
    return two_stage_mlp_folder(str(tmp_path_factory.mktemp("mlp2")),
                                model_fingerprint=FINGERPRINT, plan_hash="plan-two-stages")


def _snaps(trainers):
    return [ck.snapshot(t) for t in trainers]


def _advance(trainers, step_seed):
    for t in trainers:
        t.fake_step(step_seed)


def test_round_trip_restores_everything_bit_for_bit(two_rank, tmp_path):
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 3)
    random.seed(7)
    torch.manual_seed(11)
    manifest = ck.commit_local(str(tmp_path), _snaps(trainers), program)
    assert manifest["step"] == 3 and manifest["model_fingerprint"] == FINGERPRINT
    assert [s["rank"] for s in manifest["shards"]] == [0, 1]
    want_py, want_torch = random.random(), torch.rand(3)
    random.seed(0)
    torch.manual_seed(0)
    for rank, trainer in enumerate(trainers):
        fresh = FakeTrainer(two_rank, rank, program)
        needed = list(fresh.named_parameters())
        loaded = ck.load_for_rank(str(tmp_path), 3, program, rank, needed)
        ck.restore(fresh, loaded)
        assert fresh.steps_done == 3
        assert fresh.lr_scheduler.last_epoch == trainer.lr_scheduler.last_epoch
        assert fresh.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"]
        assert_trains_identically(trainer, fresh, 99)
    # the RNG states came back too (the last restore is rank 1's, captured at the same moment)
    assert random.random() == want_py and torch.equal(torch.rand(3), want_torch)


def test_loading_never_unpickles(two_rank, tmp_path):
    program = load_program(two_rank)
    ck.commit_local(str(tmp_path), _snaps(trainers_at(two_rank, 1)), program)
    import pickle

    real = pickle.loads
    pickle.loads = lambda *a, **k: (_ for _ in ()).throw(AssertionError("unpickled"))
    try:
        step, loads = newest_for_all(str(tmp_path), program)
    finally:
        pickle.loads = real
    assert step == 1 and sorted(loads) == [0, 1]


def test_crash_consistency_sigkill_at_60_random_points(two_rank, tmp_path):
    """The persist of checkpoint 3 (shards of both ranks, manifest, pruning with keep=2) is
    SIGKILLed at 60 seeded random points (a byte of a shard, a byte of the manifest, or an operation); afterwards recovery
    yields checkpoint 2 or checkpoint 3, exactly as snapshotted, never a mix; and a new persist
    over the debris commits."""
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 1)
    base = str(tmp_path / "base")
    ck.commit_local(base, _snaps(trainers), program, keep=2)
    _advance(trainers, 1)
    old = _snaps(trainers)
    ck.commit_local(base, old, program, keep=2)
    _advance(trainers, 2)
    new = _snaps(trainers)
    total_bytes, total_ops = count_commit(base, new, program, keep=2)
    shard_bytes = sum(len(ck.serialize(s)) for s in new)
    rng = random.Random(20240611)
    outcomes = {2: 0, 3: 0}
    for trial in range(60):
        work = str(tmp_path / f"t{trial}")
        shutil.copytree(base, work)
        point = random_point(rng, trial, total_bytes, total_ops, shard_bytes)
        assert killed_commit(work, new, program, keep=2, **point), point
        step, loads = newest_for_all(work, program)
        assert step in (2, 3), (point, step)
        outcomes[step] += 1
        want = old if step == 2 else new
        for rank, loaded in loads.items():
            assert same_state(loaded, want[rank]), (point, rank)
        ck.commit_local(work, new, program, keep=2)  # the retry after the restart
        step, loads = newest_for_all(work, program)
        assert step == 3 and all(same_state(loads[r], new[r]) for r in loads)
        shutil.rmtree(work)
    assert outcomes[2] > 10 and outcomes[3] > 0, outcomes  # both sides of the commit were hit


def test_one_flipped_bit_anywhere_falls_back_to_the_previous(two_rank, tmp_path, capsys):
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 1)
    base = str(tmp_path / "base")
    prev = _snaps(trainers)
    ck.commit_local(base, prev, program)
    _advance(trainers, 1)
    ck.commit_local(base, _snaps(trainers), program)
    step_dir = os.path.join(base, ck.step_dirname(2))
    rng = random.Random(5)
    for name in sorted(os.listdir(step_dir)):
        for trial in range(3):
            work = str(tmp_path / f"{name}-{trial}")
            shutil.copytree(base, work)
            path = os.path.join(work, ck.step_dirname(2), name)
            data = bytearray(open(path, "rb").read())
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
            with open(path, "wb") as f:
                f.write(data)
            warnings = []
            views = []
            for rank in range(2):
                needed = list(program.stages[rank].params)
                valid, _ = ck.find_valid(work, program, rank, needed, warn=warnings.append)
                views.append(valid)
            assert agree_newest(views) == 1, (name, bit, views)
            assert any(ck.step_dirname(2) in w and (name in w or "manifest" in w) for w in warnings), warnings
            _, loads = newest_for_all(work, program)
            assert all(same_state(loads[r], prev[r]) for r in loads)
            shutil.rmtree(work)


def test_agreement_takes_the_newest_step_valid_on_every_rank():
    assert agree_newest([[6, 4, 2], [4, 2], [6, 4]]) == 4
    assert agree_newest([[6], [4]]) is None
    assert agree_newest([[], []]) is None


def test_resharded_load_reads_each_parameter_from_whichever_shard_holds_it(two_rank, tmp_path):
    """Saved by 2 ranks (2 stages); loaded by a 3-stage plan and by a 1-rank plan."""
    program = load_program(two_rank)
    snaps = _snaps(trainers_at(two_rank, 2))
    ck.commit_local(str(tmp_path / "ck"), snaps, program)
    saved = {k: v for s in snaps for k, v in s.tensors.items() if k.startswith(("param/", "optim/"))}
    for splits, ranks in (([[0], [1], [2, 3]], [([0], 0), ([1], 0), ([2], 0)]),
                          ([[0, 1, 2, 3]], [([0], 0)])):
        folder = str(tmp_path / f"p{len(splits)}")
        mlp_folder(folder, splits=splits, ranks=ranks)
        set_plan_fields(folder, model_fingerprint=FINGERPRINT, plan_hash=f"plan-{len(splits)}")
        other = load_program(folder)
        for rank in range(other.world_size):
            fresh = FakeTrainer(folder, rank, other)
            loaded = ck.load_for_rank(str(tmp_path / "ck"), 2, other, rank, list(fresh.named_parameters()))
            assert loaded.rng_tensors is None  # another plan: the RNG states stay the new run's
            ck.restore(fresh, loaded)
            for name, p in fresh.named_parameters().items():
                assert torch.equal(p.detach(), saved[f"param/{name}"])
                st = fresh.optimizer.state[p]
                assert torch.equal(st["exp_avg"], saved[f"optim/{name}/exp_avg"])
                assert float(st["step"]) == 2.0
            assert fresh.lr_scheduler.last_epoch == 2


def test_checkpoint_of_another_model_is_refused_naming_both(two_rank, tmp_path):
    program = load_program(two_rank)
    ck.commit_local(str(tmp_path), _snaps(trainers_at(two_rank, 1)), program)
    other = dataclasses.replace(program, model_fingerprint="gpt-0123456789", workload="gpt(layers=2)")
    with pytest.raises(PlanMismatchError) as err:
        ck.find_valid(str(tmp_path), other, 0, list(program.stages[0].params))
    message = str(err.value)
    assert FINGERPRINT in message and "gpt-0123456789" in message and "gpt(layers=2)" in message


def test_unwritable_checkpoint_dir_is_an_error_before_training(two_rank, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    bad = str(blocker / "checkpoints")
    with pytest.raises(ValueError, match="not writable"):
        ck.check_writable(bad)
    # the runtime refuses before it creates any process group or trains
    import runtime.launch.rank

    saved_env = dict(os.environ)
    one = str(tmp_path / "one")
    mlp_folder(one, splits=[[0, 1, 2, 3]], ranks=[([0], 0)])
    try:
        with pytest.raises(ValueError, match="not writable"):
            runtime.launch.rank.main(one, argv=["--checkpoint-dir", bad], exit_on_error=False)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert not os.path.exists(os.path.join(one, "run"))


def test_prune_keeps_the_newest_n(two_rank, tmp_path):
    program = load_program(two_rank)
    trainers = trainers_at(two_rank, 0)
    for step in range(1, 6):
        _advance(trainers, step)
        ck.commit_local(str(tmp_path), _snaps(trainers), program, keep=3)
    assert ck.list_step_dirs(str(tmp_path)) == [5, 4, 3]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_young_daly_interval():
    every, info = ck.young_daly_interval(stall_s=0.01, mtbf_s=6 * 3600, step_time_s=0.5)
    tau = (2 * 0.01 * 6 * 3600) ** 0.5  # 20.8 s
    assert every == round(tau / 0.5) == 42
    assert info["expected_rework_s"] == pytest.approx(every * 0.5 / 2)
    assert info["expected_lost_fraction"] == pytest.approx(0.01 / (every * 0.5) + every * 0.5 / (2 * 6 * 3600))
    assert ck.young_daly_interval(1e-6, 60, 10.0)[0] == 1
    assert ck.parse_duration_s("6h") == 21600 and ck.parse_duration_s("90m") == 5400
    with pytest.raises(ValueError, match="duration"):
        ck.parse_duration_s("soon")


def test_fault_flags_parse_and_fire_only_in_the_first_attempt(monkeypatch):
    assert faults.parse_fail_at("1:5") == faults.Fault(1, 5, "kill")
    assert faults.parse_fail_at("0:2:hang") == faults.Fault(0, 2, "hang")
    assert faults.parse_fail_persist("0:4:100") == faults.PersistFault(0, 4, 100)
    for bad in ("1", "a:b", "1:2:explode"):
        with pytest.raises(ValueError, match="--fail-at"):
            faults.parse_fail_at(bad)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert faults.step_hook([faults.Fault(1, 3)], 1) is not None
    assert faults.step_hook([faults.Fault(1, 3)], 0) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.step_hook([faults.Fault(1, 3)], 1) is None


def test_resumed_metrics_keep_only_the_steps_before_the_resume(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        for step in range(5):
            f.write(json.dumps({"step": step, "loss": float(step)}) + "\n")
        f.write('{"step": 5, "lo')  # cut short by the kill
    keep_metrics_before(path, 3)
    assert [json.loads(line)["step"] for line in open(path)] == [0, 1, 2]
