"""The parts of the program object (runtime/program/spec.py ``Program``): its stages and the tensors
crossing them, ranks, ties, data, optimizer settings, memory tier, randomness and init recipes,
each a frozen dataclass read from and written to plan.json's keys by one rule (``known``)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping

LR_SCHEDULES = ("cosine", "linear", "constant")


class Precision(enum.StrEnum):
    """A precision policy (Note [mixed precision] in runtime/execute/precision.py): the one place its
    values are spelled. A str, so plan.json holds the same text as before and a policy reads as
    one in messages; everything that acts on it reads a property, never the text."""

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"

    @staticmethod
    def of(value: "Precision | str", where: str = "precision") -> "Precision":
        try:
            return Precision(value)
        except ValueError:
            raise ValueError(f"{where} {value!r} is not one of {[p.value for p in Precision]}: pass --precision "
                             "fp32, bf16-mixed or fp16-mixed") from None

    @staticmethod
    def default_for(device_kind: str) -> "Precision":
        """bf16-mixed on GPU device kinds (every preset has bf16 tensor cores), fp32 on cpu (bf16
        matmuls on a CPU without AMX are slower than fp32)."""
        return Precision.FP32 if device_kind == "cpu" else Precision.BF16_MIXED

    @property
    def is_mixed(self) -> bool:
        """Forwards under torch.autocast, fp32 master weights."""
        return self is not Precision.FP32

    @property
    def dtype_name(self) -> str:
        """The dtype matmuls run in: the key of the FLOP-rate tables ("fp32", "bf16", "fp16")."""
        return {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}[self.value]

    @property
    def autocast_dtype(self):
        """torch's dtype for torch.autocast, None for fp32."""
        import torch  # here, not at the top: the program object and the CLI's parser stay torch-free

        return None if not self.is_mixed else getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[self.dtype_name])

    @property
    def compute_elem_bytes(self) -> int:
        """Bytes per element of what flows through matmuls and the activations they save (the cost
        model's activation and boundary dtype: partitioner/solver/problem.py)."""
        return 2 if self.is_mixed else 4

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling (Note [loss scaling]): fp16's 5 exponent bits underflow small gradients."""
        return self is Precision.FP16_MIXED


# ---------------------------------------------------------------------------------------------
# JSON <-> dataclass, one rule for every part


def known_keys(cls, data: Any, where: str, *, rename: dict[str, str] | None = None) -> dict:
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


def int_tuple(values, where: str) -> tuple[int, ...]:
    values = tuple(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where} must be a list of integers, got {list(values)}")
    return values


def check_positive(value, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")


def callable_spec(spec, where: str):
    """"pkg.mod:fn" stays a string; ["pkg.mod:fn", {kwargs}] becomes a tuple (frozen)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)) and spec and isinstance(spec[0], str) and len(spec) <= 2 \
            and (len(spec) == 1 or isinstance(spec[1], dict)):
        return tuple(spec)
    raise ValueError(f"{where} must be \"module:function\" or [\"module:function\", {{kwargs}}], "
                     f"got {spec!r}")


def jsonable(value):
    """A field's JSON form: tuples become lists, parts become their dicts, a policy its text."""
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
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
        object.__setattr__(self, "shape", int_tuple(self.shape, f"tensor {self.name!r} shape"))
        if self.batch_dim is not None and not 0 <= self.batch_dim < max(1, len(self.shape)):
            raise ValueError(f"tensor {self.name!r} has batch_dim {self.batch_dim} but shape "
                             f"{list(self.shape)}: use a dimension of the shape, or null")

    @staticmethod
    def from_dict(data: dict, where: str = "tensor") -> "TensorSpec":
        return TensorSpec(**known_keys(TensorSpec, data, where))

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
        keys = known_keys(StageSpec, data, where, rename={"class": "class_name"})
        for side in ("inputs", "outputs"):
            keys[side] = tuple(TensorSpec.from_dict(a, f"{where} {side}[{i}]")
                               for i, a in enumerate(keys[side]))
        return StageSpec(**keys)

    def to_dict(self) -> dict:
        return {"index": self.index, "module": self.module, "class": self.class_name,
                "params": list(self.params), "mutable_buffers": list(self.mutable_buffers),
                "inputs": jsonable(self.inputs), "outputs": jsonable(self.outputs)}


@dataclass(frozen=True)
class RankSpec:
    """One process. In each replica's pipeline (its ranks in ascending order) the rank at position
    j holds stages j, j+pp, j+2pp, ... (what torch.distributed.pipelining assumes; checked)."""

    rank: int
    stages: tuple[int, ...]  # the stages it holds (one, or several under "interleaved")
    replica: int             # its data-parallel replica, 0..dp-1
    tp_index: int = 0        # its place in its tensor group, 0..tensor_parallel-1 (innermost)

    def __post_init__(self):
        object.__setattr__(self, "stages", int_tuple(self.stages, f"rank {self.rank} stages"))

    @staticmethod
    def from_dict(data: dict, where: str = "rank") -> "RankSpec":
        return RankSpec(**known_keys(RankSpec, data, where))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stages": list(self.stages), "replica": self.replica,
                **({"tp_index": self.tp_index} if self.tp_index else {})}


@dataclass(frozen=True)
class TieSpec:
    """One trained parameter with a copy on several stages; its gradient is summed over the
    copies each step (then averaged over dp)."""

    param: str
    stages: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "stages", int_tuple(self.stages, f"tie of {self.param!r} stages"))

    @staticmethod
    def from_dict(data: dict, where: str = "tie") -> "TieSpec":
        return TieSpec(**known_keys(TieSpec, data, where))

    def to_dict(self) -> dict:
        return {"param": self.param, "stages": list(self.stages)}


@dataclass(frozen=True)
class DataSpec:
    """Where the ranks find the data: ``"module:function"`` or ``["module:function", {kwargs}]``;
    the module may also be a .py path relative to DIR (``resolve_callable``)."""

    make_batch: str | tuple  # make_batch(step, global_batch) -> (inputs, target), target batch on dim 0
    loss_fn: str | tuple     # loss_fn(output, target): a mean over its microbatch
    # make_batch's inputs are a dict of the forward's keyword inputs: their names, in the order of
    # stage 0's inputs (Note [keyword inputs] in runtime/data/synthetic.py). Empty: inputs are a tuple.
    keywords: tuple[str, ...] = ()
    # The inputs that hold no tensor, by keyword or position, with the values the trace baked into
    # the graph: checked against every batch and dropped (Note [constant inputs] in runtime/data/synthetic.py).
    constants: tuple = ()
    # rows(step, global_batch, *, rows, want) -> (inputs or None, target or None): the rows of the
    # global batch a rank's stages use, and only those read (Note [a rank reads its rows] in
    # runtime/execute/train.py); None: the rank slices make_batch's whole batch.
    rows: str | tuple | None = None
    # eval_batch(index, global_batch) -> (inputs, target): the validation split's batches; None:
    # the program has no validation data (a run's --eval-every is refused).
    eval_batch: str | tuple | None = None

    def __post_init__(self):
        object.__setattr__(self, "make_batch", callable_spec(self.make_batch, "data.make_batch"))
        object.__setattr__(self, "loss_fn", callable_spec(self.loss_fn, "data.loss_fn"))
        for role in ("rows", "eval_batch"):
            if getattr(self, role) is not None:
                object.__setattr__(self, role, callable_spec(getattr(self, role), f"data.{role}"))
        object.__setattr__(self, "keywords", tuple(self.keywords))
        if not all(isinstance(k, str) for k in self.keywords):
            raise ValueError(f"data.keywords must be a list of input names, got {list(self.keywords)}")
        if not all(isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], (str, int))
                   and not isinstance(c[0], bool) for c in self.constants):
            raise ValueError(f"data.constants must be a list of [keyword or position, value], got {self.constants!r}")
        object.__setattr__(self, "constants", tuple((c[0], c[1]) for c in self.constants))

    @staticmethod
    def from_dict(data: dict, where: str = "data") -> "DataSpec":
        return DataSpec(**known_keys(DataSpec, data, where))

    def to_dict(self) -> dict:
        out = {"make_batch": jsonable(self.make_batch), "loss_fn": jsonable(self.loss_fn)}
        if self.keywords:  # written only when set, so a positional program's object is unchanged
            out["keywords"] = list(self.keywords)
        if self.constants:
            out["constants"] = [[k, v] for k, v in self.constants]
        for role in ("rows", "eval_batch"):
            if getattr(self, role) is not None:
                out[role] = jsonable(getattr(self, role))
        return out


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and its learning-rate schedule (runtime/execute/train.py ``make_optimizer``, ``lr_factor``).
    The one set of optimizer defaults: a compile's settings start from these
    (partitioner/config/settings.py ``TrainingSettings``), and a hand-written program that leaves a key out
    gets the same value."""

    lr: float = 1e-3
    name: str = "adamw"                       # only "adamw"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 2                     # linear warmup; step 0 gets lr/warmup_steps
    lr_schedule: str = "cosine"               # "cosine" | "linear" | "constant" after warmup
    total_steps: int = 1000                   # where cosine/linear reach min_lr_ratio * lr
    min_lr_ratio: float = 0.0
    fused: bool | None = None                 # None: the fused kernel where torch has it
    foreach: bool | None = None
    no_decay: tuple[str, ...] = ()            # original names trained with weight_decay 0
                                              # (Note [no weight decay] in runtime/execute/grad_norm.py)

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        object.__setattr__(self, "no_decay", tuple(self.no_decay))
        if self.name.lower() != "adamw":
            raise ValueError(f"optimizer {self.name!r} is not supported (only 'adamw')")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} is not one of {LR_SCHEDULES}")

    @staticmethod
    def from_dict(data: dict, where: str = "optimizer") -> "OptimizerSettings":
        return OptimizerSettings(**known_keys(OptimizerSettings, data, where))

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
        if self.no_decay:
            out["no_decay"] = list(self.no_decay)
        return out


@dataclass(frozen=True)
class MemoryTierPlan:
    """The plan's choice of memory-tier snapshots (runtime/resilience/memtier; flags override it)."""

    mode: str                   # "auto" | "none" | "copy" | "parity" (runtime/resilience/memtier)
    every: int = 1              # snapshot every K steps
    group_size: int | None = None  # hosts per parity group

    @staticmethod
    def from_dict(data: dict, where: str = "memory_tier") -> "MemoryTierPlan":
        return MemoryTierPlan(**known_keys(MemoryTierPlan, data, where))

    def to_dict(self) -> dict:
        return {"mode": self.mode, "every": self.every, "group_size": self.group_size}


@dataclass(frozen=True)
class RandomnessSpec:
    """The random ops the compiler keyed (Note [randomness keyed by meaning] in
    runtime/execute/randomness.py); verify then picks the keyed oracle."""

    keyed_ops: tuple[str, ...]  # node names

    def __post_init__(self):
        object.__setattr__(self, "keyed_ops", tuple(self.keyed_ops))

    @staticmethod
    def from_dict(data: dict, where: str = "randomness") -> "RandomnessSpec":
        return RandomnessSpec(**known_keys(RandomnessSpec, data, where))

    def to_dict(self) -> dict:
        return {"keyed_ops": list(self.keyed_ops)}


@dataclass(frozen=True)
class InitRecipe:
    """How a rank draws one parameter of a model compiled on the meta device
    (Note [materialize per rank] in runtime/execute/materialize.py)."""

    shape: tuple[int, ...]
    dtype: str
    init: str                  # "normal" | "uniform" | "zeros" | "ones"
    std: float | None = None   # normal
    bound: float | None = None  # uniform: U(-bound, bound)

    def __post_init__(self):
        object.__setattr__(self, "shape", int_tuple(self.shape, "init recipe shape"))

    @staticmethod
    def from_dict(data: dict, where: str = "init recipe") -> "InitRecipe":
        return InitRecipe(**known_keys(InitRecipe, data, where))

    def to_dict(self) -> dict:
        out = {"shape": list(self.shape), "dtype": self.dtype, "init": self.init}
        out.update({k: getattr(self, k) for k in ("std", "bound") if getattr(self, k) is not None})
        return out


@dataclass(frozen=True)
class InitSpec:
    """Present when the ranks make their own weights (DIR/weights/ then has no files): a model
    compiled on the meta device, or one whose workload names a weights source."""

    seed: int
    params: dict[str, InitRecipe]  # original name -> recipe (parameters and buffers)
    # ["module:function", {kwargs}]: function(names) -> {name: tensor}, used instead of the recipes
    # (a Hugging Face model's own initialisation or pretrained files: runtime/execute/pretrained.py)
    weights: list | None = None

    @staticmethod
    def from_dict(data: dict, where: str = "init") -> "InitSpec":
        keys = known_keys(InitSpec, data, where)
        keys["params"] = {n: InitRecipe.from_dict(r, f"{where}.params[{n!r}]") for n, r in keys["params"].items()}
        return InitSpec(**keys)

    def to_dict(self) -> dict:
        out = {"seed": self.seed, "params": jsonable(self.params)}
        return out if self.weights is None else {**out, "weights": jsonable(list(self.weights))}


# ---------------------------------------------------------------------------------------------
# The program


class Values(Mapping):
    """A frozen, hashable table of setting key -> value (only the keys given): a feature's values in
    the settings, the decisions, the program and a run's flags (Note [one feature, one module] in
    runtime/features/__init__.py)."""

    def __init__(self, data: Mapping | None = None):
        self._data = dict(sorted((data or {}).items()))

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def __eq__(self, other):
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __hash__(self):
        return hash(tuple((k, repr(v)) for k, v in self._data.items()))

    def __repr__(self):
        return f"Values({self._data!r})"

    def to_dict(self) -> dict:
        return dict(self._data)
