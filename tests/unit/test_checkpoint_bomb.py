"""A zstd bomb in a lossless checkpoint (issue 42 finding 6; Note [bounded decompression] in
runtime/resilience/checkpoint/delta.py): a shard whose meta and frame agree on 128 MiB of zeros
in 4 KiB on disk, its sha256 true, in a plan whose shards hold at most ~64 MiB. A resume and
`inspect --checkpoints` refuse it, in one line, before decompressing it (tracemalloc sees what
zstd's output and the planes would allocate); inspect without a plan beside the folder lists
it "unchecked" beyond what it decompresses unbounded."""

from __future__ import annotations

import hashlib
import json
import shutil
import tracemalloc

import pytest
import torch

from _checkpoint_helpers import set_plan_fields, two_stage_mlp_folder
from partitioner.cli import main
from partitioner.inspect import checkpoints as listing
from runtime.program.spec import load_program
from runtime.resilience import checkpoint as ck
from tests.drivers.checkpoint_drills import drill_writes, lossless_snaps, trainers_at

BOMB_BYTES = 128 << 20
STAGE_MEMORY = {"params_bytes": 4 << 10, "optimizer_bytes": 8 << 10, "buffers_bytes": 0}


@pytest.fixture(scope="module")
def bombed(tmp_path_factory):
    """A program folder whose plan states its stage memory (a compile's does), with lossless
    checkpoints at step 1 (sound) and step 2 (rank 0's first parameter a bomb)."""
    zstandard = pytest.importorskip("zstandard")
    folder = str(tmp_path_factory.mktemp("bomb") / "prog")
    two_stage_mlp_folder(folder, model_fingerprint="mlp-8-32-32-32-4", plan_hash="plan-bomb")
    set_plan_fields(folder, stages=[{"memory": STAGE_MEMORY}, {"memory": STAGE_MEMORY}])
    program = load_program(folder)
    assert program.shard_bytes_bound is not None and program.shard_bytes_bound < BOMB_BYTES
    ckpt = f"{folder}/checkpoints"
    trainers = trainers_at(folder, 1)
    writes = drill_writes(trainers, program)
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(BOMB_BYTES))  # the header declares 128 MiB
    assert len(frame) < 128 << 10
    for step in (1, 2):
        for t in trainers:
            t.steps_done = step
        snaps = lossless_snaps(trainers, writes, None, None)
        if step == 2:
            snap = snaps[0]
            key = next(k for k in sorted(snap.meta["encoding"]["tensors"]) if k.startswith("param/"))
            snap.tensors["enc/" + key] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
            snap.meta["encoding"]["tensors"][key] = {"dtype": "F32", "shape": [BOMB_BYTES // 4], "delta": False,
                                                     "sha256": hashlib.sha256(bytes(BOMB_BYTES)).hexdigest()}
        infos = [ck.persist_shard(ckpt, s) for s in snaps]
        ck.write_manifest(ckpt, ck.manifest_for(step, infos, program, writes, compression="lossless"))
    return folder, ckpt, program, [list(t.named_parameters()) for t in trainers]


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_resume_skips_the_bomb_without_decompressing_it(bombed):
    folder, ckpt, program, needed = bombed
    warnings = []
    (valid, loaded), peak = _peak(lambda: ck.find_valid(ckpt, program, 0, needed[0], warn=warnings.append))
    assert valid == [1] and loaded.step == 1
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert f"more than the {program.shard_bytes_bound} a shard of this plan" in warnings[0]
    assert "not decompressed" in warnings[0] and ck.shard_filename(0) in warnings[0]
    assert peak < 16 << 20, f"{peak} bytes allocated to refuse a {BOMB_BYTES}-byte bomb"


def test_inspect_lists_the_bomb_corrupt_without_decompressing_it(bombed, capsys):
    folder, ckpt, program, _ = bombed
    code, peak = _peak(lambda: main(["inspect", folder, "--checkpoints", "--json"]))
    assert code == 0
    entries = {e["step"]: e for e in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert entries[1]["status"] == "valid" and entries[2]["status"] == "corrupt", entries[2]
    assert "not decompressed" in entries[2]["reason"] and "\n" not in entries[2]["reason"]
    assert peak < 16 << 20, f"{peak} bytes allocated to refuse a {BOMB_BYTES}-byte bomb"


def test_inspect_without_a_plan_lists_what_it_would_not_decompress_unchecked(bombed, tmp_path, monkeypatch):
    """No plan beside the folder: inspect decompresses at most UNPLANNED_DECODE_BYTES of a shard
    (1 GiB; lowered here so a small bomb exceeds it) and lists a shard that declares more as
    unchecked, neither valid nor corrupt."""
    _, ckpt, _, _ = bombed
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    monkeypatch.setattr(listing, "UNPLANNED_DECODE_BYTES", BOMB_BYTES // 2)
    listed, peak = _peak(lambda: listing.scan(bare))
    entries = {e["step"]: e for e in listed["checkpoints"]}
    assert entries[1]["status"] == "valid" and entries[2]["status"] == "unchecked", entries[2]
    assert "inspect the program folder" in entries[2]["reason"] and listed["resume"]["step"] == 1
    assert peak < 16 << 20
