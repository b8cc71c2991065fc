"""The "program" object of plan.json as frozen dataclasses: ``Program`` and its parts, validated
once when built (``Program.from_dict``), loaded once (``load_program``), read by attribute.

This module is the single definition of the object: every field below carries its meaning in the
comment beside it, and ``runtime/__init__.py`` points here instead of repeating them. The JSON on
disk keeps the same keys: ``Program.from_dict(json)`` reads what the compiler writes and
``to_dict()`` writes it back (the same dict, for what partitioner/codegen/lower.py emits).

Pure Python (no process group needed), so it is unit-tested in milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Mapping

from runtime.errors import PlanMismatchError
from runtime.file_trust import read_bounded
from runtime.program.layout import Layout
from runtime.program.schedules import PipelineSchedule, compiled_stages_refusal, schedule_named
from runtime.program.parts import (DataSpec, InitSpec, MemoryTierPlan, OptimizerSettings, Precision,
                                   RandomnessSpec, RankSpec, StageSpec, TieSpec, Values, check_positive, jsonable,
                                   known_keys)


# Note [program format]: the shape of plan.json's "program" object and of the folder around it.
# The runtime reads one format: a folder written by a compile of another (older ones have no
# "format_version"; format 1 kept each feature's value as its own key) is refused with the reason,
# recompile, never read as this one. Bump it whenever the object or the folder changes shape.
PROGRAM_FORMAT = 2


class ProgramFormatError(PlanMismatchError):
    """A program folder written in another format (Note [program format]): its message is the fix."""


def format_refusal(found) -> str:
    return (f"the program was written in program format {found or 1}, and this runtime reads format "
            f"{PROGRAM_FORMAT} (Note [program format] in runtime/program/spec.py): recompile it with "
            "`partitioner compile ... -o DIR`")


@dataclass(frozen=True, kw_only=True)
class Program:
    """Everything the runtime reads from plan.json: which rank runs which stage, how the batch is
    cut, the schedule, the data, the optimizer. Validated when built; see the module docstring.

    Fields are listed in the order plan.json writes them. plan_hash, model_fingerprint, workload
    and shard_bytes_bound are not in plan.json's "program" object: ``load_program`` takes them from
    the plan's top level (checkpoints record and check them).
    """

    world_size: int            # processes, = dp * ranks per pipeline
    num_stages: int
    dp: int                    # data-parallel replicas, each a whole pipeline
    num_microbatches: int      # per replica and step
    global_batch: int          # samples per step, over all replicas
    schedule: str              # plan.json's name; ``pipeline_schedule`` is its object (runtime/program/schedules.py)
    device: str = "cpu"        # "cpu" or "cuda" (rank r runs on cuda:LOCAL_RANK)
    backend: str = ""          # "gloo" / "nccl"; empty: gloo on cpu, nccl on cuda
    ranks: tuple[RankSpec, ...]     # one per rank, any order
    stages: tuple[StageSpec, ...]   # one per stage, in order
    ties: tuple[TieSpec, ...] = ()
    data: DataSpec
    optimizer: OptimizerSettings
    seed: int = 0              # random ops per microbatch and the host generators (seed + rank) derive from it
    collective_timeout_s: float = 600  # every collective and p2p op (Note [no hangs] in runtime/launch/rank.py)
    checkpoint_every: int = 0          # checkpoint every K steps (0: see mtbf_s, else only the last)
    sdc_every: int | None = None       # compare replica digests every K steps (0: never; None: runtime/resilience/sdc.py's
                                       # DEFAULT_EVERY); Note [replica digests]
    features: Values = dataclasses.field(default_factory=Values)  # each feature's entries, by setting key
                                       # (Note [one feature, one module] in runtime/features/__init__.py)
    predicted_step_time_s: float | None = None  # the plan's; printed beside the measured median at
                                                # the end of a run (Note [step time summary])
    peak_flops_per_s: float | None = None  # the datasheet peak of all the world's devices at the policy's
                                           # dtype, what MFU divides by (Note [model FLOPs and MFU] in
                                           # runtime/observe/watch.py); None: cpu, or kinds without one
    memory_tier: MemoryTierPlan | None = None
    precision: Precision = Precision.FP32     # Note [mixed precision] in runtime/execute/precision.py
    clip_grad_norm: float | None = None       # clip the global gradient norm to this (Note [global
                                              # gradient norm] in runtime/execute/grad_norm.py); None: off
    shard_optimizer: bool = False             # AdamW state sharded over the replicas (ZeRO-1, Note
                                              # [sharded optimizer state] in runtime/parallel/zero.py)
    tensor_parallel: int = 1                  # ranks per tensor group (Note [tensor-parallel stages]
                                              # in runtime/parallel/tensor_parallel.py)
    compile_stages: bool = False              # torch.compile each stage's forward (Note [compiled
                                              # stages] in runtime/execute/compile_stages.py)
    tp_sharded: dict | None = None            # parameter -> the dim its tensor group splits (tp > 1)
    randomness: RandomnessSpec | None = None  # present only when the compiler keyed random ops
    init: InitSpec | None = None              # present only for a model compiled on the meta device
    steps: int | None = None                  # steps to train; None: optimizer.total_steps
    plan_hash: str | None = None              # from plan.json's top level
    model_fingerprint: str | None = None      # from plan.json's top level
    workload: str | None = None               # from plan.json's top level
    shard_bytes_bound: int | None = None      # from the plan's stage memory: Note [declared sizes are bounded]
    mtbf_s: float | None = None               # --mtbf's default (a plan.json of an older compile: its "training")
    format_version: int = PROGRAM_FORMAT      # Note [program format]

    def __post_init__(self):
        for name in ("ranks", "stages", "ties"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "precision", Precision.of(self.precision))
        object.__setattr__(self, "features", _feature_table(self.features))
        if not self.backend:
            object.__setattr__(self, "backend", "gloo" if self.device == "cpu" else "nccl")
        _validate(self)

    # -- JSON -----------------------------------------------------------------------------------

    @staticmethod
    def from_dict(data: dict) -> "Program":
        """plan.json's "program" object (or a hand-written one) -> Program; raises ValueError
        naming the value and the fix."""
        if data.get("format_version", PROGRAM_FORMAT) != PROGRAM_FORMAT:
            raise ValueError(format_refusal(data.get("format_version")))
        keys = known_keys(Program, data, "the program object")
        keys["ranks"] = tuple(RankSpec.from_dict(e, f"ranks[{i}]") for i, e in enumerate(keys["ranks"]))
        keys["stages"] = tuple(StageSpec.from_dict(e, f"stages[{i}]") for i, e in enumerate(keys["stages"]))
        keys["ties"] = tuple(TieSpec.from_dict(e, f"ties[{i}]") for i, e in enumerate(keys.get("ties", ())))
        keys["data"] = DataSpec.from_dict(keys["data"])
        keys["optimizer"] = OptimizerSettings.from_dict(keys["optimizer"])
        for name, part in (("memory_tier", MemoryTierPlan), ("randomness", RandomnessSpec), ("init", InitSpec)):
            if keys.get(name) is not None:
                keys[name] = part.from_dict(keys[name])
        return Program(**keys)

    def to_dict(self) -> dict:
        """The JSON object, same keys as plan.json; fields that are None are left out."""
        # The precision and sharding fields are written only when not the default, so a program
        # compiled before them round-trips unchanged.
        quiet = {"precision": Precision.FP32, "shard_optimizer": False, "tensor_parallel": 1, "compile_stages": False,
                 "features": {}}
        return {f.name: jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None
                and not (f.name in quiet and getattr(self, f.name) == quiet[f.name])}

    # -- What the runtime derives ---------------------------------------------------------------

    @functools.cached_property
    def layout(self) -> "Layout":
        return Layout.from_program(self)

    @functools.cached_property
    def pipeline_schedule(self) -> PipelineSchedule:
        """``schedule`` (plan.json's name) as its object, what the runtime asks (Note [one class per schedule])."""
        return schedule_named(self.schedule, self.num_stages // self.layout.pp_size)

    @property
    def steps_to_train(self) -> int:
        return self.optimizer.total_steps if self.steps is None else self.steps

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch: the global batch is cut into dp * num_microbatches equal parts."""
        return self.global_batch // (self.dp * self.num_microbatches)

    def rank(self, rank: int) -> RankSpec:
        for entry in self.ranks:
            if entry.rank == rank:
                return entry
        raise ValueError(f"rank {rank} is not in the program (world_size={self.world_size})")

    def params_of(self, stages) -> list[str]:
        """The trained parameters of ``stages``, in stage order, a tie's name once."""
        return list(dict.fromkeys(n for k in sorted(stages) for n in self.stages[k].params))


def _feature_table(entries) -> Values:
    """The program's "features": setting key -> a JSON scalar; each feature checks its own values
    when it reads them (runtime/features/, whose modules this room may not import)."""
    if not isinstance(entries, Mapping) or not all(
            isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))) for k, v in entries.items()):
        raise ValueError(f"features = {entries!r} must be a table of setting keys to values: recompile the program")
    return Values(entries)


def _validate(program: Program) -> None:
    """Consistency of a Program (its parts checked themselves); ValueError naming values and fix."""
    schedule_named(program.schedule)  # raises naming the schedules there are
    for name in ("world_size", "num_stages", "dp", "num_microbatches", "global_batch", "tensor_parallel"):
        check_positive(getattr(program, name), name)
    if program.sdc_every is not None and (not isinstance(program.sdc_every, int) or program.sdc_every < 0):
        raise ValueError(f"sdc_every={program.sdc_every!r}: give a number of steps >= 0 (0: no replica check)")
    if program.clip_grad_norm is not None and (isinstance(program.clip_grad_norm, bool)
                                               or not isinstance(program.clip_grad_norm, (int, float))
                                               or not program.clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm {program.clip_grad_norm!r} must be a positive number or null (off)")
    if program.compile_stages and (why := compiled_stages_refusal(program.schedule)):
        raise ValueError(why)
    if program.device not in ("cpu", "cuda"):
        raise ValueError(f"device {program.device!r} is not 'cpu' or 'cuda'")
    world, p, dp, m = program.world_size, program.num_stages, program.dp, program.num_microbatches
    if len(program.stages) != p:
        raise ValueError(f"num_stages={p} but {len(program.stages)} stage entries")
    for i, st in enumerate(program.stages):
        if st.index != i:
            raise ValueError(f"stages[{i}] has index {st.index}: stages must be listed in order")
    if len(program.ranks) != world:
        raise ValueError(f"world_size={world} but {len(program.ranks)} rank entries")
    b = program.global_batch
    if b % (dp * m):
        raise ValueError(f"global_batch={b} is not divisible by dp*num_microbatches={dp}*{m}: "
                         "choose a batch that is a multiple of dp*num_microbatches")
    micro = b // (dp * m)
    for st in program.stages:
        for arg in st.inputs + st.outputs:
            if arg.batch_dim is not None and arg.shape[arg.batch_dim] != micro:
                raise ValueError(
                    f"stage {st.index} {arg.name} has shape {list(arg.shape)} (batch_dim {arg.batch_dim}) "
                    f"but the microbatch is global_batch/(dp*num_microbatches) = {b}/({dp}*{m}) = {micro}")
    stages = program.stages
    for k in range(1, p):
        sent = [(list(a.shape), a.dtype) for a in stages[k - 1].outputs]
        received = [(list(a.shape), a.dtype) for a in stages[k].inputs]
        if sent != received:
            raise ValueError(f"stage {k - 1} sends {sent} but stage {k} receives {received}: each "
                             "stage's inputs must be the previous stage's outputs, in order")
    for tie in program.ties:
        if len(tie.stages) < 2 or not all(0 <= s < p for s in tie.stages):
            raise ValueError(f"tie {tie.to_dict()} must name two or more stages among 0..{p - 1}")
        lacking = [s for s in tie.stages if tie.param not in stages[s].params]
        if lacking:
            raise ValueError(f"tie of {tie.param!r} names stages {lacking}, which do not list it in "
                             "params (only trained parameters are ties; a buffer read on several "
                             "stages is held by each): recompile the program")
    holder: dict[str, int] = {}
    for st in stages:
        for name in st.mutable_buffers:
            if name in holder:
                raise ValueError(
                    f"mutable buffer {name!r} is listed by stages {holder[name]} and {st.index}: the "
                    "forward updates it, so one stage must hold it (Note [mutable buffers] in "
                    "partitioner/codegen/split.py); recompile the program")
            holder[name] = st.index
    layout = program.layout  # raises if the rank layout is inconsistent
    # Note [only runnable plans] in partitioner/solver/problem.py: the solver never emits these,
    # but a hand-edited or hand-written program must fail here, in words, not inside every rank.
    schedule = program.pipeline_schedule
    refusal = schedule.refusal(p, m)
    if refusal is not None:
        raise ValueError(f"{refusal}: recompile with {schedule.fix(p)}")


# ---------------------------------------------------------------------------------------------
# Loading


def load_plan(folder: str) -> dict:
    path = os.path.join(folder, "plan.json")
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} not found: is {folder!r} a program folder written by "
                                "`partitioner compile -o DIR`?")
    return json.loads(read_bounded(path, follow=True))  # a FIFO or a huge file is refused (Note [files are not trusted])


# Note [folder integrity]: plan_hash covers the plan (stages, cuts, memory); the runtime executes
# plan.json's "program" object (optimizer, data and loss specs, timeouts) and the files the folder
# holds. ``program_hash`` is the sha256 of all of plan.json but itself, "program" and the "files"
# map of every file's sha256 included; the runtime recomputes it and refuses a plan.json without
# it or without a file map, a file that does not hash as listed, and an unlisted file Python could
# import (.py, .pyc, .so, .pth) anywhere in the folder. Hand-written folders (tests) are sealed by
# the same writer (``seal_folder``): there is no "unhashed" marker, since anyone who can edit
# plan.json could write it too. This catches edits and mistakes, not an attacker who rewrites
# plan.json whole: README "Trust model".

IMPORTABLE = (".py", ".pyc", ".so", ".pyd", ".pth")
# What a run writes into the folder (run/, checkpoints/) and compile_stats.json: not hashed.
UNHASHED = ("compile_stats.json",)


def program_hash(plan: dict) -> str:
    """sha256 of plan.json's content less its "program_hash" key (Note [folder integrity])."""
    body = {k: v for k, v in plan.items() if k != "program_hash"}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def file_digests(folder: str, names=None) -> dict[str, str]:
    """{relative path: sha256} of ``names`` (default: every file in ``folder`` except plan.json
    and UNHASHED, __pycache__ and the run's own output)."""
    if names is None:
        names = []
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and (root != folder or d not in ("run", "checkpoints")))
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), folder)
                if rel != "plan.json" and rel not in UNHASHED:
                    names.append(rel)
    out = {}
    for rel in sorted(names):
        with open(os.path.join(folder, rel), "rb") as f:
            out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def seal_plan(body: dict, files: dict[str, str]) -> dict:
    """``body`` with its "files" map and "program_hash" set (the one writer, Note [folder integrity])."""
    body = dict(body)
    body.pop("program_hash", None)
    body["files"] = dict(sorted(files.items()))
    body["program_hash"] = program_hash(body)
    return body


def seal_folder(folder: str) -> dict:
    """Rewrite ``folder``/plan.json with the digests of the files now in the folder (hand-written
    test folders; the compiler seals through ``seal_plan``). Returns the new plan."""
    plan = load_plan(folder)
    plan = seal_plan(plan, file_digests(folder))
    with open(os.path.join(folder, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1, sort_keys=True)
        f.write("\n")
    return plan


def verify_files(folder: str, plan: dict) -> None:
    """plan.json must carry its file map and program_hash, every listed file must hash as listed,
    and no unlisted importable file may sit in the folder (Note [folder integrity])."""
    recompile = f"recompile with `partitioner compile ... -o {folder}`"
    listed = plan.get("files")
    if not isinstance(listed, dict) or not listed:
        raise PlanMismatchError(f"{folder}/plan.json lists no \"files\" (each file's sha256): the folder "
                                f"cannot be checked; {recompile}")
    stated = plan.get("program_hash")
    if not stated:
        raise PlanMismatchError(f"{folder}/plan.json has no \"program_hash\": {recompile}")
    if stated != program_hash(plan):
        raise PlanMismatchError(f"{folder}/plan.json was edited after it was written (its program_hash "
                                f"{stated[:16]} does not match its content): {recompile}")
    bad = []
    for name, digest in sorted(listed.items()):
        path = os.path.join(folder, name)
        if os.path.isabs(name) or ".." in name.split("/") or not os.path.isfile(path):
            bad.append(f"{name} (missing)")
            continue
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                bad.append(f"{name} (changed)")
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder)
            if name.endswith(IMPORTABLE) and rel not in listed:
                bad.append(f"{rel} (not listed)")
    if bad:
        raise PlanMismatchError(
            f"{folder} does not match its plan {plan.get('plan_hash')}: {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; {recompile}"
        )


# Note [declared sizes are bounded]: a manifest may declare any size for a shard, and a sparse file
# of that size costs nothing on disk: a declared 64 GiB shard was read (allocated, hashed) before
# anything found it absurd. A shard holds at most what one rank's stages keep, parameters, AdamW
# state and buffers, which the plan's stage memory states (plan.json's stages[].memory). So the
# bound is twice their sum over every stage (a shard holds at most one copy of each; twice: lossless
# frames and dtype widening) plus 64 MiB for headers, meta and RNG states, and a checkpoint whose
# manifest declares more is not valid, decided from the manifest alone
# (runtime/resilience/checkpoint/load.py ``check_declared_sizes``). A plan without stage memory (a
# hand-written folder) has no bound.
SHARD_SLACK_BYTES = 64 << 20


def shard_bytes_bound(plan: dict) -> int | None:
    """The most bytes one checkpoint shard of ``plan`` can hold (Note [declared sizes are bounded])."""
    total = 0
    for stage in plan.get("stages") or ():
        memory = stage.get("memory") if isinstance(stage, dict) else None
        if not isinstance(memory, dict):
            return None
        parts = [memory.get(k, 0) for k in ("params_bytes", "optimizer_bytes", "buffers_bytes")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in parts):
            return None
        total += sum(parts)
    return 2 * total + SHARD_SLACK_BYTES if total else None


def load_program(folder: str) -> Program:
    """plan.json's "program" object as a validated Program, after checking every file's hash;
    the plan's top-level plan_hash, model_fingerprint and workload included."""
    plan = load_plan(folder)
    verify_files(folder, plan)
    if "program" not in plan:
        raise ValueError(f"{folder}/plan.json has no \"program\" object (keys: {sorted(plan)})")
    data = dict(plan["program"])
    if data.get("format_version") != PROGRAM_FORMAT:  # Note [program format]: never misread
        raise ProgramFormatError(f"{folder}: {format_refusal(data.get('format_version'))}")
    data.setdefault("plan_hash", plan.get("plan_hash"))
    # What checkpoints record and check (runtime/resilience/checkpoint/manifest.py), from the plan's top level.
    data.setdefault("model_fingerprint", plan.get("model_fingerprint"))
    data.setdefault("workload", plan.get("workload"))
    data.setdefault("shard_bytes_bound", shard_bytes_bound(plan))
    older = plan.get("training") or {}  # an older compile kept mtbf_s in the user's settings only
    if "mtbf_s" not in data and older.get("mtbf_s") is not None:
        data["mtbf_s"] = older["mtbf_s"]
    try:
        return Program.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{folder}/plan.json: {exc}") from None
