"""The "program" object of plan.json: loading, validation, and the rank layout derived from it.

Pure Python (no process group needed), so it is unit-tested in milliseconds. See the package
docstring (``runtime/__init__.py``) for the folder contract and every field.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Callable

from runtime.errors import PlanMismatchError

SCHEDULES = ("gpipe", "1f1b", "interleaved")

_REQUIRED = ("world_size", "num_stages", "dp", "num_microbatches", "global_batch", "schedule",
             "ranks", "stages", "data", "optimizer")


def load_plan(folder: str) -> dict:
    path = os.path.join(folder, "plan.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {folder!r} a program folder written by "
                                "`partitioner compile -o DIR`?")
    with open(path) as f:
        return json.load(f)


def verify_files(folder: str, plan: dict) -> None:
    """Every file plan.json lists must hash to the listed sha256 (DESIGN section 7)."""
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


def load_program(folder: str) -> dict:
    """plan.json's "program" object, validated, with defaults filled in (a new dict)."""
    plan = load_plan(folder)
    verify_files(folder, plan)
    if "program" not in plan:
        raise ValueError(f"{folder}/plan.json has no \"program\" object (keys: {sorted(plan)})")
    program = dict(plan["program"])
    program.setdefault("plan_hash", plan.get("plan_hash"))
    # What checkpoints record and check (runtime/checkpoint/manifest.py), from the plan's top level.
    program.setdefault("model_fingerprint", plan.get("model_fingerprint"))
    program.setdefault("workload", plan.get("workload"))
    training = plan.get("training") or {}
    if training.get("mtbf_s") is not None:
        program.setdefault("mtbf_s", training["mtbf_s"])
    validate_program(program)
    return program


def validate_program(program: dict) -> None:
    """Fill defaults and check consistency; raises ValueError naming the values and the fix."""
    missing = [k for k in _REQUIRED if k not in program]
    if missing:
        raise ValueError(f"program object lacks {missing}")
    program.setdefault("device", "cpu")
    program.setdefault("backend", "gloo" if program["device"] == "cpu" else "nccl")
    program.setdefault("ties", [])
    program.setdefault("seed", 0)
    program.setdefault("collective_timeout_s", 600)
    program.setdefault("steps", program["optimizer"].get("total_steps", 1))
    if program["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule {program['schedule']!r} is not one of {SCHEDULES}")
    world, p, dp, m = (program[k] for k in ("world_size", "num_stages", "dp", "num_microbatches"))
    if len(program["stages"]) != p:
        raise ValueError(f"num_stages={p} but {len(program['stages'])} stage entries")
    for i, st in enumerate(program["stages"]):
        if st["index"] != i:
            raise ValueError(f"stages[{i}] has index {st['index']}: stages must be listed in order")
    # Note [only runnable plans] in partitioner/solver/problem.py: the solver never emits these,
    # but a hand-edited or hand-written program must fail here, in words, not inside every rank.
    if program["schedule"] == "1f1b" and m < p:
        raise ValueError(f"schedule 1f1b needs num_microbatches >= num_stages (torch's Schedule1F1B), "
                         f"got {m} microbatches for {p} stages: recompile with --microbatches {p} or more, "
                         "or --schedule gpipe")
    if len(program["ranks"]) != world:
        raise ValueError(f"world_size={world} but {len(program['ranks'])} rank entries")
    b = program["global_batch"]
    if b % (dp * m):
        raise ValueError(f"global_batch={b} is not divisible by dp*num_microbatches={dp}*{m}: "
                         "choose a batch that is a multiple of dp*num_microbatches")
    micro = b // (dp * m)
    for st in program["stages"]:
        for arg in st["inputs"] + st["outputs"]:
            bd = arg.get("batch_dim", 0)
            if bd is not None and arg["shape"][bd] != micro:
                raise ValueError(
                    f"stage {st['index']} {arg['name']} has shape {arg['shape']} (batch_dim {bd}) but "
                    f"the microbatch is global_batch/(dp*num_microbatches) = {b}/({dp}*{m}) = {micro}")
    stages = program["stages"]
    for k in range(1, p):
        sent = [(a["shape"], a["dtype"]) for a in stages[k - 1]["outputs"]]
        received = [(a["shape"], a["dtype"]) for a in stages[k]["inputs"]]
        if sent != received:
            raise ValueError(f"stage {k - 1} sends {sent} but stage {k} receives {received}: each "
                             "stage's inputs must be the previous stage's outputs, in order")
    for tie in program["ties"]:
        if len(tie["stages"]) < 2 or not all(0 <= s < p for s in tie["stages"]):
            raise ValueError(f"tie {tie} must name two or more stages among 0..{p - 1}")
        lacking = [s for s in tie["stages"]
                   if "params" in stages[s] and tie["param"] not in stages[s]["params"]]
        if lacking:
            raise ValueError(f"tie of {tie['param']!r} names stages {lacking}, which do not list it in "
                             "params (only trained parameters are ties; a buffer read on several "
                             "stages is held by each): recompile the program")
    holder: dict[str, int] = {}
    for st in stages:
        for name in st.get("mutable_buffers", []):
            if name in holder:
                raise ValueError(
                    f"mutable buffer {name!r} is listed by stages {holder[name]} and {st['index']}: the "
                    "forward updates it, so one stage must hold it (Note [mutable buffers] in "
                    "partitioner/split.py); recompile the program")
            holder[name] = st["index"]
    layout = Layout.from_program(program)  # raises if the rank layout is inconsistent
    rounds = max(1, m // layout.pp_size)
    if program["schedule"] == "interleaved" and m % rounds:
        raise ValueError(f"schedule interleaved needs num_microbatches to be a multiple of its rounds "
                         f"(max(1, {m} // {layout.pp_size} pipeline ranks) = {rounds}), got {m}: choose "
                         f"a multiple of {layout.pp_size} microbatches")


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
    def from_program(program: dict) -> "Layout":
        world, p, dp = program["world_size"], program["num_stages"], program["dp"]
        stages_of = [()] * world
        replica_of = [0] * world
        for entry in program["ranks"]:
            r = entry["rank"]
            if not 0 <= r < world:
                raise ValueError(f"rank entry {entry} is outside world_size={world}")
            stages_of[r] = tuple(sorted(entry["stages"]))
            replica_of[r] = entry["replica"]
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
        for tie in program.get("ties", []):
            per_rep = []
            for pl in pipelines:
                per_rep.append(tuple(r for r in pl if set(stages_of[r]) & set(tie["stages"])))
            tie_groups.append(tuple(per_rep))
        return Layout(world, p, dp, tuple(stages_of), tuple(replica_of), tuple(pipelines),
                      dp_groups, tuple(tie_groups))

    @property
    def pp_size(self) -> int:
        return len(self.pipelines[0])

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

