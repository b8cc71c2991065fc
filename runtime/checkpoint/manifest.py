"""The commit record and the checkpoint directory: which step directories exist, the manifest that
makes one a checkpoint (written last, verified first), the one-process commit, and pruning.

manifest.json: {"format", "step", "plan_hash", "model_fingerprint", "workload", "world_size",
"num_stages", "dp", "created_unix", "shards": [{"file", "rank", "stages", "replica", "params",
"buffers", "bytes", "sha256"}], "manifest_sha256"} where manifest_sha256 hashes the canonical JSON
(sort_keys, no spaces) of every other key. A directory without a manifest, or whose manifest or
shards fail their hashes, is not a checkpoint (Note [checkpoint format] in
runtime/checkpoint/shard.py; the shards are checked where they are read, runtime/checkpoint/load.py).

Note [crash consistency]: every file is written durably (runtime/checkpoint/durable.py: tmp,
fsync, rename, fsync the directory). The manifest goes last, after every shard is durable, so a
crash at any point leaves either no manifest for the new step (the previous checkpoint is the
newest valid one) or a complete one. Old checkpoints are pruned only after the new manifest is
durable, manifest first, so a half-deleted checkpoint is never valid. ``runtime.faults.FaultPoint``
kills the process (or raises, for in-process tests) after a chosen number of bytes or before a
chosen operation, which is how tests and benchmarks/crash_consistency.py check this.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass

from runtime.checkpoint.durable import fsync_dir, makedirs_durable, write_file_atomic
from runtime.checkpoint.shard import FORMAT, serialize, shard_filename, step_dirname
from runtime.errors import CheckpointCorruptError, PlanMismatchError
from runtime.faults import FaultPoint, armed
from runtime.program import Program

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")


@dataclass(frozen=True)
class ShardInfo:
    file: str
    rank: int
    bytes: int
    sha256: str


def persist_shard(ckpt_dir: str, snap, fault: FaultPoint | None = None) -> ShardInfo:
    """Write one rank's shard (a ``Snapshot``) durably under CKPT/step_N/ (no manifest: see
    ``write_manifest``)."""
    step_dir = os.path.join(ckpt_dir, step_dirname(snap.step))
    makedirs_durable(step_dir, fault)
    data = serialize(snap)
    name = shard_filename(snap.rank)
    write_file_atomic(os.path.join(step_dir, name), data, fault)
    return ShardInfo(name, snap.rank, len(data), hashlib.sha256(data).hexdigest())


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def manifest_for(step: int, shards: list[ShardInfo], program: Program) -> dict:
    """The manifest of ``program``'s checkpoint at ``step`` (shard params from the rank layout)."""
    entries = []
    for info in sorted(shards, key=lambda s: s.rank):
        entry = program.rank(info.rank)
        params = program.params_of(entry.stages)
        buffers = [n for k in sorted(entry.stages) for n in program.stages[k].mutable_buffers]
        entries.append({"file": info.file, "rank": info.rank, "stages": sorted(entry.stages),
                        "replica": entry.replica, "params": params, "buffers": buffers,
                        "bytes": info.bytes, "sha256": info.sha256})
    manifest = {"format": FORMAT, "step": step, "plan_hash": program.plan_hash,
                "model_fingerprint": program.model_fingerprint,
                "workload": program.workload, "world_size": program.world_size,
                "num_stages": program.num_stages, "dp": program.dp,
                "created_unix": time.time(), "shards": entries}
    manifest["manifest_sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    return manifest


def write_manifest(ckpt_dir: str, manifest: dict, fault: FaultPoint | None = None) -> None:
    """The commit: after this returns the checkpoint exists (durably)."""
    step_dir = os.path.join(ckpt_dir, step_dirname(manifest["step"]))
    write_file_atomic(os.path.join(step_dir, MANIFEST),
                      json.dumps(manifest, indent=1, sort_keys=True).encode(), fault)


def remove_checkpoint(ckpt_dir: str, step: int, fault: FaultPoint | None = None) -> None:
    """Decommit (manifest first, durably), then delete the rest."""
    step_dir = os.path.join(ckpt_dir, step_dirname(step))
    f = armed(fault)
    manifest = os.path.join(step_dir, MANIFEST)
    if os.path.exists(manifest):
        f.op(f"unlink {manifest}")
        os.unlink(manifest)
        fsync_dir(step_dir, fault)
    f.op(f"rmtree {step_dir}")
    shutil.rmtree(step_dir, ignore_errors=True)


def prune(ckpt_dir: str, *, keep: int, newest: int, fault: FaultPoint | None = None) -> list[int]:
    """After step ``newest`` committed: delete committed checkpoints beyond the newest ``keep``
    and uncommitted directories older than ``newest``. Returns the steps removed."""
    committed = [s for s in list_step_dirs(ckpt_dir)
                 if os.path.exists(os.path.join(ckpt_dir, step_dirname(s), MANIFEST))]
    doomed = [s for s in committed if s <= newest][keep:] if keep > 0 else []
    doomed += [s for s in list_step_dirs(ckpt_dir) if s < newest and s not in committed]
    for s in sorted(set(doomed)):
        remove_checkpoint(ckpt_dir, s, fault)
    for name in os.listdir(ckpt_dir):  # set aside by recovery (runtime/recovery.py), now superseded
        m = _STEP_DIR.match(name.removeprefix("discarded_"))
        if name.startswith("discarded_") and m and int(m.group(1)) <= newest:
            armed(fault).op(f"rmtree {name}")
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    return sorted(set(doomed))


def commit_local(ckpt_dir: str, snaps: list, program: Program, *, keep: int = 3,
                 fault: FaultPoint | None = None) -> dict:
    """Persist every shard, write the manifest, prune: the whole protocol in one process (what the
    distributed commit does across ranks, in the same order). Used by tests and benchmarks."""
    infos = [persist_shard(ckpt_dir, s, fault) for s in snaps]
    manifest = manifest_for(snaps[0].step, infos, program)
    write_manifest(ckpt_dir, manifest, fault)
    prune(ckpt_dir, keep=keep, newest=manifest["step"], fault=fault)
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading back


def list_step_dirs(ckpt_dir: str) -> list[int]:
    """Steps of every step_N directory, newest first."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))
             and os.path.isdir(os.path.join(ckpt_dir, n))]
    return sorted(steps, reverse=True)


def read_manifest(ckpt_dir: str, step: int) -> dict:
    """The manifest of step ``step``; CheckpointCorruptError if absent, unparsable or tampered."""
    path = os.path.join(ckpt_dir, step_dirname(step), MANIFEST)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{os.path.dirname(path)} has no {MANIFEST} (never committed)") from None
    try:
        manifest = json.loads(raw)
        want = manifest.pop("manifest_sha256")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{path} is not a valid manifest ({exc})") from None
    got = hashlib.sha256(_canonical(manifest)).hexdigest()
    if got != want or manifest.get("format") != FORMAT or manifest.get("step") != step:
        raise CheckpointCorruptError(f"{path} fails its checksum or names another step")
    return manifest


def newest_committed(ckpt_dir: str) -> int:
    """The newest step with a valid manifest (manifests only, no shard read); -1 when none."""
    for step in list_step_dirs(ckpt_dir):
        try:
            read_manifest(ckpt_dir, step)
            return step
        except CheckpointCorruptError:
            continue
    return -1


def check_model(manifest: dict, program: Program, where: str) -> None:
    """A checkpoint of another model is refused (PlanMismatchError naming both)."""
    mine, theirs = program.model_fingerprint, manifest.get("model_fingerprint")
    if mine is not None and theirs is not None and mine != theirs:
        raise PlanMismatchError(
            f"checkpoint {where} is of model {theirs} (workload {manifest.get('workload')!r}, plan "
            f"{manifest.get('plan_hash')}), but this program is of model {mine} (workload "
            f"{program.workload!r}, plan {program.plan_hash}): pass a --checkpoint-dir "
            "that holds this model's checkpoints (or an empty one)")
