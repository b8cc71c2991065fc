"""The pipeline schedules the runtime drives, one class each: what torch's schedule needs to run
(its refusal), how many microbatches a stage holds at its peak, and the order of a rank's actions.

Note [one class per schedule]: a schedule is chosen once, by name, into one of these objects
(``schedule_named``), and every question about it is a method: the runtime asks which torch class
to build and whether the program can run; the solver (partitioner/solver/schedules.py, which adds
the price: pipeline time and lower bound) asks the same object what a stage holds. A new schedule
is one new class here, and one in the solver if its price differs from the flat pipeline's; no
caller compares names. The rules are torch 2.13's (Note [only runnable plans] in
partitioner/solver/problem.py), checked against torch's own action order in
tests/unit/test_solver_interleaved.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

Action = tuple[str, int, int]  # (kind "F"/"B", stage, microbatch)


@dataclass(frozen=True)
class PipelineSchedule:
    """One stage per rank unless ``local_stages`` > 1 (stage s on pipeline position s % ranks)."""

    local_stages: int = 1
    name: ClassVar[str] = ""
    # the torch.distributed.pipelining class, by name: a plan is validated without importing torch
    torch_class: ClassVar[str] = ""
    # the order of ``schedule_named``'s tie-break under --schedule auto: fewer activations first
    preference: ClassVar[int] = 0
    several_per_rank: ClassVar[bool] = False  # stage s on pipeline position s % ranks

    def pipeline_ranks(self, num_stages: int) -> int:
        return num_stages // self.local_stages

    def refusal(self, num_stages: int, num_microbatches: int) -> str | None:
        """Why torch's schedule would refuse (stages, microbatches), or None."""
        return None

    def fix(self, num_stages: int) -> str:
        """What to recompile with when ``refusal`` says no."""
        return "--schedule gpipe"

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int) -> int:
        """Microbatches whose activations ``stage`` holds at its peak."""
        raise NotImplementedError

    def rank_order(self, position: int, pipeline_ranks: int, num_stages: int, num_microbatches: int) -> list[Action]:
        """The compute actions of the rank at ``position``, in the order torch executes them."""
        raise NotImplementedError

    def words(self) -> str:
        return f"the {self.name} schedule"


@dataclass(frozen=True)
class GPipe(PipelineSchedule):
    """Every forward, then every backward: each stage holds all m microbatches."""

    name: ClassVar[str] = "gpipe"
    torch_class: ClassVar[str] = "ScheduleGPipe"
    preference: ClassVar[int] = 1

    def in_flight(self, stage, num_stages, num_microbatches):
        return num_microbatches

    def rank_order(self, position, pipeline_ranks, num_stages, num_microbatches):
        m = num_microbatches
        return [("F", position, i) for i in range(m)] + [("B", position, i) for i in range(m)]


@dataclass(frozen=True)
class OneFOneB(PipelineSchedule):
    """Stage s warms up with p - s forwards, then alternates one backward, one forward."""

    name: ClassVar[str] = "1f1b"
    torch_class: ClassVar[str] = "Schedule1F1B"
    preference: ClassVar[int] = 0

    def refusal(self, num_stages, num_microbatches):
        if num_microbatches < num_stages:  # its warm-up sends one microbatch per later stage
            return (f"schedule 1f1b needs microbatches >= stages (torch's Schedule1F1B), got "
                    f"{num_microbatches} microbatches for {num_stages} stages")
        return None

    def fix(self, num_stages):
        return f"--microbatches {num_stages} or more, or --schedule gpipe"

    def in_flight(self, stage, num_stages, num_microbatches):
        return min(num_stages - stage, num_microbatches)

    def rank_order(self, position, pipeline_ranks, num_stages, num_microbatches):
        m = num_microbatches
        warm = min(m, num_stages - position)
        acts = [("F", position, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            acts.append(("B", position, b))
            b += 1
            if f < m:
                acts.append(("F", position, f))
                f += 1
        return acts


def rounds(pipeline_ranks: int, num_microbatches: int) -> int:
    """torch's ``number_of_rounds`` of interleaved 1F1B: max(1, m // pp)."""
    return max(1, num_microbatches // pipeline_ranks)


@dataclass(frozen=True)
class Interleaved(PipelineSchedule):
    """Interleaved 1F1B, ``local_stages`` v >= 2 stages per rank (Note [interleaved pricing] in
    partitioner/solver/interleaved.py)."""

    local_stages: int = 2
    name: ClassVar[str] = "interleaved"
    torch_class: ClassVar[str] = "ScheduleInterleaved1F1B"
    preference: ClassVar[int] = 2
    several_per_rank: ClassVar[bool] = True

    def refusal(self, num_stages, num_microbatches):
        v = self.local_stages
        if v < 2 or num_stages % v or num_stages // v < 2:
            return (f"schedule interleaved needs at least 2 pipeline ranks of at least 2 stages each, got "
                    f"{num_stages} stages at {v} per rank")
        pp = num_stages // v
        r = rounds(pp, num_microbatches)
        if num_microbatches % r:
            return (f"schedule interleaved needs microbatches to be a multiple of its rounds "
                    f"(torch's ScheduleInterleaved1F1B: max(1, {num_microbatches} // {pp}) = {r}), "
                    f"got {num_microbatches}: choose a multiple of {pp} microbatches")
        return None

    def fix(self, num_stages):
        pp = self.pipeline_ranks(num_stages)
        return f"a multiple of {pp} microbatches (--microbatches), or --schedule 1f1b"

    def rank_in_flight(self, position: int, pipeline_ranks: int, num_microbatches: int) -> int:
        """Microbatch-stages whose activations the rank at ``position`` holds at its peak: torch's
        warm-up count (v - 1) * m_round + 2 * (pp - 1 - position) forwards, plus the steady state's one
        forward before each backward, at most every microbatch of every local stage."""
        m, pp, v = num_microbatches, pipeline_ranks, self.local_stages
        per_round = m // rounds(pp, m)
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - position), m * v)
        return min(warmup + 1, m * v)

    def in_flight(self, stage, num_stages, num_microbatches):
        pp = self.pipeline_ranks(num_stages)
        return min(num_microbatches, self.rank_in_flight(stage % pp, pp, num_microbatches))

    def rank_order(self, position, pipeline_ranks, num_stages, num_microbatches):
        # torch: only to print or simulate the order (plan validation imports no torch)
        from torch.distributed.pipelining import ScheduleInterleaved1F1B

        # Ask torch's own Interleaved1F1B for its order without building stages or groups.
        sched = object.__new__(ScheduleInterleaved1F1B)
        sched.pp_group_size, sched.n_local_stages = pipeline_ranks, num_stages // pipeline_ranks
        sched._n_microbatches = num_microbatches
        sched.number_of_rounds = rounds(pipeline_ranks, num_microbatches)
        sched.microbatches_per_round = num_microbatches // sched.number_of_rounds
        acts = []
        for a in sched._calculate_single_rank_operations(position):
            if a is None:
                continue
            kind = getattr(a.computation_type, "value", str(a.computation_type))
            if kind in ("F", "B"):
                acts.append((kind, a.stage_index, a.microbatch_index))
        return acts

    def words(self) -> str:
        return f"the interleaved schedule at {self.local_stages} stages per rank"


SCHEDULES: dict[str, type[PipelineSchedule]] = {cls.name: cls for cls in (GPipe, OneFOneB, Interleaved)}


def schedule_named(name: str, local_stages: int = 1) -> PipelineSchedule:
    """The schedule object of a plan's schedule name; ``local_stages``: stages per rank (interleaved)."""
    try:
        cls = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"schedule={name!r} is not one of {tuple(SCHEDULES)}: use --schedule "
                         f"{' | '.join(SCHEDULES)}") from None
    return cls(local_stages) if cls is Interleaved else cls()
