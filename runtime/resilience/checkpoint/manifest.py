"""The commit record and the checkpoint directory: which step directories exist, the manifest that
makes one a checkpoint (written last, verified first), the one-process commit, and pruning.

manifest.json: {"format", "step", "plan_hash", "model_fingerprint", "workload", "world_size",
"num_stages", "dp", "created_unix", "shards": [{"file", "rank", "stages", "replica", "params",
"buffers", "bytes", "sha256"}], "manifest_sha256"} where manifest_sha256 hashes the canonical JSON
(sort_keys, no spaces) of every other key. A shard's "params" and "buffers" are the names it holds:
since format 2 only those its rank writes (Note [one writer per byte] in
runtime/resilience/checkpoint/writers.py), in format 1 every name of its stages. A directory without a manifest, or whose manifest is
malformed (Note [manifest schema]) or whose manifest or shards fail their hashes, is not a
checkpoint (Note [checkpoint format] in runtime/resilience/checkpoint/shard.py; the shards are checked where
they are read, runtime/resilience/checkpoint/load.py).

Note [crash consistency]: every file is written durably (runtime/resilience/checkpoint/durable.py: tmp,
fsync, rename, fsync the directory). The manifest goes last, after every shard is durable, so a
crash at any point leaves either no manifest for the new step (the previous checkpoint is the
newest valid one) or a complete one. Old checkpoints are pruned only after the new manifest is
durable, manifest first, so a half-deleted checkpoint is never valid; retention counts only
checkpoints that verify (``verifies``: manifest and every shard's size and sha256), so a bit-rotted
newer one never pushes out the last valid one. Debris (discarded_step_N, unfinished *.tmp) goes
after a commit, at start-up and after a failed persist (``clean_debris``). Files are 0600 and the
folders we create 0700 (runtime/resilience/checkpoint/durable.py): a checkpoint is the model.
``runtime.resilience.faults.FaultPoint`` kills the process (or raises, for in-process tests) after a chosen
number of bytes or before a chosen operation, which is how tests and
benchmarks/crash_consistency.py check this.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass

from runtime.resilience.checkpoint.durable import fsync_dir, makedirs_durable, write_file_atomic, write_pieces_atomic
from runtime.resilience.checkpoint.shard import FORMAT, READABLE_FORMATS, shard_filename, shard_pieces, step_dirname
from runtime.errors import CheckpointCorruptError, PlanMismatchError
from runtime.file_trust import JSON_CAP, UntrustedFile, is_real_dir, lexists_as_link, open_regular, read_bounded
from runtime.resilience.faults import FaultPoint, armed
from runtime.program.spec import Program

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
    name = shard_filename(snap.rank)
    nbytes, sha = write_pieces_atomic(os.path.join(step_dir, name), shard_pieces(snap), fault)
    return ShardInfo(name, snap.rank, nbytes, sha)


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def manifest_for(step: int, shards: list[ShardInfo], program: Program,
                 writes: dict[int, frozenset[str]] | None = None, *, base_step: int | None = None,
                 compression: str = "none") -> dict:
    """The manifest of ``program``'s checkpoint at ``step``: each shard's params and buffers from
    the rank layout, only those its rank wrote when ``writes`` (rank -> names, Note [one writer
    per byte] in runtime/resilience/checkpoint/writers.py) is given."""
    entries = []
    for info in sorted(shards, key=lambda s: s.rank):
        entry = program.rank(info.rank)
        params = program.params_of(entry.stages)
        buffers = [n for k in sorted(entry.stages) for n in program.stages[k].mutable_buffers]
        if writes is not None:
            params = [n for n in params if n in writes[info.rank]]
            buffers = [n for n in buffers if n in writes[info.rank]]
        entries.append({"file": info.file, "rank": info.rank, "stages": sorted(entry.stages),
                        "replica": entry.replica, "params": params, "buffers": buffers,
                        "bytes": info.bytes, "sha256": info.sha256})
    manifest = {"format": FORMAT, "step": step, "plan_hash": program.plan_hash,
                "model_fingerprint": program.model_fingerprint,
                "workload": program.workload, "world_size": program.world_size,
                "num_stages": program.num_stages, "dp": program.dp,
                "created_unix": time.time(), "shards": entries}
    if compression != "none":  # Note [lossless deltas] in runtime/resilience/checkpoint/delta.py
        manifest.update(compression=compression, base_step=base_step)
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
    if not is_real_dir(step_dir):  # a planted link: never delete through it (Note [files are not trusted])
        return
    f = armed(fault)
    manifest = os.path.join(step_dir, MANIFEST)
    if os.path.lexists(manifest):
        f.op(f"unlink {manifest}")
        os.unlink(manifest)
        fsync_dir(step_dir, fault)
    f.op(f"rmtree {step_dir}")
    shutil.rmtree(step_dir, ignore_errors=True)
    for key in [k for k in _HASHED if os.path.dirname(k[0]) == step_dir]:
        del _HASHED[key]


def verifies(ckpt_dir: str, step: int, manifest: dict | None = None) -> bool:
    """Whether checkpoint ``step`` verifies: a well-formed manifest (``read_manifest``) and every
    shard it lists of the right size and sha256. Hashes are remembered per process by the shard's
    (inode, size, mtime), so pruning after each commit hashes each checkpoint once. ``manifest``:
    the one ``read_manifest`` just returned (``prune`` reads each once)."""
    if manifest is None:
        try:
            manifest = read_manifest(ckpt_dir, step)
        except (CheckpointCorruptError, OSError):
            return False
    step_dir = os.path.join(ckpt_dir, step_dirname(step))
    for entry in manifest["shards"]:
        path = os.path.join(step_dir, entry["file"])
        try:  # a link, a FIFO or a device is no shard (Note [files are not trusted])
            fh = os.fdopen(open_regular(path), "rb")
        except OSError:
            return False
        with fh:
            st = os.fstat(fh.fileno())
            key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
            digest = _HASHED.get(key)
            if digest is None and st.st_size == entry["bytes"]:
                h = hashlib.sha256()
                try:
                    while chunk := fh.read(1 << 24):
                        h.update(chunk)
                except OSError:
                    return False
                digest = _HASHED[key] = h.hexdigest()
        if st.st_size != entry["bytes"] or digest != entry["sha256"]:
            return False
    return True


_HASHED: dict[tuple, str] = {}


def prune(ckpt_dir: str, *, keep: int, newest: int, fault: FaultPoint | None = None) -> list[int]:
    """After step ``newest`` committed: keep the newest ``keep`` checkpoints that verify
    (``verifies``: a bit-rotted or malformed one does not count, and is never kept in place of a
    valid one) and the bases their delta chains read, delete the other checkpoints and every
    directory older than ``newest`` that is not a checkpoint (no manifest, or one that fails).
    Then ``clean_debris``. Returns the steps removed.

    Note [retention under deltas]: each manifest is read once per prune and the bases the kept
    checkpoints need are found in one walk over their chains (a step already known to be needed
    ends a walk), so a prune is linear in the number of step directories; it was once recomputed
    per candidate, quadratic, and took 46 s per commit at step 300."""
    manifests: dict[int, dict | None] = {}  # step -> its manifest, None when it has none that reads
    doomed: list[int] = []
    kept: list[int] = []  # the newest ``keep`` that verify
    roots: list[int] = []  # whose chains retention keeps: those, and ``newest`` whatever it is
    for s in list_step_dirs(ckpt_dir):  # newest first
        if s > newest:
            continue
        manifests[s] = _manifest_or_none(ckpt_dir, s)
        if manifests[s] is not None and verifies(ckpt_dir, s, manifests[s]):
            if keep > 0 and len(kept) >= keep:
                doomed.append(s)
            else:
                kept.append(s)
                roots.append(s)
        elif s < newest:
            doomed.append(s)
        else:
            roots.append(s)  # the step just committed, even if it fails now: never ours to delete
    needed = _bases_of(ckpt_dir, roots, manifests)
    doomed = sorted(s for s in set(doomed) if s not in needed)
    for s in doomed:
        remove_checkpoint(ckpt_dir, s, fault)
    clean_debris(ckpt_dir, fault, up_to=newest)
    return doomed


def _manifest_or_none(ckpt_dir: str, step: int) -> dict | None:
    try:
        return read_manifest(ckpt_dir, step)
    except (CheckpointCorruptError, OSError):
        return None


def _bases_of(ckpt_dir: str, kept: list[int], manifests: dict[int, dict | None]) -> set[int]:
    """Every step a kept checkpoint's delta chain reads (Note [lossless deltas] in
    runtime/resilience/checkpoint/delta.py): retention never deletes a base a kept delta needs, and
    keeps no other (Note [retention under deltas]: each step is visited once)."""
    needed: set[int] = set()
    for step in kept:
        while True:
            if step not in manifests:  # not listed (gone since, or past newest): read it this once
                manifests[step] = _manifest_or_none(ckpt_dir, step)
            manifest = manifests[step]
            base = manifest.get("base_step") if manifest is not None else None
            if not isinstance(base, int) or base >= step or base in needed:
                break
            needed.add(base)
            step = base
    return needed


def clean_debris(ckpt_dir: str, fault: FaultPoint | None = None, *, up_to: int | None = None) -> list[str]:
    """Remove what no checkpoint needs: every discarded_step_N (set aside by runtime/resilience/recovery.py)
    and every unfinished "*.tmp" in the folder and its step directories. Called after a commit,
    at start-up before the first persist, and after a failed persist (a full disk must not
    crash-loop on its own debris). ``up_to``: only the .tmp files of steps up to it (after a commit
    another rank may already be writing a newer step); None: every one, only while no persist is
    writing.
    Returns the paths removed."""
    removed: list[str] = []
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return removed
    for name in sorted(names):
        path = os.path.join(ckpt_dir, name)
        m = _STEP_DIR.match(name.removeprefix("discarded_"))
        if name.startswith("discarded_") and m:  # nobody writes these: always debris
            armed(fault).op(f"rmtree {name}")
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif name.endswith(".tmp") and up_to is None:
            _unlink(path, removed)
        elif m and is_real_dir(path) and (up_to is None or int(m.group(1)) <= up_to):  # never through a link
            try:
                inner = os.listdir(path)
            except OSError:
                continue
            for f in sorted(inner):
                if f.endswith(".tmp"):
                    _unlink(os.path.join(path, f), removed)
    return removed


def _unlink(path: str, removed: list[str]) -> None:
    try:
        os.unlink(path)
        removed.append(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    except OSError:
        pass


def commit_local(ckpt_dir: str, snaps: list, program: Program, *, keep: int = 3,
                 fault: FaultPoint | None = None, writes: dict[int, frozenset[str]] | None = None) -> dict:
    """Persist every shard, write the manifest, prune: the whole protocol in one process (what the
    distributed commit does across ranks, in the same order). Used by tests and benchmarks.
    ``writes``: what each rank's snapshot holds, when it was taken with ``snapshot(t, writes)``."""
    infos = [persist_shard(ckpt_dir, s, fault) for s in snaps]
    enc = snaps[0].meta.get("encoding")
    manifest = manifest_for(snaps[0].step, infos, program, writes, base_step=enc and enc["base_step"],
                            compression="lossless" if enc else "none")
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
    # a link named like a step folder is not one (Note [files are not trusted]): never read, written or pruned
    steps = [int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))
             and is_real_dir(os.path.join(ckpt_dir, n))]
    return sorted(steps, reverse=True)


def read_manifest(ckpt_dir: str, step: int) -> dict:
    """The manifest of step ``step``; CheckpointCorruptError if absent, unparsable or tampered."""
    path = os.path.join(ckpt_dir, step_dirname(step), MANIFEST)
    if lexists_as_link(os.path.dirname(path)):
        raise CheckpointCorruptError(f"{os.path.dirname(path)} is a symbolic link, not a step folder: not read "
                                     "(remove it)")
    try:  # bounded, regular files only (Note [files are not trusted]): a FIFO or /dev/zero is refused
        raw = read_bounded(path, cap=JSON_CAP)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{os.path.dirname(path)} has no {MANIFEST} (never committed)") from None
    except UntrustedFile as exc:
        raise CheckpointCorruptError(str(exc)) from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError too
        raise CheckpointCorruptError(f"{path} is not a valid manifest (not JSON: {exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("manifest_sha256"), str):
        what = "an empty object" if manifest == {} else f"a JSON {type(manifest).__name__}" \
            if not isinstance(manifest, dict) else "an object without a manifest_sha256"
        raise CheckpointCorruptError(f"{path} is not a valid manifest (it is {what}, not the manifest a commit "
                                     "writes): not restorable")
    want = manifest.pop("manifest_sha256")
    got = hashlib.sha256(_canonical(manifest)).hexdigest()
    if got != want or manifest.get("format") not in READABLE_FORMATS or manifest.get("step") != step:
        raise CheckpointCorruptError(f"{path} fails its checksum or names another step")
    problem = schema_problem(manifest)
    if problem:
        raise CheckpointCorruptError(f"{path} is malformed: {problem}")
    return manifest


# Note [manifest schema]: a manifest whose hash checks out may still be malformed (written by
# another tool, edited and re-hashed, a bug). Every field is type-checked before anyone reads it,
# and a shard is named by a bare file name inside its step directory (never absolute, never
# "..", no separator), so a malformed manifest is a CheckpointCorruptError like a corrupt one:
# skipped, recovery falls back to the next older checkpoint, ``inspect --checkpoints`` says why.
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_TOP = {"format": lambda v: isinstance(v, str), "step": lambda v: _is_int(v) and v >= 0,
        "plan_hash": lambda v: isinstance(v, str), "model_fingerprint": lambda v: v is None or isinstance(v, str),
        "workload": lambda v: v is None or isinstance(v, str), "world_size": lambda v: _is_int(v) and v > 0,
        "num_stages": lambda v: _is_int(v) and v > 0, "dp": lambda v: _is_int(v) and v > 0,
        "created_unix": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "shards": lambda v: isinstance(v, list) and len(v) > 0}
_SHARD = {"file": lambda v: isinstance(v, str) and _bare_name(v), "rank": lambda v: _is_int(v) and v >= 0,
          "stages": lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
          "replica": lambda v: _is_int(v) and v >= 0, "params": _is_str_list,
          "bytes": lambda v: _is_int(v) and v >= 0,
          "sha256": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None}
_SHARD_OPTIONAL = {"buffers": _is_str_list}  # absent in manifests written before mutable buffers
_TOP_OPTIONAL = {"compression": lambda v: v in ("none", "lossless"),  # lossless checkpoints only
                 "base_step": lambda v: v is None or (_is_int(v) and v > 0)}


def _bare_name(name: str) -> bool:
    return (name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name
            and os.path.basename(name) == name and not os.path.isabs(name))


def schema_problem(manifest) -> str | None:
    """What is wrong with a manifest's structure (Note [manifest schema]), or None."""
    if not isinstance(manifest, dict):
        return f"a {type(manifest).__name__}, not an object"
    for key, ok in _TOP.items():
        if key not in manifest:
            return f"no {key!r}"
        if not ok(manifest[key]):
            return f"{key!r} is {manifest[key]!r}"
    for key, ok in _TOP_OPTIONAL.items():
        if key in manifest and not ok(manifest[key]):
            return f"{key!r} is {manifest[key]!r}"
    ranks, files = set(), set()
    for i, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict):
            return f"shards[{i}] is {entry!r}, not an object"
        for key, ok in _SHARD.items():
            if key not in entry:
                return f"shards[{i}] has no {key!r}"
            if not ok(entry[key]):
                what = "not a bare file name in the step directory" if key == "file" else "of the wrong type"
                return f"shards[{i}].{key} is {entry[key]!r} ({what})"
        for key, ok in _SHARD_OPTIONAL.items():
            if key in entry and not ok(entry[key]):
                return f"shards[{i}].{key} is {entry[key]!r} (of the wrong type)"
        if entry["rank"] in ranks or entry["file"] in files:
            return f"shards[{i}] repeats rank {entry['rank']} or file {entry['file']!r}"
        ranks.add(entry["rank"])
        files.add(entry["file"])
    return None


def newest_committed(ckpt_dir: str) -> int:
    """The newest step with a valid manifest whose shards are all there at their declared sizes
    (``complete``: no shard read); -1 when none."""
    for step in list_step_dirs(ckpt_dir):
        try:
            manifest = read_manifest(ckpt_dir, step)
        except CheckpointCorruptError:
            continue
        if complete(ckpt_dir, manifest):
            return step
    return -1


# Note [a manifest alone is no checkpoint]: a step folder holding a valid manifest and none (or not
# all) of its shards restores nothing, so nothing that asks for the newest checkpoint (`partitioner
# run`'s --steps check, the memory tier's comparison with the disk, the restart line) may count it:
# they agree with the resume, which skips it (``verifies`` fails), and with `inspect --checkpoints`,
# which calls it corrupt and names each missing shard.
def complete(ckpt_dir: str, manifest: dict) -> bool:
    """Whether every shard ``manifest`` lists is a regular file of its declared size, by lstat
    alone (Note [a manifest alone is no checkpoint])."""
    step_dir = os.path.join(ckpt_dir, step_dirname(manifest["step"]))
    for entry in manifest["shards"]:
        try:
            st = os.lstat(os.path.join(step_dir, entry["file"]))
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry["bytes"]:
            return False
    return True


def check_model(manifest: dict, program: Program, where: str) -> None:
    """A checkpoint of another model is refused (PlanMismatchError naming both)."""
    mine, theirs = program.model_fingerprint, manifest.get("model_fingerprint")
    if mine is not None and theirs is not None and mine != theirs:
        raise PlanMismatchError(
            f"checkpoint {where} is of model {theirs} (workload {manifest.get('workload')!r}, plan "
            f"{manifest.get('plan_hash')}), but this program is of model {mine} (workload "
            f"{program.workload!r}, plan {program.plan_hash}): pass a --checkpoint-dir "
            "that holds this model's checkpoints (or an empty one)")
