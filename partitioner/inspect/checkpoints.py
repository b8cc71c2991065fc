"""`partitioner inspect` of checkpoints: every step_N directory of a checkpoint folder, whether
it is a checkpoint (and if not, why), and which one a resume would pick.

Verification is the runtime's own (runtime.resilience.checkpoint: read_manifest, read_shard, check_model),
so what this prints is what `partitioner run` would decide (Note [checkpoint format] and Note
[recovery agreement] in runtime/). Statuses:

    valid       the manifest and every shard it lists verify (size, sha256, parse)
    partial     no manifest.json: never committed (a crash or kill while writing it)
    corrupt     the manifest fails its checksum, or a shard is missing, truncated or altered
    unreadable  the filesystem refused a read (permissions, I/O error)
    unchecked   no plan beside the folder (or one without stage memory), and a lossless shard
                declares more than inspect decompresses without one (Note [bounded decompression]
                in runtime/resilience/checkpoint/delta.py): inspect the program folder to check it
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from partitioner.inspect.units import human_bytes, render_columns
from runtime.file_trust import open_regular
from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint.delta import UNPLANNED_DECODE_BYTES, DecodeBoundError
from runtime.errors import CheckpointCorruptError, PlanMismatchError
from runtime.program.spec import Program, load_plan, shard_bytes_bound

_STEP = re.compile(r"^step_(\d{9,})$")
_RESUME_LIMIT = ck.RESUME_CANDIDATES  # a resume looks at the newest ones only


def is_step_dir(path: str | Path) -> bool:
    return bool(_STEP.match(Path(path).name)) and Path(path).is_dir()


def is_checkpoint_dir(path: str | Path) -> bool:
    """A folder of step_N (or discarded_step_N) directories."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(_STEP.match(n.removeprefix("discarded_")) and os.path.isdir(os.path.join(path, n))
               for n in names)


def program_of(folder: str | Path) -> Program:
    """What check_model compares, from a program folder's plan.json (no file hashing)."""
    path = os.path.join(folder, "plan.json")
    fix = "recompile the folder with `partitioner compile`, or move plan.json aside to list the checkpoints without it"
    try:
        plan = load_plan(str(folder))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past the parser
        raise ValueError(f"{path}: not a plan.json (not JSON text): {fix}") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("program"), dict):
        raise ValueError(f"{path}: has no \"program\" object: {fix}")
    program = dict(plan["program"])
    for key in ("plan_hash", "model_fingerprint", "workload"):
        program.setdefault(key, plan.get(key))
    program.setdefault("shard_bytes_bound", shard_bytes_bound(plan))  # as a resume bounds reads (load_program)
    try:
        return Program.from_dict(program)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path}: {exc}: {fix}") from None


def _files(where: str) -> list[tuple[str, int]]:
    out = []
    for entry in os.scandir(where):
        if entry.is_file(follow_symlinks=False):
            out.append((entry.name, entry.stat(follow_symlinks=False).st_size))
    return sorted(out)


def _shard_header_meta(path: str) -> dict:
    """The "meta" JSON of a safetensors shard, from its header only (no tensor data)."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:  # a FIFO or link would hang or mislead (Note [files are not trusted])
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n < 1 << 26:
                return {}
            header = json.loads(fh.read(n))
        return json.loads(header["__metadata__"]["meta"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _short(message: str, where: str) -> str:
    return message.replace(where + os.sep, "")


def examine(ckpt_dir: str, step: int, program: Program | None = None) -> dict:
    """One step directory: status, reason, size and what its manifest says."""
    where = os.path.join(ckpt_dir, ck.step_dirname(step))
    info = {"step": step, "dir": where, "status": "valid", "valid": False, "reason": None, "problems": [],
            "bytes": 0, "files": 0, "shards": None, "plan_hash": None, "model_fingerprint": None,
            "workload": None, "world_size": None, "num_stages": None, "dp": None, "created_unix": None,
            "same_plan": None, "same_model": None}
    try:
        files = _files(where)
        info["created_unix"] = os.stat(where).st_mtime
    except OSError as exc:
        return {**info, "status": "unreadable", "reason": f"cannot list {where}: {exc.strerror or exc}"}
    info["bytes"], info["files"] = sum(size for _, size in files), len(files)
    names = {name for name, _ in files}
    try:
        manifest = ck.read_manifest(ckpt_dir, step)
    except OSError as exc:
        return {**info, "status": "unreadable", "reason": f"{ck.MANIFEST}: {exc.strerror or exc}"}
    except CheckpointCorruptError as exc:
        if os.path.lexists(os.path.join(where, ck.MANIFEST)):  # there but refused (a FIFO, a link, too big)
            return {**info, "status": "corrupt", "reason": _short(str(exc), where)}
        shards = sorted(n for n in names if n.startswith("shard_rank_") and n.endswith(".safetensors"))
        temps = sorted(n for n in names if n.endswith(".tmp"))
        meta = _shard_header_meta(os.path.join(where, shards[0])) if shards else {}
        info.update(plan_hash=meta.get("plan_hash"), model_fingerprint=meta.get("model_fingerprint"),
                    shards=len(shards))
        written = f"{len(shards)} shard file{'s' * (len(shards) != 1)}"
        if temps:
            written += f" and {len(temps)} unfinished .tmp"
        return {**info, "status": "partial",
                "reason": f"no {ck.MANIFEST}: never committed ({written}; a crash or kill during the write)"}
    info.update({k: manifest.get(k) for k in ("plan_hash", "model_fingerprint", "workload", "world_size",
                                               "num_stages", "dp", "created_unix")})
    info["shards"] = len(manifest.get("shards", []))
    status = "valid"
    try:  # before any shard is read (Note [declared sizes are bounded])
        if program is not None:
            ck.check_declared_sizes(manifest, program, where)
        entries = manifest.get("shards", [])
    except CheckpointCorruptError as exc:
        status, entries = "corrupt", []
        info["problems"].append(_short(str(exc), where))
    # what a resume decodes of a shard at most (Note [bounded decompression]); a plan that states no
    # stage memory (or none) bounds nothing, and inspect decodes at most its own cap
    planned = program is not None and program.shard_bytes_bound is not None
    bound = program.shard_bytes_bound if planned else UNPLANNED_DECODE_BYTES
    for entry in entries:
        try:
            ck.read_shard(ckpt_dir, manifest, entry, bound=bound)
        except OSError as exc:
            status = "unreadable" if status == "valid" else status
            info["problems"].append(f"{entry['file']}: {exc.strerror or exc}")
        except DecodeBoundError as exc:
            if planned:
                status = "corrupt"
                info["problems"].append(_short(str(exc), where))
            else:
                status = "unchecked" if status == "valid" else status
                info["problems"].append(f"{_short(exc.where, where)}: its tensors declare {exc.declared} bytes "
                                        f"decoded, more than the {exc.bound} inspect decompresses without a plan "
                                        "that bounds them: inspect the program folder (DIR --checkpoints)")
        except CheckpointCorruptError as exc:
            status = "corrupt"
            info["problems"].append(_short(str(exc), where))
    info["status"], info["valid"] = status, status == "valid"
    if info["problems"]:
        info["reason"] = "; ".join(info["problems"])
    if program is not None:
        info["same_plan"] = manifest.get("plan_hash") == program.plan_hash
        try:
            ck.check_model(manifest, program, where)
            info["same_model"] = True
        except PlanMismatchError:
            info["same_model"] = False
    return info


def scan(ckpt_dir: str | Path, *, program: Program | None = None, step: int | None = None) -> dict:
    """Every step directory of ``ckpt_dir`` (or only ``step``), newest first, and the resume pick:
    what runtime.resilience.recovery.recover would restore for a program of the same plan (``program``:
    plan.json's program object, to say whether a resume would accept them at all)."""
    ckpt_dir = str(ckpt_dir)
    steps = ck.list_step_dirs(ckpt_dir)
    if step is not None:
        steps = [s for s in steps if s == step]
    entries = [examine(ckpt_dir, s, program) for s in steps]
    out = {"checkpoint_dir": os.path.abspath(ckpt_dir), "program_plan_hash": program.plan_hash if program else None,
           "checkpoints": entries, "discarded": [], "resume": None}
    try:
        out["discarded"] = sorted(n for n in os.listdir(ckpt_dir)
                                  if n.startswith("discarded_") and _STEP.match(n.removeprefix("discarded_")))
    except OSError:
        pass
    if step is None:
        out["resume"] = resume_choice(entries)
    for e in entries:
        e["resume"] = out["resume"] is not None and out["resume"]["step"] == e["step"]
    return out


def resume_choice(entries: list[dict]) -> dict:
    """recover()'s choice on one plan: the newest of the first 64 whose manifest and shards
    verify; the first (newest) one with a valid manifest of another model stops the resume."""
    skipped = []
    for e in entries[:_RESUME_LIMIT]:
        manifest_ok = e["status"] == "valid" or (e["status"] in ("corrupt", "unreadable") and e["problems"])
        if manifest_ok and e["same_model"] is False:
            return {"step": None, "refused": True, "skipped": skipped,
                    "text": f"a resume stops: step {e['step']} is a checkpoint of another model "
                            f"({e['model_fingerprint']}, workload {e['workload']!r}); pass "
                            "--checkpoint-dir with this model's checkpoints (or an empty folder)"}
        if e["valid"]:
            return {"step": e["step"], "dir": e["dir"], "refused": False, "skipped": skipped,
                    "text": f"a resume picks step {e['step']} ({e['dir']})"
                            + (f"; it first sets aside the {len(skipped)} newer invalid one{'s' * (len(skipped) > 1)} "
                               "as discarded_step_*"
                               if skipped else "")}
        skipped.append(e["step"])
    return {"step": None, "refused": False, "skipped": skipped,
            "text": "a resume starts from step 0: no valid checkpoint" + (" among the newest 64"
                                                                          if len(entries) > _RESUME_LIMIT else "")}


def _created(unix: float | None) -> str:
    return "-" if unix is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def text(listing: dict) -> str:
    entries = listing["checkpoints"]
    valid = sum(e["valid"] for e in entries)
    head = f"checkpoints in {listing['checkpoint_dir']}"
    if listing["program_plan_hash"]:
        head += f" (program plan {listing['program_plan_hash']})"
    lines = [f"{head}: {len(entries)} step dir{'s' * (len(entries) != 1)}, {valid} valid, newest first"]
    if not entries:
        lines.append("  none")
    else:
        rows = []
        for e in entries:
            layout = "-" if e["num_stages"] is None else f"{e['num_stages']} x {e['dp']}"
            plan = e["plan_hash"] or "-"
            if e["same_plan"] is False:
                plan += " (other plan)" if e["same_model"] else " (other model)"
            rows.append([("> " if e["resume"] else "  ") + str(e["step"]), e["status"], human_bytes(e["bytes"]),
                         plan, str(e["workload"] or "-"), str(e["world_size"] or "-"), layout,
                         str(e["shards"] if e["shards"] is not None else "-"), _created(e["created_unix"])])
        table = render_columns(["  step", "status", "size", "plan", "workload", "ranks", "stages x dp", "shards",
                                 "created"], [""] * 9, rows, "><><<>>><")
        lines.append(table[0])
        for e, row in zip(entries, table[1:]):
            lines.append(row)
            for problem in (e["problems"] or ([e["reason"]] if e["reason"] else [])):
                lines.append(f"{'':8}{problem}")
    if listing["discarded"]:
        lines.append(f"set aside by an earlier recovery (pruned by the next checkpoint): "
                     f"{', '.join(listing['discarded'])}")
    if listing["resume"] is not None:
        lines.append(("" if listing["resume"]["refused"] else "> ") + listing["resume"]["text"])
    return "\n".join(lines)
