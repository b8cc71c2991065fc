"""Training settings: the defaults, a job file, the Python ``training=`` dict and CLI flags, merged
key by key and checked once.

Note [training settings merge]: the settings a plan records (``Plan.training``, a
``TrainingSettings`` of partitioner/config/settings.py: the source of the program's optimizer, seed,
timeouts and checkpoint cadence) are, lowest first, the defaults (``TrainingSettings()``, whose
optimizer defaults are runtime/program/parts.py ``OptimizerSettings``'s: one set) < the job file's
``[training]`` < ``compile(training=...)`` < CLI flags and compile's keyword settings. The merge is
deep: ``training={"optimizer": {"lr": 3e-4}}`` changes the learning rate and keeps the default
betas, weight decay and schedule (a shallow merge would have replaced the whole optimizer dict).
Every key is checked against one schema (``TRAINING_SCHEMA``): an unknown key or a value of the
wrong type is a ValueError naming the key, where it came from, and what it must be, raised before
anything is traced.

A job file (TOML, docs/configuration.md)::

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
    compile_stages = true       # torch.compile each stage (Note [compiled stages]); default off
    recompute = "full"          # auto | none | full (Note [recompute a user pins]); default auto
                                # and each feature's keys (runtime/features/: its module says them)

    [cluster]                   # the cluster file's format, inline; or: cluster = "cluster.toml"
    [[cluster.group]]
    kind = "h100"
    count = 8
"""

from __future__ import annotations

import copy
from pathlib import Path

from partitioner.config.settings import TRAINING_SCHEMA, TrainingSettings, check_table
from partitioner.config.cluster import ClusterSpec, read_toml
from runtime.data.corpus.spec import absolute_spec
from runtime.features import registry


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` with ``override``'s keys laid over it, tables merged key by key (neither changed)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def training_settings(*layers: dict | None, names: tuple[str, ...] | None = None) -> TrainingSettings:
    """The defaults with each of ``layers`` (lowest first) merged over it, each checked first
    (Note [training settings merge]); ``names`` say where each layer came from, for the errors."""
    merged: dict = {}
    for i, layer in enumerate(layers):
        if not layer:
            continue
        where = names[i] if names else "training"
        merged = deep_merge(merged, check_table(layer, TRAINING_SCHEMA, where))
    return TrainingSettings.from_dict(merged)


DEFAULT_TRAINING = TrainingSettings().to_dict()  # the defaults as a table (what a job file starts from)


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
    "compile_stages": ("compile_stages",),  # Note [compiled stages] in runtime/execute/compile_stages.py
    "recompute": ("recompute",),  # Note [recompute a user pins] in partitioner/solver/recompute_cost.py
    **{s.key: (s.key,) for s in registry.settings(side="compile")},  # Note [one feature, one module]
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
            from runtime.resilience.checkpoint import parse_duration_s

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
        check_table(out, TRAINING_SCHEMA, where)
    except ValueError as exc:
        text = str(exc).replace(f"{where}.optimizer.total_steps", f"{where}.steps").replace(
            f"{where}.optimizer.", f"{where}.").replace(f"{where}.mtbf_s", f"{where}.mtbf")
        raise ValueError(text) from None
    return out


class Job:
    """A job file, read and checked: ``training`` (nested settings, a table) and ``cluster`` (a ClusterSpec or None)."""

    def __init__(self, path: str | Path, training: dict, cluster):
        self.path, self.training, self.cluster = Path(path), training, cluster


def load_job(path: str | Path) -> Job:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--job {path}: no such file; write a job TOML with [training] (docs/configuration.md)")
    data = read_toml(path, "job file")
    unknown = sorted(set(data) - {"training", "cluster", "data"})
    if unknown:
        raise ValueError(f"job file {path} has unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         "known: [training], [data], [cluster] (or cluster = \"cluster.toml\")")
    training = nested_training(data.get("training", {}), f"job file {path} [training]")
    if "data" in data:  # [data] source = "tokens:DIR": the corpus the program trains on
        table = data["data"]
        if not isinstance(table, dict) or set(table) != {"source"} or not isinstance(table["source"], str):
            raise ValueError(f"job file {path} [data]: write source = \"tokens:DIR\" (or megatron:PREFIX, "
                             f"hf-disk:DIR, tokens:FILE.bin,dtype=uint16), got {table!r}")
        training["data"] = absolute_spec(table["source"], path.parent)  # relative to the job file
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
