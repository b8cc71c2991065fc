"""The solver's problem and answer as plain JSON: what plan.json keeps beside the plan so that
`partitioner inspect --node` prices moves with the solver's own cost model (Note [priced moves]
in partitioner/inspect/explain.py).

Generic on purpose: fields are read by the dataclasses' own names, so a field added to RegionCost,
Edge, SharedParam or Assignment later needs no change here. A reader ignores keys it does not know (a
newer plan.json) and leaves fields the JSON lacks at their defaults (an older one); a field
without a default that the JSON lacks means the file predates it, and the fix is to recompile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from partitioner.solver.problem import (Assignment, Edge, PartitionProblem, RegionCost, SharedParam,
                                       TensorParallelCost)

# Which dataclass each list-valued field holds, for the nested types.
_ITEMS = {PartitionProblem: {"regions": RegionCost, "edges": Edge, "ties": SharedParam}}
# Which dataclass each single nested field holds.
_ONE = {RegionCost: {"tp": TensorParallelCost}}
# Fields that moved into a nested one: a plan.json written before RegionCost.tp held them flat
# as tp_<name>, and is read as if nested (priced moves of a tensor-parallel plan stay priced).
_MOVED = {RegionCost: ("tp_", "tp")}


def to_dict(value) -> dict:
    """A PartitionProblem or an Assignment as JSON-ready plain data (every number exact)."""
    return dataclasses.asdict(value)


def _build(cls, body: dict[str, Any], where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    nested, one = _ITEMS.get(cls, {}), _ONE.get(cls, {})
    if cls in _MOVED:
        prefix, into = _MOVED[cls]
        moved = {k[len(prefix):]: v for k, v in body.items() if k.startswith(prefix) and k not in known}
        if moved and into not in body:
            body = {**body, into: moved}
    kwargs = {}
    for name, value in body.items():
        if name not in known:
            continue  # written by a newer compiler: not needed to price this plan
        if name in nested:
            value = tuple(_build(nested[name], item, f"{where}.{name}[{i}]") for i, item in enumerate(value))
        elif name in one and isinstance(value, dict):
            value = _build(one[name], value, f"{where}.{name}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where} lacks fields {cls.__name__} needs ({exc}): the plan was written by an "
                         "older compiler; recompile it with `partitioner compile`") from None


def problem_from_dict(body: dict, where: str = "problem") -> PartitionProblem:
    return _build(PartitionProblem, body, where)


def assignment_from_dict(body: dict, where: str = "assignment") -> Assignment:
    return _build(Assignment, body, where)
