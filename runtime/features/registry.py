"""The one list of training features (Note [one feature, one module] in runtime/features/__init__.py)
and the tables the shared files build from it."""

from __future__ import annotations

from runtime.features import canaries, evaluation, peak_memory
from runtime.features.base import Feature, Setting
from runtime.program.parts import Values

FEATURES: tuple[Feature, ...] = (canaries.FEATURE, evaluation.FEATURE, peak_memory.FEATURE)


def settings(*, side: str) -> tuple[Setting, ...]:
    """Every feature's settings of ``side``: "compile" (job file, compile flags, plan.json) or "run"."""
    return tuple(s for f in FEATURES for s in f.settings if getattr(s, side))


def asked(feature: Feature, values) -> Values:
    """The part of a settings table (``values``: key -> value) that is ``feature``'s."""
    return Values({s.key: values[s.key] for s in feature.settings if values.get(s.key) is not None})


def check(values: dict, *, side: str, where: str) -> Values:
    """``values`` (key -> value, None: not given) checked by their settings; ValueError naming ``where``."""
    known = {s.key: s for s in settings(side=side)}
    return Values({k: known[k].check(v, f"{where}.{k}" if where else k) for k, v in values.items() if v is not None})


def decided_keys() -> set[str]:
    """Every key a feature may write into plan.json's "decisions" (its compile settings' keys)."""
    return {s.key for s in settings(side="compile")}


def program_entries(decided) -> Values:
    """The program's "features" table from the compile's decisions (each feature's ``program``)."""
    out: dict = {}
    for feature in FEATURES:
        out.update(feature.program(asked(feature, decided)))
    return Values(out)
