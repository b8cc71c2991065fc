"""Checkpoints: what one is on disk, how it is written so that a crash never leaves half of one,
and how it is read back and verified. No process group here (the distributed commit and the
recovery agreement are in ``runtime.recovery``), so every function is testable in one process.

Note [checkpoint format]: one checkpoint is one global step (``step`` = steps done = the next
step's make_batch index) in its own directory::

    CKPT/step_000000042/shard_rank_00003.safetensors   rank 3's shard (one file per rank)
    CKPT/step_000000042/manifest.json                  the commit record, written last

A shard is a safetensors file: tensors "param/<name>", "optim/<name>/exp_avg",
"optim/<name>/exp_avg_sq", "buffer/<name>" (original names, so any partition can read them;
buffers are those the forward updates, Note [mutable buffers] in partitioner/split.py),
"rng/torch_cpu", "rng/cuda_<i>", "rng/numpy_keys"; its metadata "meta" is JSON: format, step,
rank, stages, replica, plan_hash, model_fingerprint, params (names), buffers (names), param_steps
(AdamW step per parameter), lr_scheduler (LambdaLR's JSON-able state), python_random,
numpy_random. ``state_entries`` is the one definition of a shard's contents; the memory tier
(runtime/memtier.py) writes the same format through it.

manifest.json: {"format", "step", "plan_hash", "model_fingerprint", "workload", "world_size",
"num_stages", "dp", "created_unix", "shards": [{"file", "rank", "stages", "replica", "params",
"buffers", "bytes", "sha256"}], "manifest_sha256"} where manifest_sha256 hashes the canonical JSON
(sort_keys, no spaces) of every other key. A directory without a manifest, or whose manifest or
shards fail their hashes, is not a checkpoint. Loading parses JSON and safetensors only (never
pickle).

Note [crash consistency]: every file is written to "<name>.tmp", fsync'd, renamed over its final
name, and its directory fsync'd. The manifest goes last, after every shard is durable, so a crash
at any point leaves either no manifest for the new step (the previous checkpoint is the newest
valid one) or a complete one. Old checkpoints are pruned only after the new manifest is durable,
manifest first, so a half-deleted checkpoint is never valid. ``FaultPoint`` kills the process (or
raises, for in-process tests) after a chosen number of bytes or before a chosen operation, which
is how tests and benchmarks/crash_consistency.py check this.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from runtime.errors import CheckpointCorruptError, PlanMismatchError

FORMAT = "partitioner-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")
CHUNK_BYTES = 1 << 20
READS = {"shards": 0}  # shard files read by this process (a recovery reports how many it read)


def step_dirname(step: int) -> str:
    return f"step_{step:09d}"


def shard_filename(rank: int) -> str:
    return f"shard_rank_{rank:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Fault points (Note [crash consistency])


class SimulatedCrash(BaseException):
    """Raised by a FaultPoint with action="raise": the in-process stand-in for SIGKILL (a
    BaseException, so no ``except Exception`` on the way tidies anything up)."""


@dataclass
class FaultPoint:
    """Die after ``after_bytes`` bytes written, or just before operation number ``before_op``
    (0-based; operations: open, write chunk, fsync, rename, mkdir, unlink, rmtree, dir fsync),
    counting over everything done with this object. action: "sigkill" or "raise"."""

    after_bytes: int | None = None
    before_op: int | None = None
    action: str = "sigkill"
    bytes_done: int = 0
    ops_done: int = 0

    def _die(self, where: str):
        if self.action == "raise":
            raise SimulatedCrash(where)
        sys.stderr.write(f"[fault] killing pid {os.getpid()} during checkpoint persist: {where}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous only in theory; never return

    def op(self, what: str) -> None:
        if self.before_op is not None and self.ops_done >= self.before_op:
            self._die(f"before op {self.ops_done} ({what})")
        self.ops_done += 1

    def allow_bytes(self, n: int) -> int:
        """How many of the next ``n`` bytes may be written before dying."""
        if self.after_bytes is None:
            return n
        return max(0, min(n, self.after_bytes - self.bytes_done))

    def wrote(self, n: int, what: str) -> None:
        self.bytes_done += n
        if self.after_bytes is not None and self.bytes_done >= self.after_bytes:
            self._die(f"after {self.bytes_done} bytes ({what})")


class _NoFault(FaultPoint):
    def op(self, what: str) -> None:
        pass

    def wrote(self, n: int, what: str) -> None:
        pass


def _fault(fault: FaultPoint | None) -> FaultPoint:
    return fault if fault is not None else _NoFault()


# ---------------------------------------------------------------------------------------------
# Durable file operations


def fsync_dir(path: str, fault: FaultPoint | None = None) -> None:
    _fault(fault).op(f"fsync dir {path}")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str, fault: FaultPoint | None = None) -> None:
    """mkdir -p, fsync'ing each parent whose entries changed."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    makedirs_durable(parent, fault)
    _fault(fault).op(f"mkdir {path}")
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    fsync_dir(parent, fault)


def write_file_atomic(path: str, data: bytes | memoryview, fault: FaultPoint | None = None) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one (tmp, fsync,
    rename, fsync directory)."""
    f = _fault(fault)
    tmp = path + ".tmp"
    view = memoryview(data).cast("B")
    f.op(f"open {tmp}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        while offset < len(view):
            n = f.allow_bytes(min(CHUNK_BYTES, len(view) - offset))
            written = os.write(fd, view[offset:offset + n]) if n else 0
            offset += written
            f.wrote(written, f"{os.path.basename(tmp)} at byte {offset}")
        f.op(f"fsync {tmp}")
        os.fsync(fd)
    finally:
        os.close(fd)
    f.op(f"rename {tmp}")
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path), fault)


def check_writable(ckpt_dir: str) -> None:
    """Create ``ckpt_dir`` if needed and prove a file can be written, fsync'd and removed there;
    raises ValueError naming the directory and the fix."""
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        probe = os.path.join(ckpt_dir, f".write_probe_{os.getpid()}")
        with open(probe, "wb") as fh:
            fh.write(b"ok")
            fh.flush()
            os.fsync(fh.fileno())
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"checkpoint directory {ckpt_dir} is not writable ({exc.strerror or exc}): "
                         "pass --checkpoint-dir with a writable folder") from None


# ---------------------------------------------------------------------------------------------
# Snapshot: the host-memory copy (the only stall)


@dataclass
class Snapshot:
    step: int  # steps done
    rank: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    stall_s: float = 0.0


def _json_scheduler_state(sched) -> dict:
    return {k: v for k, v in sched.state_dict().items()
            if k != "lr_lambdas" and isinstance(v, (int, float, str, bool, list, type(None)))}


def capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng/torch_cpu": torch.get_rng_state().clone()}
    meta: dict = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda_{i}"] = st.clone()
    version, state, gauss = random.getstate()
    meta["python_random"] = [version, list(state), gauss]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["rng/numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy_random"] = [name, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("rng/cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    if meta.get("python_random"):
        version, state, gauss = meta["python_random"]
        random.setstate((version, tuple(state), gauss))
    np = sys.modules.get("numpy")
    if np is not None and meta.get("numpy_random") and "rng/numpy_keys" in tensors:
        name, pos, has_gauss, cached = meta["numpy_random"]
        np.random.set_state((name, tensors["rng/numpy_keys"].numpy().astype("uint32"), pos,
                             has_gauss, cached))


def state_entries(trainer) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """A RankTrainer's shard, by tensor name (Note [checkpoint format]), and its meta: the one
    definition both writers use (``snapshot`` and the memory tier's preallocated copy).
    Parameters and Adam state are the live tensors: the caller copies them before the optimizer
    next runs. Mutable buffers are copied now, because the next forward updates them while a
    background copy may still be running."""
    tensors: list[tuple[str, torch.Tensor]] = []
    names, param_steps = [], {}
    for name, p in trainer.named_parameters().items():
        names.append(name)
        tensors.append((f"param/{name}", p.detach()))
        st = trainer.optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors.append((f"optim/{name}/{key}", st[key].detach()))
        if "step" in st:
            param_steps[name] = float(st["step"])
    buffers = trainer.named_mutable_buffers()
    with torch.no_grad():
        tensors += [(f"buffer/{name}", b.detach().to("cpu", copy=True)) for name, b in buffers.items()]
    rng_tensors, rng_meta = capture_rng()
    tensors += sorted(rng_tensors.items())
    program = trainer.program
    meta = {"format": FORMAT, "step": trainer.steps_done, "rank": trainer.rank,
            "stages": list(trainer.stage_ids), "replica": trainer.replica,
            "plan_hash": program.get("plan_hash"), "model_fingerprint": program.get("model_fingerprint"),
            "params": names, "buffers": list(buffers), "param_steps": param_steps,
            "lr_scheduler": _json_scheduler_state(trainer.lr_scheduler), **rng_meta}
    return tensors, meta


def snapshot(trainer) -> Snapshot:
    """Copy a RankTrainer's state to host memory, keyed by original names."""
    t0 = time.perf_counter()
    entries, meta = state_entries(trainer)
    with torch.no_grad():
        tensors = {name: t.to("cpu", copy=True) for name, t in entries}
    snap = Snapshot(trainer.steps_done, trainer.rank, tensors, meta)
    snap.stall_s = time.perf_counter() - t0
    return snap


# ---------------------------------------------------------------------------------------------
# Persist and commit


@dataclass(frozen=True)
class ShardInfo:
    file: str
    rank: int
    bytes: int
    sha256: str


def serialize(snap: Snapshot) -> bytes:
    return st_save(snap.tensors, metadata={"meta": json.dumps(snap.meta, sort_keys=True)})


def persist_shard(ckpt_dir: str, snap: Snapshot, fault: FaultPoint | None = None) -> ShardInfo:
    """Write one rank's shard durably under CKPT/step_N/ (no manifest: see ``write_manifest``)."""
    step_dir = os.path.join(ckpt_dir, step_dirname(snap.step))
    makedirs_durable(step_dir, fault)
    data = serialize(snap)
    name = shard_filename(snap.rank)
    write_file_atomic(os.path.join(step_dir, name), data, fault)
    return ShardInfo(name, snap.rank, len(data), hashlib.sha256(data).hexdigest())


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def manifest_for(step: int, shards: list[ShardInfo], program: dict) -> dict:
    """The manifest of ``program``'s checkpoint at ``step`` (shard params from the rank layout)."""
    stages = program["stages"]
    by_rank = {e["rank"]: e for e in program["ranks"]}
    entries = []
    for info in sorted(shards, key=lambda s: s.rank):
        entry = by_rank[info.rank]
        params = list(dict.fromkeys(n for k in sorted(entry["stages"]) for n in stages[k]["params"]))
        buffers = [n for k in sorted(entry["stages"]) for n in stages[k].get("mutable_buffers", [])]
        entries.append({"file": info.file, "rank": info.rank, "stages": sorted(entry["stages"]),
                        "replica": entry["replica"], "params": params, "buffers": buffers,
                        "bytes": info.bytes, "sha256": info.sha256})
    manifest = {"format": FORMAT, "step": step, "plan_hash": program.get("plan_hash"),
                "model_fingerprint": program.get("model_fingerprint"),
                "workload": program.get("workload"), "world_size": program["world_size"],
                "num_stages": program["num_stages"], "dp": program["dp"],
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
    f = _fault(fault)
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
            _fault(fault).op(f"rmtree {name}")
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    return sorted(set(doomed))


def commit_local(ckpt_dir: str, snaps: list[Snapshot], program: dict, *, keep: int = 3,
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


def check_model(manifest: dict, program: dict, where: str) -> None:
    """A checkpoint of another model is refused (PlanMismatchError naming both)."""
    mine, theirs = program.get("model_fingerprint"), manifest.get("model_fingerprint")
    if mine is not None and theirs is not None and mine != theirs:
        raise PlanMismatchError(
            f"checkpoint {where} is of model {theirs} (workload {manifest.get('workload')!r}, plan "
            f"{manifest.get('plan_hash')}), but this program is of model {mine} (workload "
            f"{program.get('workload')!r}, plan {program.get('plan_hash')}): pass a --checkpoint-dir "
            "that holds this model's checkpoints (or an empty one)")


def read_shard(ckpt_dir: str, manifest: dict, entry: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of one shard listed in ``manifest``, after checking size and sha256."""
    path = os.path.join(ckpt_dir, step_dirname(manifest["step"]), entry["file"])
    READS["shards"] += 1
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing") from None
    if len(data) != entry["bytes"]:
        raise CheckpointCorruptError(f"{path} has {len(data)} bytes, the manifest says {entry['bytes']}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise CheckpointCorruptError(f"{path} fails its sha256 (manifest {entry['sha256'][:12]}..., "
                                     f"file {digest[:12]}...)")
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8:8 + header_len])["__metadata__"]["meta"])
    except Exception as exc:  # noqa: BLE001 - any parse failure is corruption
        raise CheckpointCorruptError(f"{path} does not parse ({exc})") from None
    return tensors, meta


def state_names(program: dict, stages) -> list[str]:
    """What a rank holding ``stages`` of ``program`` reads from a checkpoint: its parameters, then
    its mutable buffers (original names, each once)."""
    entries = [program["stages"][k] for k in sorted(stages)]
    return list(dict.fromkeys([n for st in entries for n in st["params"]]
                              + [n for st in entries for n in st.get("mutable_buffers", [])]))


def _holds(entry: dict, name: str) -> bool:
    return name in entry["params"] or name in entry.get("buffers", ())


@dataclass
class ShardChoice:
    """Which shards of a checkpoint one rank reads: ``param_source`` maps each parameter (or
    mutable buffer) name it needs to a shard entry; ``own`` is the entry written by the same rank
    of the same plan (RNG states), or None after a reshard."""

    param_source: dict[str, dict]
    own: dict | None
    entries: list[dict] = field(default_factory=list)  # distinct entries to read, in rank order


def choose_shards(manifest: dict, program: dict, rank: int, needed: list[str]) -> ShardChoice:
    """Each needed parameter comes from this rank's own shard when the plan is the same,
    otherwise from the lowest-rank shard that holds it (Note [checkpoint format])."""
    same_plan = (manifest.get("plan_hash") == program.get("plan_hash")
                 and manifest.get("world_size") == program["world_size"])
    entries = sorted(manifest["shards"], key=lambda e: e["rank"])
    own = next((e for e in entries if e["rank"] == rank), None) if same_plan else None
    source: dict[str, dict] = {}
    for name in needed:
        if own is not None and _holds(own, name):
            source[name] = own
            continue
        holder = next((e for e in entries if _holds(e, name)), None)
        if holder is None:
            raise CheckpointCorruptError(
                f"checkpoint step {manifest['step']} holds no shard with parameter or buffer {name!r}")
        source[name] = holder
    chosen = {e["rank"]: e for e in source.values()}
    if own is not None:
        chosen[own["rank"]] = own
    return ShardChoice(source, own, [chosen[r] for r in sorted(chosen)])


@dataclass
class LoadedCheckpoint:
    step: int
    manifest: dict
    params: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg", "exp_avg_sq"}
    param_steps: dict[str, float]
    lr_scheduler: dict
    rng_tensors: dict[str, torch.Tensor] | None  # None after a reshard
    rng_meta: dict | None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # mutable buffers, original names


def take_state(loaded: LoadedCheckpoint, name: str, tensors: dict[str, torch.Tensor], meta: dict,
               where: str) -> None:
    """Put parameter ``name`` (with its Adam state) or mutable buffer ``name`` of one shard into
    ``loaded``: the one reader of a shard's state, for the disk and the memory tier."""
    if f"param/{name}" in tensors:
        loaded.params[name] = tensors[f"param/{name}"]
        st = {k: tensors[f"optim/{name}/{k}"] for k in ("exp_avg", "exp_avg_sq")
              if f"optim/{name}/{k}" in tensors}
        if st:
            loaded.optim[name] = st
        if name in meta.get("param_steps", {}):
            loaded.param_steps[name] = meta["param_steps"][name]
    elif f"buffer/{name}" in tensors:
        loaded.buffers[name] = tensors[f"buffer/{name}"]
    else:
        raise CheckpointCorruptError(f"{where} lacks parameter or buffer {name!r}")


def load_for_rank(ckpt_dir: str, step: int, program: dict, rank: int, needed: list[str],
                  manifest: dict | None = None) -> LoadedCheckpoint:
    """Verify and read what ``rank`` of ``program`` needs from checkpoint ``step``."""
    manifest = manifest or read_manifest(ckpt_dir, step)
    check_model(manifest, program, os.path.join(ckpt_dir, step_dirname(step)))
    choice = choose_shards(manifest, program, rank, needed)
    read = {e["rank"]: read_shard(ckpt_dir, manifest, e) for e in choice.entries}
    loaded = LoadedCheckpoint(step, manifest, {}, {}, {}, {}, None, None)
    sched = None
    for name in needed:
        tensors, meta = read[choice.param_source[name]["rank"]]
        take_state(loaded, name, tensors, meta, f"shard {choice.param_source[name]['file']} of step {step}")
        if meta.get("step") != step:
            raise CheckpointCorruptError(f"shard {choice.param_source[name]['file']} says step "
                                         f"{meta.get('step')}, its directory says {step}")
        sched = sched or meta.get("lr_scheduler")
    if choice.own is not None:
        rng_tensors, loaded.rng_meta = read[choice.own["rank"]]
        loaded.rng_tensors = {k: v for k, v in rng_tensors.items() if k.startswith("rng/")}
        sched = loaded.rng_meta.get("lr_scheduler") or sched
    loaded.lr_scheduler = sched or {}
    return loaded


def find_valid(ckpt_dir: str, program: dict, rank: int, needed: list[str], *, warn=None,
               limit: int = 64) -> tuple[list[int], LoadedCheckpoint | None]:
    """Steps of the checkpoints valid for ``rank`` (manifest and the shards it reads verify),
    newest first, and the newest one loaded. ``warn(message)`` hears of every one skipped (a
    partial or corrupt checkpoint, named); a checkpoint of another model raises
    PlanMismatchError (``check_model``)."""
    valid: list[int] = []
    newest = None
    for step in list_step_dirs(ckpt_dir)[:limit]:
        where = os.path.join(ckpt_dir, step_dirname(step))
        try:
            manifest = read_manifest(ckpt_dir, step)
        except CheckpointCorruptError as exc:
            if warn:
                warn(f"skipping checkpoint {where}: {exc}")
            continue
        check_model(manifest, program, where)
        try:
            loaded = load_for_rank(ckpt_dir, step, program, rank, needed, manifest)
        except CheckpointCorruptError as exc:
            if warn:
                warn(f"skipping checkpoint {where}: {exc}")
            continue
        valid.append(step)
        if newest is None:
            newest = loaded
    return valid, newest


def restore(trainer, ckpt: LoadedCheckpoint) -> None:
    """Put a loaded checkpoint into a RankTrainer (every copy of a tied parameter, every mutable
    buffer)."""
    seen: set[int] = set()
    with torch.no_grad():
        for name, buffer in trainer.named_mutable_buffers().items():
            if name not in ckpt.buffers:
                raise CheckpointCorruptError(f"checkpoint step {ckpt.step} lacks mutable buffer {name!r}")
            buffer.copy_(ckpt.buffers[name].to(buffer.device))
        for m in trainer.modules:
            for name in m.parameter_names:
                p = m.get_parameter(name)
                p.copy_(ckpt.params[name].to(p.device))
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if name in ckpt.optim:
                    old = trainer.optimizer.state.get(p) or {}
                    st = {}
                    for k, v in ckpt.optim[name].items():
                        cur = old.get(k)  # state already allocated (runtime.memtier.preallocate): fill it
                        same = isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == v.dtype \
                            and cur.device == p.device
                        st[k] = cur.copy_(v) if same else v.to(p.device).clone()
                    if name in ckpt.param_steps:
                        st["step"] = torch.tensor(ckpt.param_steps[name], dtype=torch.float32)
                    trainer.optimizer.state[p] = st
    sched = trainer.lr_scheduler
    if ckpt.lr_scheduler:
        sched.__dict__.update({k: (list(v) if isinstance(v, list) else v)
                               for k, v in ckpt.lr_scheduler.items()})
        for group, lr in zip(trainer.optimizer.param_groups, sched.get_last_lr()):
            group["lr"] = lr
    if ckpt.rng_tensors is not None:
        restore_rng(ckpt.rng_tensors, ckpt.rng_meta or {})
    trainer.steps_done = ckpt.step


# ---------------------------------------------------------------------------------------------
# The interval


def young_daly_interval(stall_s: float, mtbf_s: float, step_time_s: float) -> tuple[int, dict]:
    """Checkpoint every K steps with K * step_time ~ sqrt(2 * stall * MTBF) (Young/Daly).
    Returns K and the figures to log: tau_s, overhead (stall/tau), expected_rework_s (tau/2 per
    failure) and the expected fraction of time lost, stall/tau + tau/(2 MTBF)."""
    tau = math.sqrt(2.0 * max(stall_s, 1e-9) * mtbf_s)
    k = max(1, int(round(tau / max(step_time_s, 1e-9))))
    tau_k = k * step_time_s
    return k, {"tau_s": tau_k, "young_daly_s": tau, "overhead": stall_s / tau_k,
               "expected_rework_s": tau_k / 2.0,
               "expected_lost_fraction": stall_s / tau_k + tau_k / (2.0 * mtbf_s)}


def parse_duration_s(text: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([smhd]?)\s*", str(text))
    if not match:
        raise ValueError(f"--mtbf {text!r} is not a duration: write e.g. 90m, 6h or 2d")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]

