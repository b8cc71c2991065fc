"""Verified loads: which shards of a checkpoint a rank reads (its own with the same plan, else any
that holds each name: a resharded load), each checked against the manifest (size, sha256) before
it is parsed, and the newest checkpoint valid for a rank. The memory tier's verified bytes come in
through ``loaded_from_bytes``, the same reader (``runtime.resilience.checkpoint.shard.parse_shard``) and the
same ``take_state``."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import torch

from runtime.resilience.checkpoint.delta import decode_shard
from runtime.resilience.checkpoint.manifest import _bare_name, check_model, list_step_dirs, read_manifest
from runtime.resilience.checkpoint.shard import parse_shard, step_dirname
from runtime.resilience.checkpoint.state import LoadedCheckpoint, pieces_complete, take_pieces, take_state
from runtime.resilience.checkpoint.validate import check_meta
from runtime.errors import CheckpointCorruptError, MissingPackageError, PlanMismatchError
from runtime.file_trust import UntrustedFile, lexists_as_link, open_regular
from runtime.program.spec import Program

READS = {"shards": 0}  # shard files read by this process (a recovery reports how many it read)
RESUME_CANDIDATES = 64  # a resume looks at the newest 64 step directories only


def parse_verified(data, where: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``parse_shard`` of bytes whose hash already checked out; CheckpointCorruptError if they do
    not parse."""
    try:
        return parse_shard(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure is corruption
        raise CheckpointCorruptError(f"{where} does not parse ({exc})") from None


def read_shard(ckpt_dir: str, manifest: dict, entry: dict, cache: dict | None = None, *,
               bound: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of one shard listed in ``manifest``, after checking size and sha256; an
    encoded shard is decoded, reading the bases its deltas need (Note [lossless deltas] in
    runtime/resilience/checkpoint/delta.py; ``cache``: shards and manifests already read in this load;
    ``bound``: the most bytes each shard of the chain may decode to, Note [bounded decompression]).

    Note [chains resolve iteratively]: a delta's base may itself be a delta, and a chain written
    before --checkpoint-full-every had a bound can be hundreds long, so the chain is walked in a
    loop (newest to oldest, reading and verifying each link) and decoded oldest first, never by
    recursion (which ran out of stack past ~250 links and made every checkpoint unreadable)."""
    cache = {} if cache is None else cache
    tensors, meta, path = _read_verified(ckpt_dir, manifest, entry)
    if not (isinstance(meta, dict) and meta.get("encoding")):
        return tensors, meta
    writer = entry.get("rank")
    links = [(manifest, entry, tensors, meta, path)]  # the chain, newest first, to a link already decoded
    while (base := _base_of(ckpt_dir, links[-1][0], links[-1][3], links[-1][4], cache, writer)) is not None:
        base_manifest, holder = base
        if ("shard", base_manifest["step"], holder["file"]) in cache:
            break
        links.append((base_manifest, holder, *_read_verified(ckpt_dir, base_manifest, holder)))
    for m, e, t, mt, where in reversed(links[1:]):  # the bases, oldest first: each one's base is decoded by now
        cache[("shard", m["step"], e["file"])] = (_decoded(t, mt, where, cache, writer, bound), mt)
    return _decoded(tensors, meta, path, cache, writer, bound), meta


def check_declared_sizes(manifest: dict, program: Program, where: str) -> None:
    """CheckpointCorruptError when the manifest declares a shard larger than any shard of this
    plan can be, before one byte of it is read (Note [declared sizes are bounded] in
    runtime/program/spec.py)."""
    bound = program.shard_bytes_bound
    for entry in manifest["shards"] if bound is not None else ():
        if entry["bytes"] > bound:
            raise CheckpointCorruptError(f"{where}: its manifest declares {entry['file']} of {entry['bytes']} bytes, "
                                         f"more than the {bound} a shard of this plan can hold: not read")


def _read_verified(ckpt_dir: str, manifest: dict, entry: dict) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(tensors, meta, path) of one shard as stored (an encoded one still encoded), after checking
    its name, size and sha256 against ``manifest``."""
    name = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not _bare_name(name):  # read_manifest checked; a hand-built one may not be
        raise CheckpointCorruptError(f"shard file {name!r} of step {manifest.get('step')} is not a bare file name")
    path = os.path.join(ckpt_dir, step_dirname(manifest["step"]), name)
    READS["shards"] += 1
    if lexists_as_link(os.path.dirname(path)):
        raise CheckpointCorruptError(f"{os.path.dirname(path)} is a symbolic link, not a step folder: not read")
    try:  # a regular file of the size the manifest says, never a link (Note [files are not trusted])
        with os.fdopen(open_regular(path), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != entry["bytes"]:  # before allocating: a huge file is refused unread
                raise CheckpointCorruptError(f"{path} has {size} bytes, the manifest says {entry['bytes']}")
            data = bytearray(size)
            data = data[:fh.readinto(data)]
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing") from None
    except UntrustedFile as exc:
        raise CheckpointCorruptError(str(exc)) from None
    if len(data) != entry["bytes"]:
        raise CheckpointCorruptError(f"{path} has {len(data)} bytes, the manifest says {entry['bytes']}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise CheckpointCorruptError(f"{path} fails its sha256 (manifest {entry['sha256'][:12]}..., "
                                     f"file {digest[:12]}...)")
    tensors, meta = parse_verified(data, path)
    check_meta(meta, path)  # Note [valid means restorable]
    return tensors, meta, path


def _name_of(key: str) -> str:
    """The parameter or buffer name of a shard key ("param/N", "buffer/N", "optim/N/exp_avg", and
    ZeRO-1's pieces "optim_shard/N/exp_avg", "optim_tp_shard/N/exp_avg")."""
    kind, rest = key.split("/", 1)
    return rest.rsplit("/", 1)[0] if kind in ("optim", "optim_shard", "optim_tp_shard") else rest


def _base_of(ckpt_dir: str, manifest: dict, meta: dict, where: str, cache: dict, writer):
    """(base manifest, the writer's shard entry in it) that an encoded shard's deltas read, or None
    when it holds no delta.

    Note [a delta's base is its writer's]: a writer encodes against its own previous shard (the
    Checkpointer keeps it in host memory), and other shards may hold the same name with other
    bytes (each rank of a tensor group writes its piece under the parameter's name), so the base
    is the shard the same rank (``writer``) wrote at the base step."""
    enc = meta.get("encoding") if isinstance(meta, dict) else None
    entries = enc.get("tensors") if isinstance(enc, dict) else None
    deltas = [k for k, e in entries.items() if isinstance(e, dict) and e.get("delta")] if isinstance(entries, dict) else []
    if not deltas:
        return None
    base_step = enc.get("base_step")
    if not isinstance(base_step, int) or not 0 < base_step < manifest["step"]:
        raise CheckpointCorruptError(f"{where}: {deltas[0]!r} is a delta with no valid base step ({base_step!r})")
    try:
        base = cache.get(("manifest", base_step)) or read_manifest(ckpt_dir, base_step)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{where} is a delta against step {base_step}, which is not a "
                                     f"checkpoint any more ({exc})") from None
    cache[("manifest", base_step)] = base
    holder = next((e for e in base["shards"] if e["rank"] == writer), None)
    if holder is None:
        raise CheckpointCorruptError(f"{where}: base step {base_step} holds no {deltas[0]!r}")
    return base, holder


def _decoded(tensors, meta: dict, where: str, cache: dict, writer, bound: int | None):
    """The original tensors of an encoded shard whose base (``_base_of``) is decoded in ``cache``
    already (Note [chains resolve iteratively])."""
    if not (isinstance(meta, dict) and meta.get("encoding")):
        return tensors
    base_step = meta["encoding"].get("base_step") if isinstance(meta["encoding"], dict) else None

    def base_tensor(key: str) -> torch.Tensor:
        base = cache[("manifest", base_step)]  # _base_of read it before any delta is decoded
        holder = next((e for e in base["shards"] if e["rank"] == writer and _holds(e, _name_of(key))), None)
        if holder is None or key not in cache[("shard", base_step, holder["file"])][0]:
            raise CheckpointCorruptError(f"{where}: base step {base_step} holds no {key!r}")
        return cache[("shard", base_step, holder["file"])][0][key]

    return decode_shard(tensors, meta, base_tensor, where, bound)


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


def choose_shards(manifest: dict, program: Program, rank: int, needed: list[str]) -> ShardChoice:
    """Each needed parameter comes from this rank's own shard when the plan is the same and the
    shard holds it, otherwise from the lowest-rank shard that holds it (Note [checkpoint format];
    since format 2 a name is in one shard per data-parallel group, Note [one writer per byte])."""
    same_plan = (manifest.get("plan_hash") == program.plan_hash
                 and manifest.get("world_size") == program.world_size)
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


def _rng_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # the RNG states are views of the shard's bytes: set_rng_state wants tensors of its own
    return {k: v.clone() for k, v in tensors.items() if k.startswith("rng/")}


def load_for_rank(ckpt_dir: str, step: int, program: Program, rank: int, needed: list[str],
                  manifest: dict | None = None) -> LoadedCheckpoint:
    """Verify and read what ``rank`` of ``program`` needs from checkpoint ``step``. A field that
    passed ``check_meta`` and still breaks the stitching (a piece's span that contradicts the
    tensors) is CheckpointCorruptError too (Note [valid means restorable])."""
    try:
        return _load_for_rank(ckpt_dir, step, program, rank, needed, manifest)
    except (CheckpointCorruptError, PlanMismatchError, MissingPackageError):  # the last: Note [what the runtime needs]
        raise
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, RuntimeError) as exc:
        raise CheckpointCorruptError(f"checkpoint {os.path.join(ckpt_dir, step_dirname(step))} is malformed "
                                     f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def _load_for_rank(ckpt_dir: str, step: int, program: Program, rank: int, needed: list[str],
                   manifest: dict | None) -> LoadedCheckpoint:
    manifest = manifest or read_manifest(ckpt_dir, step)
    check_model(manifest, program, os.path.join(ckpt_dir, step_dirname(step)))
    check_declared_sizes(manifest, program, os.path.join(ckpt_dir, step_dirname(step)))
    choice = choose_shards(manifest, program, rank, needed)
    cache: dict = {}

    def read_one(e: dict):  # Note [bounded decompression]: no shard decodes to more than the plan allows
        return read_shard(ckpt_dir, manifest, e, cache, bound=program.shard_bytes_bound)

    read = {e["rank"]: read_one(e) for e in choice.entries}
    loaded = LoadedCheckpoint(step, manifest, {}, {}, {}, {}, None, None)
    sched = None
    for name in needed:
        tensors, meta = read[choice.param_source[name]["rank"]]
        take_state(loaded, name, tensors, meta, f"shard {choice.param_source[name]['file']} of step {step}")
        if meta.get("step") != step:
            raise CheckpointCorruptError(f"shard {choice.param_source[name]['file']} says step "
                                         f"{meta.get('step')}, its directory says {step}")
        sched = sched or meta.get("lr_scheduler")
    from runtime.resilience.checkpoint.tp_pieces import stitch_sharded_tp_state, stitch_tp_pieces  # Note [tensor-parallel pieces]

    stitch_sharded_tp_state(loaded, needed, read, manifest, read_one, step)
    read_missing_pieces(ckpt_dir, manifest, loaded, needed, read, step, bound=program.shard_bytes_bound)

    stitch_tp_pieces(loaded, needed, read, manifest, read_one, step)
    if choice.own is not None:
        rng_tensors, loaded.rng_meta = read[choice.own["rank"]]
        loaded.rng_tensors = _rng_of(rng_tensors)
        sched = loaded.rng_meta.get("lr_scheduler") or sched
    loaded.lr_scheduler = sched or {}
    return loaded


def read_missing_pieces(ckpt_dir: str, manifest: dict, loaded: LoadedCheckpoint, needed: list[str],
                        read: dict, step: int, *, bound: int | None = None) -> None:
    """Sharded optimizer state (Note [sharded optimizer state] in runtime/parallel/zero.py) is spread
    over the shards of a stage's replicas: for each name whose pieces do not cover it yet, read
    the other shards that hold it (verified as any shard) until they do."""
    sharded = any(k.startswith("optim_shard/") for tensors, _meta in read.values() for k in tensors)
    if not sharded:
        return
    for name in needed:
        if pieces_complete(loaded, name, sharded):
            continue
        for entry in sorted(manifest["shards"], key=lambda e: e["rank"]):
            if entry["rank"] in read or not _holds(entry, name):
                continue
            read[entry["rank"]] = read_shard(ckpt_dir, manifest, entry, bound=bound)
            tensors, meta = read[entry["rank"]]
            take_pieces(loaded, name, tensors, meta)
            if pieces_complete(loaded, name, sharded):
                break
        for rank, (tensors, meta) in read.items():  # shards read for an earlier name hold pieces too
            take_pieces(loaded, name, tensors, meta)
        if not pieces_complete(loaded, name, sharded):
            raise CheckpointCorruptError(f"checkpoint step {step}: the shards' optimizer pieces of {name!r} "
                                         "do not cover it (a replica's shard is missing)")


def find_valid(ckpt_dir: str, program: Program, rank: int, needed: list[str], *, warn=None,
               limit: int = RESUME_CANDIDATES, check=None) -> tuple[list[int], LoadedCheckpoint | None]:
    """Steps of the checkpoints valid for ``rank`` (manifest and the shards it reads verify and
    parse, ``check(loaded)`` raises no CheckpointCorruptError: Note [valid means restorable] in
    runtime/resilience/checkpoint/validate.py), newest first, and the newest one loaded.
    ``warn(message)`` hears of every one skipped (a partial or corrupt checkpoint, named); a
    checkpoint of another model raises PlanMismatchError (``check_model``)."""
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
            if check is not None:
                check(loaded)
        except CheckpointCorruptError as exc:
            if warn:
                warn(f"skipping checkpoint {where}: {exc}")
            continue
        valid.append(step)
        if newest is None:
            newest = loaded
    return valid, newest


def loaded_from_bytes(data, *, step: int, program: Program, rank: int, needed: list[str],
                      where: str) -> LoadedCheckpoint:
    """A verified own shard (the memory tier's bytes: a slot, a peer's copy, a reconstruction) as
    a LoadedCheckpoint, by the same reader as a disk shard."""
    tensors, meta = parse_verified(data, where)
    check_meta(meta, where)  # Note [valid means restorable]
    if meta.get("step") != step or meta.get("rank") != rank or meta.get("plan_hash") != program.plan_hash:
        raise CheckpointCorruptError(f"{where} is step {meta.get('step')} of rank {meta.get('rank')} "
                                     f"(plan {meta.get('plan_hash')}), wanted step {step} of rank {rank}")
    manifest = {"step": step, "plan_hash": program.plan_hash, "world_size": program.world_size,
                "num_stages": program.num_stages, "dp": program.dp}
    loaded = LoadedCheckpoint(step, manifest, {}, {}, {}, meta.get("lr_scheduler") or {}, _rng_of(tensors), meta)
    for name in needed:
        take_state(loaded, name, tensors, meta, where)
    return loaded
