"""The Plan: what the compiler decided and every figure it decided by. Frozen, JSON, hashed.

A Plan is plain data (no torch objects), so it can be saved, inspected and diffed without the
model. Its hash covers everything in it; every generated file names that hash, and a program
folder whose files don't match is refused (PlanMismatchError).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from partitioner.config.settings import Decisions, TrainingSettings, split_legacy_training
from partitioner.errors import PlanMismatchError
from runtime.file_trust import UntrustedFile, read_bounded
from runtime.program.schedules import PipelineSchedule, schedule_named

PLAN_VERSION = 1

# Note [plans are deterministic]: the same workload, cluster and options give the same plan.json
# and program folder, byte for byte. Wall-clock figures (how long the solver ran) differ between
# runs, so they stay out of the hash and of plan.json; the folder keeps them in compile_stats.json,
# which no other file names.
TIMING_KEYS = ("solve_time_s",)

# Note [json keys]: the code spells FLOPs one way, ``fwd_flops`` / ``bwd_flops`` (as the passes and the
# solver do); plan.json and `inspect --json` keep the keys users and scripts read (docs/design.md §11:
# "flops_fwd", "flops_bwd"). ``to_dict`` and ``from_dict`` map one to the other, so the plan's
# bytes and hash do not depend on the Python names.
_JSON_KEYS = {"fwd_flops": "flops_fwd", "bwd_flops": "flops_bwd", "bwd_weight_flops": "flops_bwd_weight"}
_FIELD_NAMES = {v: k for k, v in _JSON_KEYS.items()}


def _renamed(item: dict, names: dict[str, str]) -> dict:
    return {names.get(k, k): v for k, v in item.items()}


@dataclass(frozen=True)
class MemoryBreakdown:
    """A stage's predicted memory by term (Note [memory model] in partitioner/solver/evaluate.py)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int           # in-flight saved activations, held outputs, the loss's float copy
    buffers_bytes: int               # receive buffers for every microbatch, the global batch
    transient_bytes: int = 0         # the largest region's backward transient
    step_buffers_bytes: int = 0      # after the schedule: all-reduce bucket, tie gradient copies

    @property
    def total_bytes(self) -> int:
        """The predicted peak: static + buffers + max(backward phase, step phase)."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.buffers_bytes
                + max(self.activations_bytes + self.transient_bytes, self.step_buffers_bytes))


@dataclass(frozen=True)
class StagePlan:
    index: int
    ranks: tuple[int, ...]           # one rank per data-parallel replica
    device: str                      # device kind, e.g. "cpu", "h100"
    regions: tuple[int, ...]
    region_names: tuple[str, ...]
    params: int                      # parameter count (elements)
    fwd_flops: float                 # one microbatch (plan.json: "flops_fwd", Note [json keys])
    bwd_flops: float
    compute_time_s: float            # forward + backward of one microbatch
    comm_time_s: float               # sending this stage's outputs (and their gradients back)
    predicted_time_s: float          # compute + comm: what the bottleneck is taken over
    memory: MemoryBreakdown
    peak_memory_bytes: int
    memory_capacity_bytes: int
    send_bytes: int                  # activation bytes sent to the next stage per microbatch
    nodes: tuple[int, ...] = ()      # the cluster node of each replica's device (Note [exact placements])
    bwd_weight_flops: float = 0.0    # of bwd_flops, the weight gradients' (Note [weight-gradient flops])


@dataclass(frozen=True)
class PlanRegion:
    """A region as the plan places it. The same region is a ``RegionRow`` of passes/region_graph.py (what the
    passes measured) and a ``RegionCost`` of partitioner/solver/problem.py (what the solver prices)."""

    id: int
    name: str
    stage: int
    recompute: bool
    nodes: tuple[str, ...]
    layer: int | None
    fwd_flops: float                 # per sample (plan.json: "flops_fwd", Note [json keys])
    bwd_flops: float
    param_bytes: int
    activation_bytes: int            # per sample
    transient_bytes: int = 0         # per sample, backward transient when not recomputed
    bwd_weight_flops: float = 0.0    # per sample, of bwd_flops the weight gradients' (Note [weight-gradient flops])


@dataclass(frozen=True)
class CutEdge:
    src_region: int
    dst_region: int
    tensors: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    bytes_per_microbatch: int
    boundaries: tuple[int, ...]      # the boundaries s|s+1 it crosses


@dataclass(frozen=True)
class PlanTie:
    """A parameter several stages hold, as placed (``SharedParam`` to the solver, ``TieRow`` to the passes)."""

    param: str
    stages: tuple[int, ...]
    placement: str                   # "colocated" or "replicated"
    cost_s: float


@dataclass(frozen=True)
class Plan:
    workload: str
    model_fingerprint: str           # hash of parameter names, shapes and dtypes
    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    global_batch: int
    schedule: str
    world_size: int
    device_type: str                 # "cpu" or "cuda": decides gloo or nccl
    stages: tuple[StagePlan, ...]
    regions: tuple[PlanRegion, ...]
    cut_edges: tuple[CutEdge, ...]
    ties: tuple[PlanTie, ...]
    predicted: dict                  # step_time_s, bubble_fraction, lower_bound_step_time_s, samples_per_s
    solver: dict                     # status, objective, bound, gap, solve_time_s, candidates
    baselines: dict                  # {"uniform": {"step_time_s"}, "param_balanced": {...}}
    cluster: dict
    # What the user asked (optimizer, lr schedule, seed, checkpoint interval, ...) and what the compiler
    # chose, kept apart (Note [settings and decisions] in partitioner/config/settings.py)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    decisions: Decisions = field(default_factory=Decisions)
    # Tensor-parallel degree: each stage replica runs on a tensor group of this many consecutive
    # ranks (Note [tensor groups] in partitioner/solver/tensor_groups.py); ``stages[].ranks``
    # hold each group's first rank, ``world_size`` counts every rank. plan.json writes the key only
    # when it is not 1, so a plan without it (an older one) is tp 1 and hashes as before.
    tensor_parallel: int = 1
    version: int = PLAN_VERSION

    # --- serialization -------------------------------------------------------------------
    @property
    def pipeline_ranks(self) -> int:
        """Ranks per pipeline: the stages over it (several per rank under interleaved)."""
        return self.world_size // (self.dp * self.tensor_parallel)

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        """``schedule`` (the name plan.json writes) as its object (Note [one class per schedule])."""
        return schedule_named(self.schedule, self.num_stages // self.pipeline_ranks)

    def to_dict(self) -> dict:
        body = _jsonable({**asdict(self), "training": self.training.to_dict(), "decisions": self.decisions.to_dict()})
        body["stages"] = [_renamed(s, _JSON_KEYS) for s in body["stages"]]   # Note [json keys]
        body["regions"] = [_renamed(r, _JSON_KEYS) for r in body["regions"]]
        if body.get("tensor_parallel") == 1:
            del body["tensor_parallel"]
        for item in body["stages"] + body["regions"]:  # as tensor_parallel: a folder from before it keeps its hash
            if item.get("flops_bwd_weight") == 0:
                del item["flops_bwd_weight"]
        return body

    def stable_dict(self) -> dict:
        """to_dict() without wall-clock figures (Note [plans are deterministic])."""
        body = self.to_dict()
        body["solver"] = {k: v for k, v in body["solver"].items() if k not in TIMING_KEYS}
        return body

    def timing(self) -> dict:
        return {k: self.solver[k] for k in TIMING_KEYS if k in self.solver}

    def content_hash(self) -> str:
        return _hash_of(self.stable_dict())

    def to_json(self) -> str:
        body = self.stable_dict()
        body["plan_hash"] = self.content_hash()
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, body: dict) -> "Plan":
        body = dict(body)
        if not isinstance(body.get("solver"), dict):  # a hand-written folder: one line, not a KeyError
            raise PlanFieldError(f"is not a plan (its field 'solver' is {'missing' if 'solver' not in body else 'not an object'}): "
                                 "recompile the plan with `partitioner compile`")
        body["solver"] = dict(body["solver"])
        stated = body.pop("plan_hash", None)
        body.pop("program", None)
        body.pop("files", None)
        body.pop("program_hash", None)  # over all of plan.json (runtime/program/spec.py)
        body.pop("problem", None)  # the solver's problem and answer, kept beside the plan for inspect
        body.pop("assignment", None)
        if body.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {body.get('version')!r} is not {PLAN_VERSION}: recompile the plan")
        raw = dict(body)
        if "decisions" not in body and isinstance(body.get("training"), dict):  # an older plan: decisions inside
            body["training"], body["decisions"] = split_legacy_training(body["training"])
        else:
            body["training"] = _part(TrainingSettings.from_dict, body.get("training", {}), "training")
            body["decisions"] = _part(Decisions.from_dict, body.get("decisions", {}), "decisions")
        _check_fields(cls, body, "")
        _check_figures(body)
        try:  # the schedule's name, parsed once here: what reads the plan asks ``pipeline_schedule``
            schedule_named(body["schedule"])
        except ValueError as unknown:
            raise PlanFieldError(f"{unknown}; recompile the plan with `partitioner compile`") from None
        plan = cls(
            **{**body,
               "stages": tuple(StagePlan(**{**_renamed(s, _FIELD_NAMES), "ranks": tuple(s["ranks"]), "regions": tuple(s["regions"]),
                                           "region_names": tuple(s["region_names"]),
                                           "memory": MemoryBreakdown(**s["memory"])}) for s in body["stages"]),
               "regions": tuple(PlanRegion(**{**_renamed(r, _FIELD_NAMES), "nodes": tuple(r["nodes"])}) for r in body["regions"]),
               "cut_edges": tuple(CutEdge(**{**e, "tensors": tuple(e["tensors"]),
                                            "shapes": tuple(tuple(x) for x in e["shapes"]),
                                            "boundaries": tuple(e["boundaries"])}) for e in body["cut_edges"]),
               "ties": tuple(PlanTie(**{**t, "stages": tuple(t["stages"])}) for t in body["ties"])})
        # an older plan hashes as it was written: its decisions sat inside "training"
        content_hash = plan.content_hash() if raw is None or "decisions" in raw else _hash_of(
            {**raw, "solver": {k: v for k, v in raw["solver"].items() if k not in TIMING_KEYS}})
        if stated is not None and stated != content_hash:

            raise PlanMismatchError(
                f"plan.json states hash {stated} but its content hashes to {content_hash}: "
                "it was edited by hand; recompile with `partitioner compile`"
            )
        return plan

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if path.is_dir():
            path = path / "plan.json"
        if not path.is_file():
            raise ValueError(f"no plan at {path}: pass a program folder or its plan.json")
        try:  # a FIFO, a device or a huge file is refused unread (Note [files are not trusted])
            body = json.loads(read_bounded(str(path), follow=True).decode())
        except UntrustedFile as exc:
            raise ValueError(str(exc)) from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not text (binary bytes): recompile the plan with "
                             "`partitioner compile`") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}): recompile the plan") from None
        if not isinstance(body, dict):
            raise ValueError(f"{path} holds a JSON {type(body).__name__}, not a plan: recompile the plan "
                             "with `partitioner compile`")
        try:
            plan = cls.from_dict(body)
        except PlanFieldError as exc:
            raise PlanFieldError(f"{path}: {exc}") from None
        stats = path.parent / "compile_stats.json"
        if stats.is_file():
            plan.solver.update({k: v for k, v in json.loads(read_bounded(str(stats), follow=True)).items()
                                if k in TIMING_KEYS})
        plan.solver.setdefault("solve_time_s", 0.0)
        return plan

    # --- derived figures ---------------------------------------------------------------
    def rank_layout(self) -> list[dict]:
        """Rank → (stages it holds, data-parallel replica, index in its tensor group); every rank of
        a stage replica's tensor group holds the same stages (the tensor index is innermost)."""
        layout = {}
        for stage in self.stages:
            for replica, first in enumerate(stage.ranks):
                for t in range(self.tensor_parallel):
                    rank = first + t
                    entry = layout.setdefault(rank, {"rank": rank, "stages": [], "replica": replica, "tp_index": t})
                    entry["stages"].append(stage.index)
        return [layout[r] for r in sorted(layout)]


class PlanFieldError(ValueError):
    """plan.json has a field missing or of the wrong type (edited by hand, truncated, or not a plan)."""


_NESTED = {"StagePlan": "stages", "PlanRegion": "regions", "CutEdge": "cut_edges", "PlanTie": "ties"}


def _field_ok(kind: str, value: Any) -> bool:
    """Does a JSON value fit the (string) annotation of a plan field?"""
    if kind.endswith(" | None"):
        return value is None or _field_ok(kind.removesuffix(" | None"), value)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict" or kind == "MemoryBreakdown":
        return isinstance(value, dict)
    if kind in ("TrainingSettings", "Decisions"):  # read (and checked) before the fields
        return isinstance(value, (TrainingSettings, Decisions))
    if kind.startswith("tuple[tuple["):
        return isinstance(value, list) and all(isinstance(v, list) and all(_field_ok("int", x) for x in v)
                                               for v in value)
    if kind.startswith("tuple["):
        inner = kind[len("tuple["):-1].split(",")[0].strip()
        return isinstance(value, list) and all(_field_ok(inner, v) for v in value)
    return True


def _check_fields(cls, item: Any, where: str) -> None:
    """Every field of dataclass ``cls`` present in ``item`` (the plan.json spelling, Note [json keys])
    with a value of its type, nested ones too; PlanFieldError names the first that is not."""
    fix = "recompile it with `partitioner compile`"
    if not isinstance(item, dict):
        raise PlanFieldError(f"{where} is a {type(item).__name__}, not an object: {fix}")
    known = {_JSON_KEYS.get(f.name, f.name) for f in fields(cls)}
    for f in fields(cls):
        key = _JSON_KEYS.get(f.name, f.name)
        name = f"{where}.{key}" if where else key
        if key not in item:
            if f.default is MISSING and f.default_factory is MISSING:
                raise PlanFieldError(f"field {name} is missing: {fix}")
            continue
        value = item[key]
        if not _field_ok(str(f.type), value):
            raise PlanFieldError(f"field {name} is {json.dumps(value)[:40]}, expected {f.type}: {fix}")
        if f.type == "MemoryBreakdown":
            _check_fields(MemoryBreakdown, value, name)
        inner = str(f.type).removeprefix("tuple[").removesuffix(", ...]")
        if inner in _NESTED:
            for i, each in enumerate(value):
                _check_fields(globals()[inner], each, f"{name}[{i}]")
    unknown = sorted(set(item) - known)
    if unknown:
        raise PlanFieldError(f"field {where + '.' if where else ''}{unknown[0]} is not a plan field "
                             f"(a newer partitioner's plan?): {fix}")


# The figures inspect reads inside the plan's dicts (docs/design.md §11): key -> (kind, required).
_FIGURES = {
    "predicted": {"step_time_s": ("float", True), "bubble_fraction": ("float", True),
                  "lower_bound_step_time_s": ("float", True), "samples_per_s": ("float", False),
                  "sdc_check_s_per_step": ("float", False), "grad_norm_s_per_step": ("float", False),
                  "sdc_canary_s_per_step": ("float", False), "sdc_canary_bubble_s": ("float", False)},
    "solver": {"status": ("str", True), "objective": ("float | None", False), "bound": ("float | None", False),
               "gap": ("float | None", False), "solve_time_s": ("float", False),
               "optimal_over": ("str", False)},
}


def _check_figures(body: dict) -> None:
    fix = "recompile it with `partitioner compile`"
    for part, spec in _FIGURES.items():
        for key, (kind, required) in spec.items():
            if key not in body[part]:
                if required:
                    raise PlanFieldError(f"field {part}.{key} is missing: {fix}")
                continue
            if not _field_ok(kind, body[part][key]):
                raise PlanFieldError(f"field {part}.{key} is {json.dumps(body[part][key])[:40]}, "
                                     f"expected {kind}: {fix}")
    for name, figures in body["baselines"].items():
        if not isinstance(figures, dict) or not _field_ok("float | None", figures.get("step_time_s")):
            raise PlanFieldError(f"field baselines.{name} is {json.dumps(figures)[:40]}, expected "
                                 f'{{"step_time_s": float}}: {fix}')


def _hash_of(body: dict) -> str:
    blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _part(read, value, where: str):
    """A typed part of plan.json read by ``read``; its ValueError as a PlanFieldError naming ``where``."""
    try:
        return read(value)
    except (ValueError, TypeError) as exc:
        raise PlanFieldError(f"field {where}: {exc}: recompile it with `partitioner compile`") from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.9g}")  # stable text across runs of the same inputs
    return value
