"""What a compile is asked, and what it decides, as frozen objects read by attribute.

Note [settings and decisions]: three objects, never one dict. ``TrainingSettings`` is how the user
asks to train (optimizer, seed, timeouts, checkpoint cadence, replica checks, the memory tier,
clipping, precision, no-decay patterns, and where `verify` rebuilds the model), merged from the
defaults, a job file, ``training=`` and the flags (Note [training settings merge] in
partitioner/config/job.py) and checked against the one schema (``TRAINING_SCHEMA``) whenever one is built.
``Request`` is the layout the user pins (None: the solver chooses). ``Decisions`` is what the
compiler chose: the precision it resolved, whether the optimizer state is sharded, the replica
check's interval, the parameters trained without weight decay and the memory tier's layout. The
compiler reads the first two and writes only the third, so plan.json's "training" is what was asked
(it reads back as a ``TrainingSettings``, schema and all) and "decisions" is what was chosen; the
program object (runtime/program/spec.py) is built from both. A plan.json of an older compile, with the
decisions inside "training", still loads (``split_legacy_training``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from typing import Any

from runtime.features import registry
from runtime.program.parts import Values
from runtime.program.parts import LR_SCHEDULES, MemoryTierPlan, OptimizerSettings, Precision

RECOMPUTE_CHOICES = ("auto", "none", "full", "selective")  # Note [recompute a user pins] in partitioner/solver/recompute_cost.py
GRANULARITIES = ("block", "sublayer", "op", "node")
_OPTIONAL = ("sdc_every", "mtbf_s", "clip_grad_norm", "model_spec", "pretrained", "data",
             "compile_stages")


# -- value checks: each returns the value (normalized) or raises naming ``where`` -------------------


def _number(value, where: str, *, low: float | None = None, low_open: bool = False, high: float | None = None):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} = {value!r} must be a number")
    if not math.isfinite(value):  # nan passes every comparison below; inf trains to inf
        raise ValueError(f"{where} = {value!r} must be a finite number")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{where} = {value!r} must be {'>' if low_open else '>='} {low}")
    if high is not None and value >= high:
        raise ValueError(f"{where} = {value!r} must be < {high}")
    return float(value)


def _integer(value, where: str, *, low: int = 0):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} = {value!r} must be a whole number")
    if value < low:
        raise ValueError(f"{where} = {value!r} must be >= {low}")
    return value


def _positive(where_value, where):
    return _number(where_value, where, low=0, low_open=True)


def _fraction(value, where):
    return _number(value, where, low=0, high=1)


def _betas(value, where: str):
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{where} = {value!r} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    return [_fraction(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _choice(options):
    def check(value, where):
        if value not in options:
            raise ValueError(f"{where} = {value!r} must be one of {', '.join(map(repr, options))}")
        return value
    return check


def _optional(check):
    def inner(value, where):
        return None if value is None else check(value, where)
    return inner


def _boolean_or_none(value, where):
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{where} = {value!r} must be true or false")
    return value


def _no_weight_decay(value, where):
    if value in ("default", "none") or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise ValueError(f"{where} = {value!r} must be \"default\", \"none\" or a list of parameter-name "
                     "patterns (fnmatch), e.g. [\"*.bias\", \"*norm*\"]")


def check_recompute(value, where: str):
    """The recompute setting (Note [recompute a user pins] in partitioner/solver/recompute_cost.py), or
    ValueError naming it."""
    return _choice(RECOMPUTE_CHOICES)(value, where)


def _string(value, where):
    if not isinstance(value, str):
        raise ValueError(f"{where} = {value!r} must be a string")
    return value


def _memory_tier(value, where):
    modes = ("auto", "none", "copy", "parity")
    if isinstance(value, str):
        return _choice(modes)(value, where)
    if not isinstance(value, dict):
        raise ValueError(f"{where} = {value!r} must be a mode ({', '.join(modes)}) or a table")
    return check_table(value, MEMORY_TIER_SCHEMA, where)


OPTIMIZER_SCHEMA = {
    "name": _choice(("adamw",)),
    "lr": _positive,
    "betas": _betas,
    "eps": _positive,
    "weight_decay": lambda v, w: _number(v, w, low=0),
    "warmup_steps": lambda v, w: _integer(v, w, low=0),
    "lr_schedule": _choice(LR_SCHEDULES),
    "total_steps": lambda v, w: _integer(v, w, low=1),
    "min_lr_ratio": lambda v, w: _number(v, w, low=0, high=1.000001),
    "fused": _boolean_or_none,
    "foreach": _boolean_or_none,
}
MEMORY_TIER_SCHEMA = {
    "mode": _choice(("auto", "none", "copy", "parity")),
    "every": lambda v, w: _integer(v, w, low=1),
    "group_size": _optional(lambda v, w: _integer(v, w, low=2)),
}
TRAINING_SCHEMA = {
    "optimizer": OPTIMIZER_SCHEMA,
    "seed": lambda v, w: _integer(v, w, low=0),
    "collective_timeout_s": _positive,
    "checkpoint_every": lambda v, w: _integer(v, w, low=0),
    # Note [replica digests] (runtime/resilience/sdc.py); 0: off; left out: sdc_cost.default_every(dp)
    "sdc_every": lambda v, w: _integer(v, w, low=0),
    "mtbf_s": _positive,
    "memory_tier": _memory_tier,
    "model_spec": _string,  # how `partitioner verify` rebuilds the model (set by the CLI)
    "pretrained": _string,
    "data": _string,  # a corpus spec (runtime/data/corpus/spec.py): the program trains on it
    # Global gradient-norm clipping (Note [global gradient norm] in runtime/execute/grad_norm.py); None: off.
    "clip_grad_norm": _optional(_positive),
    "precision": _choice(tuple(p.value for p in Precision)),  # Note [mixed precision]
    "no_weight_decay": _no_weight_decay,  # "default", "none" or fnmatch patterns (Note [no weight decay])
    # torch.compile each stage's forward (Note [compiled stages] in runtime/execute/compile_stages.py); left out: off
    "compile_stages": _boolean_or_none,
    # auto | none | full | selective (Note [recompute a user pins] in partitioner/solver/recompute_cost.py); left out: auto
    "recompute": check_recompute,
    # each feature's own (Note [one feature, one module] in runtime/features/__init__.py)
    **{s.key: s.check for s in registry.settings(side="compile")},
}


def check_table(table: Any, schema: dict, where: str) -> dict:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table of settings, got {type(table).__name__} {table!r}")
    unknown = sorted(set(table) - set(schema))
    if unknown:
        raise ValueError(f"{where} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"known keys: {', '.join(sorted(schema))}")
    out = {}
    for key, value in table.items():
        check = schema[key]
        out[key] = check_table(value, check, f"{where}.{key}") if isinstance(check, dict) else check(value, f"{where}.{key}")
    return out



@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """How the user asks to train; every field is a key of plan.json's "training" (job.TRAINING_SCHEMA)."""

    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)  # the one set of defaults
    seed: int = 0
    collective_timeout_s: float = 60.0
    checkpoint_every: int = 0           # 0: see mtbf_s, else only the last step
    sdc_every: int | None = None        # None: sdc_cost.default_every(dp) (Note [replica digests])
    mtbf_s: float | None = None         # the checkpoint interval by Young/Daly
    memory_tier: MemoryTierPlan | None = None  # the request (mode auto|none|copy|parity); Decisions has the layout
    clip_grad_norm: float | None = None  # Note [global gradient norm] in runtime/execute/grad_norm.py; None: off
    precision: Precision | None = None  # None: Precision.default_for the cluster's first device kind
    no_weight_decay: str | tuple[str, ...] = "default"  # "default", "none" or fnmatch patterns (Note [no weight decay])
    model_spec: str | None = None       # how `partitioner verify` rebuilds the model (the CLI sets it)
    pretrained: str | None = None       # the Hugging Face weights an hf: model starts from (the CLI sets it)
    data: str | None = None             # "tokens:DIR", "megatron:PREFIX", ...: a corpus replaces make_batch
    compile_stages: bool | None = None  # torch.compile the stages (Note [compiled stages]); None: off
    recompute: str = "auto"             # auto | none | full | selective (Note [recompute a user pins] in solver/recompute_cost.py)
    features: Values = field(default_factory=Values)  # the features' keys given (Note [one feature, one module])

    def __post_init__(self):
        object.__setattr__(self, "features", Values(self.features))
        for name in ("collective_timeout_s", "mtbf_s", "clip_grad_norm"):  # one JSON form however given
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.of(self.precision, "training.precision"))
        if isinstance(self.no_weight_decay, list):
            object.__setattr__(self, "no_weight_decay", tuple(self.no_weight_decay))
        check_table(self.to_dict(), TRAINING_SCHEMA, "training")

    @staticmethod
    def from_dict(data: dict, where: str = "training") -> "TrainingSettings":
        """A checked settings table (missing keys: the defaults) as TrainingSettings; ValueError
        naming the key, ``where`` it came from, and what it must be."""
        checked = check_table(data, TRAINING_SCHEMA, where)
        if "optimizer" in checked:
            checked["optimizer"] = OptimizerSettings(**checked["optimizer"])
        tier = checked.get("memory_tier")
        if tier is not None:
            checked["memory_tier"] = MemoryTierPlan(mode=tier) if isinstance(tier, str) else MemoryTierPlan(**tier)
        features = {k: checked.pop(k) for k in registry.decided_keys() if k in checked}
        return TrainingSettings(**checked, features=Values(features))

    def to_dict(self) -> dict:
        """plan.json's "training": the keys the user can set, those left unset left out."""
        out = {"optimizer": {k: v for k, v in self.optimizer.to_dict().items() if k != "no_decay"},
               "seed": self.seed, "collective_timeout_s": self.collective_timeout_s,
               "checkpoint_every": self.checkpoint_every}
        out.update({name: getattr(self, name) for name in _OPTIONAL if getattr(self, name) is not None})
        out.update(self.features)
        if self.memory_tier is not None:
            out["memory_tier"] = self.memory_tier.to_dict()
        if self.precision is not None:
            out["precision"] = self.precision.value
        if self.recompute != "auto":  # written only when pinned: an older plan round-trips unchanged
            out["recompute"] = self.recompute
        if self.no_weight_decay != "default":
            nwd = self.no_weight_decay
            out["no_weight_decay"] = nwd if isinstance(nwd, str) else list(nwd)
        return out

    def replace(self, **changes) -> "TrainingSettings":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class Request:
    """The layout the user pins; None: the solver chooses (Note [one enumeration] in solver/space.py)."""

    num_stages: int | None = None
    dp: int | None = None
    tensor_parallel: int | None = None
    microbatches: int | None = None
    schedule: str = "1f1b"              # gpipe | 1f1b | interleaved | auto (Note [schedule choice])
    shard_optimizer: str = "auto"       # auto | on | off (Note [sharding as a candidate])
    granularity: str = "block"          # Note [regions from the module tree]
    sequence_parallel: str = "auto"     # auto | on | off (Note [sequence parallelism as a decision])

    def __post_init__(self):
        if self.sequence_parallel not in ("auto", "on", "off"):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} is not \"auto\", \"on\" or \"off\": "
                             "pass --sequence-parallel auto (the default)")
        shard = {True: "on", False: "off"}.get(self.shard_optimizer, self.shard_optimizer)
        if shard not in ("auto", "on", "off"):
            raise ValueError(f"shard_optimizer={self.shard_optimizer!r} is not \"auto\", \"on\" or \"off\" (or a bool)")
        object.__setattr__(self, "shard_optimizer", shard)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r} is not one of {', '.join(GRANULARITIES)}: pass "
                             "--granularity block (the default)")

    def replace(self, **changes) -> "Request":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class Decisions:
    """What the compiler chose; plan.json's "decisions"."""

    precision: Precision = Precision.FP32
    shard_optimizer: bool = False       # AdamW state sharded over the replicas (ZeRO-1): the plan has dp > 1
    sequence_parallel: bool = False     # tp > 1 only: Note [sequence parallelism] in runtime/parallel/tensor_parallel.py
    sdc_every: int = 0                  # the replica check's interval (0: none)
    no_decay: tuple[str, ...] = ()      # original names trained without weight decay (Note [no weight decay])
    memory_tier: dict | None = None     # compiler.memory_tier_choice: mode, requested, every, group_size,
                                        # hosts, groups and the host-memory figures; None: no tier
    features: Values = field(default_factory=Values)  # what each feature decided (Note [one feature, one module])

    def __post_init__(self):
        object.__setattr__(self, "features", Values(self.features))
        object.__setattr__(self, "precision", Precision.of(self.precision, "decisions.precision"))
        object.__setattr__(self, "no_decay", tuple(self.no_decay))

    @staticmethod
    def from_dict(data: dict) -> "Decisions":
        if not isinstance(data, dict):
            raise ValueError(f"decisions must be a JSON object, got {data!r}: recompile the plan")
        features = {k: v for k, v in data.items() if k in registry.decided_keys()}
        unknown = sorted(set(data) - set(features) - ({f.name for f in dataclasses.fields(Decisions)} - {"features"}))
        if unknown:
            raise ValueError(f"decisions has unknown keys {unknown} (a newer partitioner's plan?): recompile it")
        return Decisions(**{k: v for k, v in data.items() if k not in features}, features=Values(features))

    def to_dict(self) -> dict:
        out = {"precision": self.precision.value, "shard_optimizer": self.shard_optimizer,
               "sdc_every": self.sdc_every, "no_decay": list(self.no_decay)}
        out.update(self.features)  # flat, as before features had a table
        if self.memory_tier is not None:
            out["memory_tier"] = self.memory_tier
        if self.sequence_parallel:  # written only when on: a plan from before it round-trips unchanged
            out["sequence_parallel"] = True
        return out

    @property
    def memory_tier_plan(self) -> MemoryTierPlan | None:
        """What the program object records of the tier (the flags of a run override it)."""
        tier = self.memory_tier
        return None if tier is None else MemoryTierPlan(mode=tier["mode"], every=tier["every"],
                                                        group_size=tier["group_size"])


def program_optimizer(settings: TrainingSettings, decisions: Decisions) -> OptimizerSettings:
    """The optimizer the program runs: the user's, with the parameters the compiler exempted from decay."""
    return dataclasses.replace(settings.optimizer, no_decay=decisions.no_decay)


def settings_of(plan_json: dict) -> TrainingSettings:
    """The user's settings of a plan.json body (the defaults for a hand-written folder without any)."""
    training = plan_json.get("training") or {}
    if "decisions" not in plan_json and training:
        return split_legacy_training(training)[0]
    return TrainingSettings.from_dict(training, "plan.json training")


def split_legacy_training(training: dict) -> tuple[TrainingSettings, Decisions]:
    """A plan.json "training" written before Note [settings and decisions], which held the
    compiler's decisions too, as the user's settings and the decisions."""
    training = dict(training)
    optimizer = dict(training.get("optimizer", {}))
    tier = training.get("memory_tier")
    decisions = Decisions(precision=training.get("precision", Precision.FP32),
                          shard_optimizer=bool(training.pop("shard_optimizer", False)),
                          sdc_every=training.get("sdc_every") or 0, no_decay=optimizer.pop("no_decay", ()),
                          memory_tier=tier if isinstance(tier, dict) and "hosts" in tier else None)
    if decisions.memory_tier is not None:
        training["memory_tier"] = {"mode": tier.get("requested", tier["mode"]), "every": tier["every"],
                                   **({"group_size": tier["group_size"]} if tier.get("group_size") else {})}
    if training.get("clip_grad_norm") is None:
        training.pop("clip_grad_norm", None)
    training["optimizer"] = optimizer
    return TrainingSettings.from_dict(training, "plan.json training"), decisions
