"""What a training feature declares (Note [one feature, one module] in runtime/features/__init__.py):
its settings, its refusals, what it adds to the compile and what it hooks around a step.

Torch-free: `partitioner run --help`, the job-file reader and the run flag table import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Setting:
    """One setting of a feature: its training key (job file, ``training=``, plan.json), its flag and help."""

    key: str                       # the job-file key, the Python training= key, and plan.json's key
    help: str
    type: Callable | None = int    # int, float or str; None: a switch (run flags only)
    low: float | None = None       # the least value (ints, floats)
    fix: str = ""                  # what to give instead, said after "FLAG VALUE: " or "key = VALUE: "
    compile: bool = True           # a compile setting (`partitioner compile` flag, job file, plan.json)
    run: bool = False              # a run flag (`partitioner run`, train.py): overrides the plan's value
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def check(self, value, where: str):
        """``value`` (normalized) or ValueError naming ``where``, the value and the fix."""
        if self.type is None:
            if not isinstance(value, bool):
                raise ValueError(f"{where} = {value!r} must be true or false")
            return value
        if self.type in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                          or (self.type is int and not isinstance(value, int))):
            raise ValueError(f"{where} = {value!r} must be a {'whole number' if self.type is int else 'number'}")
        if self.type is float and not math.isfinite(value):
            raise ValueError(f"{where} = {value!r} must be a finite number")
        if self.low is not None and value < self.low:
            raise ValueError(f"{where} = {value!r}: {self.fix or f'must be >= {self.low:g}'}")
        return self.type(value)

    def flag_error(self, value) -> str | None:
        """The run flag's one-line refusal of ``value``, or None."""
        try:
            self.check(value, self.flag)
        except ValueError:
            return f"{self.flag} {value}: {self.fix or f'give a value >= {self.low:g}'}"
        return None


@dataclass(frozen=True)
class Layout:
    """What the solver chose that a feature's compile part reads: plain values."""

    dp: int
    tensor_parallel: int
    sharded: bool
    local_stages: int
    schedule: Any                   # the plan's PipelineSchedule (runtime/program/schedules.py)


@dataclass(frozen=True)
class PriceFacts:
    """What a feature's pricing reads of a plan (Note [feature pricing]): plain values."""

    stages: tuple                   # the plan's StagePlans, in order
    world_size: int
    latency_s: float                # the slowest data-parallel link's
    bandwidth_bytes_per_s: float


@dataclass
class Hooks:
    """What a feature attaches to one rank's run; every part optional."""

    before_step: Callable[[int], None] | None = None
    after_step: Callable[[int], None] | None = None
    rolled_back: Callable[[int], None] | None = None   # after a rollback to this step (Note [replica digests])
    finish: Callable[[], None] | None = None           # after the last step, before the final save
    digest_check: Any = None                           # what sdc.roll_back reads (every, run_dir, last_agreed)
    evaluator: Any = None                              # what RankTrainer.run evaluates with
    wrap_after_step: Callable | None = None            # the whole after-step hook, wrapped (run unmeasured)


@dataclass(frozen=True)
class Run:
    """What a feature's run part reads of the rank it attaches to (built by runtime/launch/rank.py)."""

    program: Any                    # the Program
    options: Any                    # the RunOptions
    rank: int
    world: int
    trainer: Any
    folder: str
    run_dir: str
    start_step: int
    steps: int
    device: Any
    hosts: list[int] = field(default_factory=list)

    def value(self, key: str):
        """A run flag's value when given, else the program's (None: neither)."""
        given = self.options.features.get(key)
        return self.program.features.get(key) if given is None else given


class Feature:
    """A training feature; subclasses override what they need (the defaults do nothing)."""

    name = ""
    settings: tuple[Setting, ...] = ()
    pricing: str | None = None     # a partitioner/solver module whose predicted(decided, facts) prices it
                                   # (Note [feature pricing] in runtime/features/__init__.py)

    # -- compile ---------------------------------------------------------------------------------
    def sharding(self, asked: Mapping, shard: str) -> str:
        """The sharding request (auto | on | off) once this feature's settings ``asked`` are read."""
        return shard

    def decide(self, asked: Mapping, layout: Layout) -> dict:
        """What the compile decides for this feature (plan.json "decisions" keys); ValueError when
        the plan cannot run it exactly."""
        return {}

    def program(self, decided: Mapping) -> dict:
        """The program's entries (plan.json program "features") of the decisions."""
        return {}

    def inspect_lines(self, decided: Mapping, predicted: Mapping, dp: int, ms: Callable[[float], str]) -> list[str]:
        """`inspect`'s lines of the plan's decisions (``ms``: seconds as inspect writes milliseconds)."""
        return []

    # -- run -------------------------------------------------------------------------------------
    def flags_refusal(self, given: Mapping) -> str | None:
        """Why this feature's run flags ``given`` (key -> value) do not go together."""
        return None

    def run_refusal(self, program: Mapping, options) -> str | None:
        """Why `partitioner run` must not start ``program`` (plan.json's "program" dict) as asked."""
        return None

    def replanned(self, program: Mapping, options, say: Callable[[str], None]) -> dict:
        """Run flags changed for a re-planned folder's ``program`` (Note [elastic run])."""
        return {}

    def rank_refusal(self, program, options, rank: int) -> str | None:
        """Why this rank must not start (checked before anything slow, on every rank alike)."""
        return None

    def attach(self, run: Run) -> Hooks | None:
        return None
