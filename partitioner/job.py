"""Training settings: the defaults, a job file, the Python ``training=`` dict and CLI flags, merged
key by key and checked once.

Note [training settings merge]: the settings a plan records (``Plan.training``, the source of the
program's optimizer, seed, timeouts and checkpoint cadence) are, lowest first,
``DEFAULT_TRAINING`` < the job file's ``[training]`` < ``compile(training=...)`` / CLI flags. The
merge is deep: ``training={"optimizer": {"lr": 3e-4}}`` changes the learning rate and keeps the
default betas, weight decay and schedule (a shallow merge would have replaced the whole optimizer
dict). Every key is checked against one schema (``TRAINING_SCHEMA``): an unknown key or a value of
the wrong type is a ValueError naming the key, where it came from, and what it must be, raised
before anything is traced.

A job file (TOML, README "Job file")::

    [training]
    lr = 3e-4
    warmup_steps = 100
    lr_schedule = "cosine"      # cosine | linear | constant
    min_lr_ratio = 0.1
    betas = [0.9, 0.95]
    weight_decay = 0.1
    steps = 2000                # the schedule's length, and the steps `partitioner run` trains
    clip_grad_norm = 1.0        # global gradient-norm clipping; leave out for none
    checkpoint_every = 200      # or mtbf = "6h"
    sdc_every = 20              # compare the replicas' digests every K steps (0: off; Note [replica digests])
    seed = 0

    [cluster]                   # the cluster file's format, inline; or: cluster = "cluster.toml"
    [[cluster.group]]
    kind = "h100"
    count = 8
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

from partitioner.cluster import ClusterSpec
from runtime.program_parts import LR_SCHEDULES

DEFAULT_TRAINING = {
    "optimizer": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                  "warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 1000},
    "seed": 0,
    "collective_timeout_s": 60,
    "checkpoint_every": 0,
}


# -- value checks: each returns the value (normalized) or raises naming ``where`` -------------------


def _number(value, where: str, *, low: float | None = None, low_open: bool = False, high: float | None = None):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} = {value!r} must be a number")
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
    return _check_table(value, MEMORY_TIER_SCHEMA, where)


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
    # Note [replica digests] (runtime/sdc.py); 0: off; left out: sdc_cost.default_every(dp)
    "sdc_every": lambda v, w: _integer(v, w, low=0),
    "mtbf_s": _positive,
    "memory_tier": _memory_tier,
    "model_spec": _string,  # how `partitioner verify` rebuilds the model (set by the CLI)
    "pretrained": _string,
    # Global gradient-norm clipping (Note [global gradient norm] in runtime/grad_norm.py); None: off.
    "clip_grad_norm": _optional(_positive),
    "precision": _choice(("fp32", "bf16-mixed", "fp16-mixed")),  # Note [mixed precision]
    "no_weight_decay": _no_weight_decay,  # "default", "none" or fnmatch patterns (Note [no weight decay])  # the Hugging Face weights folder an hf: model starts from (set by the CLI)
}


def _check_table(table: Any, schema: dict, where: str) -> dict:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table of settings, got {type(table).__name__} {table!r}")
    unknown = sorted(set(table) - set(schema))
    if unknown:
        raise ValueError(f"{where} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"known keys: {', '.join(sorted(schema))}")
    out = {}
    for key, value in table.items():
        check = schema[key]
        out[key] = _check_table(value, check, f"{where}.{key}") if isinstance(check, dict) else check(value, f"{where}.{key}")
    return out


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` with ``override``'s keys laid over it, tables merged key by key (neither changed)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def training_settings(*layers: dict | None, names: tuple[str, ...] | None = None) -> dict:
    """DEFAULT_TRAINING with each of ``layers`` (lowest first) merged over it, each checked first
    (Note [training settings merge]); ``names`` say where each layer came from, for the errors."""
    merged = copy.deepcopy(DEFAULT_TRAINING)  # callers add keys to what they get: never to the defaults
    for i, layer in enumerate(layers):
        if not layer:
            continue
        where = names[i] if names else "training"
        merged = deep_merge(merged, _check_table(layer, TRAINING_SCHEMA, where))
    return merged


# -- the job file -------------------------------------------------------------------------------

# [training] key -> (path in the training settings, check); "steps" is the schedule's length.
JOB_TRAINING_KEYS = {
    "lr": ("optimizer", "lr"),
    "betas": ("optimizer", "betas"),
    "eps": ("optimizer", "eps"),
    "weight_decay": ("optimizer", "weight_decay"),
    "warmup_steps": ("optimizer", "warmup_steps"),
    "lr_schedule": ("optimizer", "lr_schedule"),
    "min_lr_ratio": ("optimizer", "min_lr_ratio"),
    "steps": ("optimizer", "total_steps"),
    "clip_grad_norm": ("clip_grad_norm",),
    "precision": ("precision",),
    "checkpoint_every": ("checkpoint_every",),
    "sdc_every": ("sdc_every",),
    "mtbf": ("mtbf_s",),
    "seed": ("seed",),
    "collective_timeout_s": ("collective_timeout_s",),
    "memory_tier": ("memory_tier",),
}


def nested_training(flat: dict, where: str) -> dict:
    """A job file's flat ``[training]`` keys as the nested training settings (checked later)."""
    if not isinstance(flat, dict):
        raise ValueError(f"{where} must be a table, e.g. [training] lr = 3e-4")
    unknown = sorted(set(flat) - set(JOB_TRAINING_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"known keys: {', '.join(sorted(JOB_TRAINING_KEYS))}")
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = JOB_TRAINING_KEYS[key]
        if key == "mtbf" and isinstance(value, str):
            # lazy: loads torch
            from runtime.checkpoint import parse_duration_s

            try:
                value = parse_duration_s(value)
            except ValueError as exc:
                raise ValueError(f"{where}.mtbf: {exc}") from None
        table = out
        for parent in parents:
            table = table.setdefault(parent, {})
        table[leaf] = value
    if "checkpoint_every" in flat and "mtbf" in flat:
        raise ValueError(f"{where} sets both checkpoint_every and mtbf: keep one (mtbf picks the interval)")
    # Name errors by the file's keys, not the internal ones.
    try:
        _check_table(out, TRAINING_SCHEMA, where)
    except ValueError as exc:
        text = str(exc).replace(f"{where}.optimizer.total_steps", f"{where}.steps").replace(
            f"{where}.optimizer.", f"{where}.").replace(f"{where}.mtbf_s", f"{where}.mtbf")
        raise ValueError(text) from None
    return out


class Job:
    """A job file, read and checked: ``training`` (nested settings) and ``cluster`` (a ClusterSpec or None)."""

    def __init__(self, path: str | Path, training: dict, cluster):
        self.path, self.training, self.cluster = Path(path), training, cluster


def load_job(path: str | Path) -> Job:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--job {path}: no such file; write a job TOML with [training] (README \"Job file\")")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"job file {path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"training", "cluster"})
    if unknown:
        raise ValueError(f"job file {path} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         "known: [training], [cluster] (or cluster = \"cluster.toml\")")
    training = nested_training(data.get("training", {}), f"job file {path} [training]")
    cluster = None
    if "cluster" in data:
        spec = data["cluster"]
        if isinstance(spec, str):
            file = (path.parent / spec) if not Path(spec).is_absolute() else Path(spec)
            if not file.is_file():
                raise ValueError(f"job file {path}: cluster = {spec!r}: no such file ({file})")
            cluster = ClusterSpec.from_toml(file)
        else:
            try:
                cluster = ClusterSpec.from_dict(spec)
            except ValueError as exc:
                raise ValueError(f"job file {path} [cluster]: {exc}") from None
    return Job(path, training, cluster)
