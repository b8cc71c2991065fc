"""The "program" object of plan.json as frozen dataclasses: ``Program`` and its parts, validated
once when built (``Program.from_dict``), loaded once (``load_program``), read by attribute.

This module is the single definition of the object: every field below carries its meaning in the
comment beside it, and ``runtime/__init__.py`` points here instead of repeating them. The JSON on
disk keeps the same keys: ``Program.from_dict(json)`` reads what the compiler writes and
``to_dict()`` writes it back (the same dict, for what partitioner/lower.py emits).

Pure Python (no process group needed), so it is unit-tested in milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from runtime.errors import PlanMismatchError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
LR_SCHEDULES = ("cosine", "linear", "constant")


# ---------------------------------------------------------------------------------------------
# JSON <-> dataclass, one rule for every part


def _known(cls, data: Any, where: str, *, rename: dict[str, str] | None = None) -> dict:
    """``data``'s keys as ``cls``'s field names; unknown or missing keys raise naming both."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__} {data!r}")
    rename = rename or {}
    names = {f.name for f in dataclasses.fields(cls)}
    keys = {rename.get(k, k): v for k, v in data.items()}
    unknown = sorted(k for k in data if rename.get(k, k) not in names)
    if unknown:
        back = {v: k for k, v in rename.items()}
        known = sorted(back.get(n, n) for n in names)
        raise ValueError(f"{where} has unknown keys {unknown}; known keys are {known}: "
                         "recompile the program with this version of partitioner")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [{v: k for k, v in rename.items()}.get(n, n) for n in required if n not in keys]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    return keys


def _ints(values, where: str) -> tuple[int, ...]:
    values = tuple(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where} must be a list of integers, got {list(values)}")
    return values


def _positive(value, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")


def _callable_spec(spec, where: str):
    """"pkg.mod:fn" stays a string; ["pkg.mod:fn", {kwargs}] becomes a tuple (frozen)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)) and spec and isinstance(spec[0], str) and len(spec) <= 2 \
            and (len(spec) == 1 or isinstance(spec[1], dict)):
        return tuple(spec)
    raise ValueError(f"{where} must be \"module:function\" or [\"module:function\", {{kwargs}}], "
                     f"got {spec!r}")


def _json(value):
    """A field's JSON form: tuples become lists, parts become their dicts."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------------
# The parts


@dataclass(frozen=True)
class TensorSpec:
    """One activation crossing a stage boundary (a stage's input or output), for ONE microbatch."""

    name: str              # the activation's name in the stage file (INPUTS / OUTPUTS)
    shape: tuple[int, ...]  # for one microbatch = global_batch / (dp * num_microbatches) rows
    dtype: str             # a torch dtype name, "float32" or "torch.float32"
    batch_dim: int | None = 0  # the microbatch dimension; None: the same for every sample (rotary
                               # tables, masks): it crosses whole, never split by batch

    def __post_init__(self):
        object.__setattr__(self, "shape", _ints(self.shape, f"tensor {self.name!r} shape"))
        if self.batch_dim is not None and not 0 <= self.batch_dim < max(1, len(self.shape)):
            raise ValueError(f"tensor {self.name!r} has batch_dim {self.batch_dim} but shape "
                             f"{list(self.shape)}: use a dimension of the shape, or null")

    @staticmethod
    def from_dict(data: dict, where: str = "tensor") -> "TensorSpec":
        return TensorSpec(**_known(TensorSpec, data, where))

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "batch_dim": self.batch_dim}


@dataclass(frozen=True)
class StageSpec:
    """One stage: the module stage_<index>.py and what crosses its boundaries."""

    index: int                          # stages are listed in order: stages[k].index == k
    module: str                         # "stage_<k>": DIR/<module>.py
    class_name: str                     # JSON key "class": the nn.Module class in that file
    params: tuple[str, ...]             # trained parameters, ORIGINAL dotted names
    inputs: tuple[TensorSpec, ...]      # stage 0: make_batch's args; stage k: stage k-1's outputs
    outputs: tuple[TensorSpec, ...]
    mutable_buffers: tuple[str, ...] = ()  # buffers forward updates in place (BatchNorm running
                                           # statistics); each on one stage only (Note [mutable
                                           # buffers] in partitioner/codegen/split.py)

    def __post_init__(self):
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "mutable_buffers", tuple(self.mutable_buffers))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    @staticmethod
    def from_dict(data: dict, where: str = "stage") -> "StageSpec":
        keys = _known(StageSpec, data, where, rename={"class": "class_name"})
        for side in ("inputs", "outputs"):
            keys[side] = tuple(TensorSpec.from_dict(a, f"{where} {side}[{i}]")
                               for i, a in enumerate(keys[side]))
        return StageSpec(**keys)

    def to_dict(self) -> dict:
        return {"index": self.index, "module": self.module, "class": self.class_name,
                "params": list(self.params), "mutable_buffers": list(self.mutable_buffers),
                "inputs": _json(self.inputs), "outputs": _json(self.outputs)}


@dataclass(frozen=True)
class RankSpec:
    """One process. In each replica's pipeline (its ranks in ascending order) the rank at position
    j holds stages j, j+pp, j+2pp, ... (what torch.distributed.pipelining assumes; checked)."""

    rank: int
    stages: tuple[int, ...]  # the stages it holds (one, or several under "interleaved")
    replica: int             # its data-parallel replica, 0..dp-1

    def __post_init__(self):
        object.__setattr__(self, "stages", _ints(self.stages, f"rank {self.rank} stages"))

    @staticmethod
    def from_dict(data: dict, where: str = "rank") -> "RankSpec":
        return RankSpec(**_known(RankSpec, data, where))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stages": list(self.stages), "replica": self.replica}


@dataclass(frozen=True)
class TieSpec:
    """One trained parameter with a copy on several stages; its gradient is summed over the
    copies each step (then averaged over dp)."""

    param: str
    stages: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "stages", _ints(self.stages, f"tie of {self.param!r} stages"))

    @staticmethod
    def from_dict(data: dict, where: str = "tie") -> "TieSpec":
        return TieSpec(**_known(TieSpec, data, where))

    def to_dict(self) -> dict:
        return {"param": self.param, "stages": list(self.stages)}


@dataclass(frozen=True)
class DataSpec:
    """Where the ranks find the data: ``"module:function"`` or ``["module:function", {kwargs}]``;
    the module may also be a .py path relative to DIR (``resolve_callable``)."""

    make_batch: str | tuple  # make_batch(step, global_batch) -> (args, target), target batch on dim 0
    loss_fn: str | tuple     # loss_fn(output, target): a mean over its microbatch

    def __post_init__(self):
        object.__setattr__(self, "make_batch", _callable_spec(self.make_batch, "data.make_batch"))
        object.__setattr__(self, "loss_fn", _callable_spec(self.loss_fn, "data.loss_fn"))

    @staticmethod
    def from_dict(data: dict, where: str = "data") -> "DataSpec":
        return DataSpec(**_known(DataSpec, data, where))

    def to_dict(self) -> dict:
        return {"make_batch": _json(self.make_batch), "loss_fn": _json(self.loss_fn)}


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and its learning-rate schedule (runtime/train.py ``make_optimizer``, ``lr_factor``)."""

    lr: float
    name: str = "adamw"                       # only "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0                     # linear warmup; step 0 gets lr/warmup_steps
    lr_schedule: str = "constant"             # "cosine" | "linear" | "constant" after warmup
    total_steps: int = 1                      # where cosine/linear reach min_lr_ratio * lr
    min_lr_ratio: float = 0.0
    fused: bool | None = None                 # None: the fused kernel where torch has it
    foreach: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.name.lower() != "adamw":
            raise ValueError(f"optimizer {self.name!r} is not supported (only 'adamw')")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} is not one of {LR_SCHEDULES}")

    @staticmethod
    def from_dict(data: dict, where: str = "optimizer") -> "OptimizerSettings":
        return OptimizerSettings(**_known(OptimizerSettings, data, where))

    @staticmethod
    def coerce(cfg: "OptimizerSettings | dict") -> "OptimizerSettings":
        return cfg if isinstance(cfg, OptimizerSettings) else OptimizerSettings.from_dict(cfg)

    def to_dict(self) -> dict:
        out = {"name": self.name, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
               "weight_decay": self.weight_decay, "warmup_steps": self.warmup_steps,
               "lr_schedule": self.lr_schedule, "total_steps": self.total_steps}
        # Written only when set, so the compiler's object round-trips unchanged.
        if self.min_lr_ratio:
            out["min_lr_ratio"] = self.min_lr_ratio
        out.update({k: getattr(self, k) for k in ("fused", "foreach") if getattr(self, k) is not None})
        return out


@dataclass(frozen=True)
class MemoryTierPlan:
    """The plan's choice of memory-tier snapshots (runtime/memtier; flags override it)."""

    mode: str                   # "auto" | "none" | "copy" | "parity" (runtime/memtier)
    every: int = 1              # snapshot every K steps
    group_size: int | None = None  # hosts per parity group

    @staticmethod
    def from_dict(data: dict, where: str = "memory_tier") -> "MemoryTierPlan":
        return MemoryTierPlan(**_known(MemoryTierPlan, data, where))

    def to_dict(self) -> dict:
        return {"mode": self.mode, "every": self.every, "group_size": self.group_size}


@dataclass(frozen=True)
class RandomnessSpec:
    """The random ops the compiler keyed (Note [randomness keyed by meaning] in
    runtime/randomness.py); verify then picks the keyed oracle."""

    keyed_ops: tuple[str, ...]  # node names

    def __post_init__(self):
        object.__setattr__(self, "keyed_ops", tuple(self.keyed_ops))

    @staticmethod
    def from_dict(data: dict, where: str = "randomness") -> "RandomnessSpec":
        return RandomnessSpec(**_known(RandomnessSpec, data, where))

    def to_dict(self) -> dict:
        return {"keyed_ops": list(self.keyed_ops)}


@dataclass(frozen=True)
class InitRecipe:
    """How a rank draws one parameter of a model compiled on the meta device
    (Note [materialize per rank] in runtime/materialize.py)."""

    shape: tuple[int, ...]
    dtype: str
    init: str                  # "normal" | "uniform" | "zeros" | "ones"
    std: float | None = None   # normal
    bound: float | None = None  # uniform: U(-bound, bound)

    def __post_init__(self):
        object.__setattr__(self, "shape", _ints(self.shape, "init recipe shape"))

    @staticmethod
    def from_dict(data: dict, where: str = "init recipe") -> "InitRecipe":
        return InitRecipe(**_known(InitRecipe, data, where))

    def to_dict(self) -> dict:
        out = {"shape": list(self.shape), "dtype": self.dtype, "init": self.init}
        out.update({k: getattr(self, k) for k in ("std", "bound") if getattr(self, k) is not None})
        return out


@dataclass(frozen=True)
class InitSpec:
    """Present when the model was compiled on the meta device (DIR/weights/ then has no files)."""

    seed: int
    params: dict[str, InitRecipe]  # original name -> recipe (parameters and buffers)

    @staticmethod
    def from_dict(data: dict, where: str = "init") -> "InitSpec":
        keys = _known(InitSpec, data, where)
        keys["params"] = {n: InitRecipe.from_dict(r, f"{where}.params[{n!r}]") for n, r in keys["params"].items()}
        return InitSpec(**keys)

    def to_dict(self) -> dict:
        return {"seed": self.seed, "params": _json(self.params)}


# ---------------------------------------------------------------------------------------------
# The program


@dataclass(frozen=True, kw_only=True)
class Program:
    """Everything the runtime reads from plan.json: which rank runs which stage, how the batch is
    cut, the schedule, the data, the optimizer. Validated when built; see the module docstring.

    Fields are listed in the order plan.json writes them. The last four are not in plan.json's
    "program" object: ``load_program`` copies them from the plan's top level (checkpoints record
    and check them).
    """

    world_size: int            # processes, = dp * ranks per pipeline
    num_stages: int
    dp: int                    # data-parallel replicas, each a whole pipeline
    num_microbatches: int      # per replica and step
    global_batch: int          # samples per step, over all replicas
    schedule: str              # "gpipe" | "1f1b" | "interleaved" (several stages per rank)
    device: str = "cpu"        # "cpu" or "cuda" (rank r runs on cuda:LOCAL_RANK)
    backend: str = ""          # "gloo" / "nccl"; empty: gloo on cpu, nccl on cuda
    ranks: tuple[RankSpec, ...]     # one per rank, any order
    stages: tuple[StageSpec, ...]   # one per stage, in order
    ties: tuple[TieSpec, ...] = ()
    data: DataSpec
    optimizer: OptimizerSettings
    seed: int = 0              # random ops per microbatch and the host generators (seed + rank) derive from it
    collective_timeout_s: float = 600  # every collective and p2p op (Note [no hangs] in launch.py)
    checkpoint_every: int = 0          # checkpoint every K steps (0: see mtbf_s, else only the last)
    predicted_step_time_s: float | None = None  # the plan's; printed beside the measured median at
                                                # the end of a run (Note [step time summary])
    memory_tier: MemoryTierPlan | None = None
    randomness: RandomnessSpec | None = None  # present only when the compiler keyed random ops
    init: InitSpec | None = None              # present only for a model compiled on the meta device
    steps: int | None = None                  # steps to train; None: optimizer.total_steps
    plan_hash: str | None = None              # from plan.json's top level
    model_fingerprint: str | None = None      # from plan.json's top level
    workload: str | None = None               # from plan.json's top level
    mtbf_s: float | None = None               # from plan.json's "training"; --mtbf's default

    def __post_init__(self):
        for name in ("ranks", "stages", "ties"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.backend:
            object.__setattr__(self, "backend", "gloo" if self.device == "cpu" else "nccl")
        _validate(self)

    # -- JSON -----------------------------------------------------------------------------------

    @staticmethod
    def from_dict(data: dict) -> "Program":
        """plan.json's "program" object (or a hand-written one) -> Program; raises ValueError
        naming the value and the fix."""
        keys = _known(Program, data, "the program object")
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
        return {f.name: _json(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    # -- What the runtime derives ---------------------------------------------------------------

    @functools.cached_property
    def layout(self) -> "Layout":
        return Layout.from_program(self)

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


def _validate(program: Program) -> None:
    """Consistency of a Program (its parts checked themselves); ValueError naming values and fix."""
    if program.schedule not in SCHEDULES:
        raise ValueError(f"schedule {program.schedule!r} is not one of {SCHEDULES}")
    for name in ("world_size", "num_stages", "dp", "num_microbatches", "global_batch"):
        _positive(getattr(program, name), name)
    if program.device not in ("cpu", "cuda"):
        raise ValueError(f"device {program.device!r} is not 'cpu' or 'cuda'")
    world, p, dp, m = program.world_size, program.num_stages, program.dp, program.num_microbatches
    if len(program.stages) != p:
        raise ValueError(f"num_stages={p} but {len(program.stages)} stage entries")
    for i, st in enumerate(program.stages):
        if st.index != i:
            raise ValueError(f"stages[{i}] has index {st.index}: stages must be listed in order")
    # Note [only runnable plans] in partitioner/solver/problem.py: the solver never emits these,
    # but a hand-edited or hand-written program must fail here, in words, not inside every rank.
    if program.schedule == "1f1b" and m < p:
        raise ValueError(f"schedule 1f1b needs num_microbatches >= num_stages (torch's Schedule1F1B), "
                         f"got {m} microbatches for {p} stages: recompile with --microbatches {p} or more, "
                         "or --schedule gpipe")
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
    rounds = max(1, m // layout.pp_size)
    if program.schedule == "interleaved" and m % rounds:
        raise ValueError(f"schedule interleaved needs num_microbatches to be a multiple of its rounds "
                         f"(max(1, {m} // {layout.pp_size} pipeline ranks) = {rounds}), got {m}: choose "
                         f"a multiple of {layout.pp_size} microbatches")


# ---------------------------------------------------------------------------------------------
# Loading


def load_plan(folder: str) -> dict:
    path = os.path.join(folder, "plan.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {folder!r} a program folder written by "
                                "`partitioner compile -o DIR`?")
    with open(path) as f:
        return json.load(f)


def verify_files(folder: str, plan: dict) -> None:
    """Every file plan.json lists must hash to the listed sha256 (docs/design.md §7)."""
    import hashlib

    listed = plan.get("files")
    if not listed:
        return  # a hand-written folder (tests) lists no files
    bad = []
    for name, digest in sorted(listed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            bad.append(f"{name} (missing)")
            continue
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                bad.append(f"{name} (changed)")
    if bad:
        raise PlanMismatchError(
            f"{folder} does not match its plan {plan.get('plan_hash')}: {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; recompile with `partitioner compile ... -o {folder}`"
        )


def load_program(folder: str) -> Program:
    """plan.json's "program" object as a validated Program, after checking every file's hash;
    the plan's top-level plan_hash, model_fingerprint, workload and training mtbf_s included."""
    plan = load_plan(folder)
    verify_files(folder, plan)
    if "program" not in plan:
        raise ValueError(f"{folder}/plan.json has no \"program\" object (keys: {sorted(plan)})")
    data = dict(plan["program"])
    data.setdefault("plan_hash", plan.get("plan_hash"))
    # What checkpoints record and check (runtime/checkpoint/manifest.py), from the plan's top level.
    data.setdefault("model_fingerprint", plan.get("model_fingerprint"))
    data.setdefault("workload", plan.get("workload"))
    training = plan.get("training") or {}
    if training.get("mtbf_s") is not None:
        data.setdefault("mtbf_s", training["mtbf_s"])
    try:
        return Program.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{folder}/plan.json: {exc}") from None


@dataclass(frozen=True)
class Layout:
    """Which rank holds what, and the process groups every rank must create (in this order).

    Note [group order]: ``torch.distributed.new_group`` is collective over the world, so every rank
    creates every group, members or not, in one fixed order: pipelines (by replica), then
    data-parallel groups (by pipeline position), then tie groups (by tie, then replica). Groups of
    one rank are not created except pipelines, which PipelineStage needs.
    """

    world_size: int
    num_stages: int
    dp: int
    stages_of_rank: tuple[tuple[int, ...], ...]  # rank -> its stage indices (ascending)
    replica_of_rank: tuple[int, ...]
    pipelines: tuple[tuple[int, ...], ...]  # replica -> ranks, ascending == pipeline group rank order
    dp_groups: tuple[tuple[int, ...], ...]  # pipeline position -> ranks (one per replica)
    tie_groups: tuple[tuple[tuple[int, ...], ...], ...]  # tie -> replica -> ranks holding a copy

    @staticmethod
    def from_program(program: Program) -> "Layout":
        world, p, dp = program.world_size, program.num_stages, program.dp
        stages_of = [()] * world
        replica_of = [0] * world
        for entry in program.ranks:
            r = entry.rank
            if not 0 <= r < world:
                raise ValueError(f"rank entry {entry.to_dict()} is outside world_size={world}")
            stages_of[r] = tuple(sorted(entry.stages))
            replica_of[r] = entry.replica
        pipelines = []
        for rep in range(dp):
            ranks = tuple(r for r in range(world) if replica_of[r] == rep)
            held = sorted(s for r in ranks for s in stages_of[r])
            if held != list(range(p)):
                raise ValueError(f"replica {rep} (ranks {list(ranks)}) holds stages {held}; "
                                 f"each replica must hold every stage 0..{p - 1} exactly once")
            # torch.distributed.pipelining places stage s on pipeline-group rank s % group size
            # (group ranks follow ascending global rank): the plan must agree.
            for pos, r in enumerate(ranks):
                want = tuple(range(pos, p, len(ranks)))
                if stages_of[r] != want:
                    raise ValueError(
                        f"rank {r} (position {pos} of replica {rep}'s pipeline {list(ranks)}) holds "
                        f"stages {list(stages_of[r])}, but pipelining needs stage s on position "
                        f"s % {len(ranks)}: give it stages {list(want)}")
            pipelines.append(ranks)
        sizes = {len(pl) for pl in pipelines}
        if len(sizes) != 1:
            raise ValueError(f"replicas have pipelines of different lengths: {pipelines}")
        dp_groups = tuple(tuple(pl[pos] for pl in pipelines) for pos in range(sizes.pop()))
        tie_groups = []
        for tie in program.ties:
            per_rep = []
            for pl in pipelines:
                per_rep.append(tuple(r for r in pl if set(stages_of[r]) & set(tie.stages)))
            tie_groups.append(tuple(per_rep))
        return Layout(world, p, dp, tuple(stages_of), tuple(replica_of), tuple(pipelines),
                      dp_groups, tuple(tie_groups))

    @property
    def pp_size(self) -> int:
        return len(self.pipelines[0])

    def pipeline_ranks(self, rank: int) -> list[int]:
        """The rank holding each stage of ``rank``'s replica's pipeline, by stage."""
        return [self.stage_rank(k, self.replica_of_rank[rank]) for k in range(self.num_stages)]

    def data_parallel_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same stage(s) as ``rank``, one per replica (itself included)."""
        return sorted({self.stage_rank(k, rep) for k in self.stages_of_rank[rank] for rep in range(self.dp)})

    def stage_rank(self, stage: int, replica: int) -> int:
        return self.pipelines[replica][stage % self.pp_size]


def resolve_callable(spec: list | tuple | str, folder: str | None = None) -> Callable:
    """``["pkg.mod:fn", {kwargs}]`` or ``"pkg.mod:fn"`` -> fn with kwargs bound.

    The module part may also be a path to a .py file (relative paths are taken from the program
    folder), for user code that is not an installed package.
    """
    if isinstance(spec, str):
        target, kwargs = spec, {}
    else:
        target, kwargs = spec[0], dict(spec[1] if len(spec) > 1 else {})
    mod_name, _, fn_name = target.rpartition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"callable {target!r} must look like 'package.module:function'")
    if mod_name.endswith(".py"):
        path = mod_name if os.path.isabs(mod_name) or folder is None else os.path.join(folder, mod_name)
        module = import_path(path)
    else:
        module = importlib.import_module(mod_name)
    fn = getattr(module, fn_name)
    return functools.partial(fn, **kwargs) if kwargs else fn


def import_path(path: str, name: str | None = None):
    """Import a .py file by path without touching sys.path or sys.modules."""
    path = os.path.abspath(path)
    name = name or "_runtime_loaded_" + str(abs(hash(path)))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensor_dtype(name: str):
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype

