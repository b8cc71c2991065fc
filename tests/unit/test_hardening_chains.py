"""Hardening, third round (issue 29): long lossless chains. A chain of hundreds of deltas loads
(Note [chains resolve iteratively] in runtime/resilience/checkpoint/load.py), --checkpoint-full-every
is bounded so chains stay short, retention keeps the newest K checkpoints plus exactly the bases
they read, and a prune reads each manifest once (Note [retention under deltas] in
runtime/resilience/checkpoint/manifest.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from _checkpoint_helpers import set_plan_fields
from _runtime_folders import mlp_folder
from runtime.launch.run_options import FlagError, RunOptions
from runtime.program.spec import load_program
from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint import delta
from runtime.resilience.checkpoint import manifest as manifest_module
from runtime.resilience.checkpoint.persist import Checkpointer
from tests.drivers.checkpoint_drills import drill_writes, lossless_snaps, same_state, trainers_at

STEPS = 300


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mlp1"))
    mlp_folder(folder, splits=[[0, 1, 2, 3]], ranks=[([0], 0)])
    set_plan_fields(folder, model_fingerprint="mlp-8-32-32-32-4", plan_hash="plan-1")
    return folder


def _written(folder: str, ckpt_dir: str, steps: int, full_every: int | None):
    """Commit a lossless checkpoint after each of ``steps`` fake steps, encoded as the Checkpointer
    encodes them (a full one every ``full_every``; None: only the first, as an unbounded
    --checkpoint-full-every did), without pruning. Returns the program and the trainer."""
    program = load_program(folder)
    trainers = trainers_at(folder, 0)
    writes = drill_writes(trainers, program)
    base, base_step, chain = None, None, 0
    for t in trainers:
        t.fake_step(0)  # the optimizer state exists; after this only the parameters move (fast)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for t in trainers:
                t.steps_done = step
                for p in t.named_parameters().values():
                    p.add_(1e-3 * step)
        if base is not None and full_every is not None and chain + 1 >= full_every:
            base, base_step = None, None
        snaps = lossless_snaps(trainers, writes, base, base_step)
        infos = [ck.persist_shard(ckpt_dir, s) for s in snaps]
        ck.write_manifest(ckpt_dir, ck.manifest_for(step, infos, program, writes, base_step=base_step,
                                                    compression="lossless"))
        chain = 0 if base_step is None else chain + 1
        base, base_step = {t.rank: ck.snapshot(t, writes[t.rank]).tensors for t in trainers}, step
    return program, trainers[0]


@pytest.fixture(scope="module")
def long_chain(one, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("chain"))
    program, trainer = _written(one, ckpt, STEPS, None)
    return ckpt, program, trainer


def _counting_reads(monkeypatch) -> list[int]:
    """How many manifests the prune reads (the real read_manifest, counted)."""
    count = [0]
    real = manifest_module.read_manifest

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(manifest_module, "read_manifest", counted)
    return count


def test_a_chain_of_300_deltas_loads_bit_for_bit(long_chain):
    """It was a RecursionError (read_shard -> base -> read_shard ... ~4 frames a link): every
    checkpoint of the folder unreadable, recovery found none."""
    ckpt, program, trainer = long_chain
    assert ck.read_manifest(ckpt, STEPS)["base_step"] == STEPS - 1
    loaded = ck.load_for_rank(ckpt, STEPS, program, 0, ck.state_names(program, (0,)))
    assert same_state(loaded, ck.snapshot(trainer))


def test_a_prune_of_a_long_chain_keeps_every_base_and_reads_each_manifest_once(long_chain, monkeypatch):
    """Every folder is a base of the newest two, so none goes; the prune read each manifest once
    (it was once per candidate times the chain: ~90,000 reads, 46 s a commit at step 300)."""
    ckpt, *_ = long_chain
    reads = _counting_reads(monkeypatch)
    assert ck.prune(ckpt, keep=2, newest=STEPS) == []
    assert len(ck.list_step_dirs(ckpt)) == STEPS
    assert reads[0] <= STEPS, reads[0]


def test_retention_keeps_the_newest_k_and_exactly_their_bases_in_one_linear_prune(one, tmp_path, monkeypatch):
    """100 checkpoints, a full one every 8 (1, 9, ..., 97): keep 2 keeps 100 and 99 and the bases
    they read (98, and 97 the full one) and nothing else, reading each manifest once (it was
    ~1,500 reads: the needed bases again for each of the 96 candidates)."""
    ckpt = str(tmp_path / "ck")
    program, trainer = _written(one, ckpt, 100, 8)
    reads = _counting_reads(monkeypatch)
    removed = ck.prune(ckpt, keep=2, newest=100)
    assert reads[0] <= 100, reads[0]
    assert ck.list_step_dirs(ckpt) == [100, 99, 98, 97]
    assert removed == list(range(1, 97))
    loaded = ck.load_for_rank(ckpt, 100, program, 0, ck.state_names(program, (0,)))
    assert same_state(loaded, ck.snapshot(trainer))
    assert ck.prune(ckpt, keep=2, newest=100) == []  # what stays is exactly what is needed


@pytest.mark.parametrize("value", [65, 1000])
def test_checkpoint_full_every_is_bounded(value):
    with pytest.raises(FlagError) as err:
        RunOptions.parse(["--checkpoint-full-every", str(value)])
    msg = str(err.value)
    assert "\n" not in msg and f"--checkpoint-full-every {value}" in msg and "at most 64" in msg, msg
    assert RunOptions.parse(["--checkpoint-full-every", "64"]).checkpoint_full_every == 64
    with pytest.raises(ValueError, match=f"full_every {value}: give 1..64"):
        Checkpointer(None, "/nonexistent", full_every=value)  # refused before it touches anything


def test_the_bound_is_the_same_on_both_sides():
    from runtime.launch import run_options

    assert run_options.MAX_FULL_EVERY == delta.MAX_FULL_EVERY


def test_a_long_chain_left_on_disk_goes_once_a_full_checkpoint_is_kept(one, long_chain, tmp_path):
    """A folder holding a 300-long chain (written before the bound): a resumed writer starts with a
    full checkpoint, and once the newest K no longer read the old chain, one prune removes all of
    it, keep 2 leaving 2 folders."""
    ckpt = str(tmp_path / "ck")
    shutil.copytree(long_chain[0], ckpt)
    program = load_program(one)
    trainers = trainers_at(one, 1)
    writes = drill_writes(trainers, program)
    for step in (STEPS + 1, STEPS + 2):
        for t in trainers:
            t.steps_done = step
        base = None if step == STEPS + 1 else {t.rank: ck.snapshot(t, writes[t.rank]).tensors for t in trainers}
        ck.commit_local(ckpt, lossless_snaps(trainers, writes, base, None if base is None else STEPS + 1),
                        program, keep=2, writes=writes)
    assert ck.list_step_dirs(ckpt) == [STEPS + 2, STEPS + 1]
