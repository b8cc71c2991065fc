"""The pipeline schedules the runtime drives, one class each: what torch's schedule needs to run
(its refusal), how many microbatches a stage holds at its peak, and the order of a rank's actions.

Note [one class per schedule]: plan.json keeps the schedule's name; each record that reads it
(Program, Plan, Assignment: ``pipeline_schedule``) parses it once, by ``schedule_named``, into one
of these objects, and every question about it is a method or class fact: the torch class, the
refusals (torch's, compiled stages', canaries'), whether backward splits, whether a re-plan keeps
its cuts. The solver (partitioner/solver/schedules.py) adds the price to the same classes. A new
schedule is one new class here, and one in the solver if its price differs from the flat
pipeline's; no caller compares names (tests/unit/test_schedule_names.py). The rules are torch
2.13's (Note [only runnable plans] in partitioner/solver/problem.py), checked against torch's own
action order in tests/unit/test_solver_interleaved.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

Action = tuple[str, int, int]  # (kind "F"/"B"/"W", stage, microbatch)


@dataclass(frozen=True)
class PipelineSchedule:
    """One stage per rank unless ``local_stages`` > 1 (stage s on pipeline position s % ranks)."""

    local_stages: int = 1
    name: ClassVar[str] = ""
    # the torch.distributed.pipelining class, by name: a plan is validated without importing torch
    torch_class: ClassVar[str] = ""
    # the order of ``schedule_named``'s tie-break under --schedule auto: fewer activations first
    preference: ClassVar[int] = 0
    several_per_rank: ClassVar[bool] = False  # stage s on pipeline position s % ranks (``position_of``)
    # backward runs as an input-gradient action "B" and a later weight-gradient action "W"
    # (Note [zero-bubble schedules] in partitioner/solver/zero_bubble.py)
    split_backward: ClassVar[bool] = False
    # one stage per rank: a re-plan on fewer ranks keeps the cuts (Note [re-plan on the same cuts]
    # in partitioner/replan.py); several per rank are cut for one world size
    replans: ClassVar[bool] = False

    def __str__(self) -> str:
        return self.name  # plan.json's spelling, what messages and tables print

    def pipeline_ranks(self, num_stages: int) -> int:
        return num_stages // self.local_stages

    def position_of(self, stage: int, pipeline_ranks: int) -> int:
        """The pipeline position (rank of the pipeline group) that runs ``stage``: s % pp, torch's
        placement for every schedule but the V ones."""
        return stage % pipeline_ranks

    def position_words(self) -> str:
        """``position_of`` in words, for what OPTIMAL covers."""
        return "(stage % pipeline ranks)"

    def stages_at(self, position: int, pipeline_ranks: int, num_stages: int) -> tuple[int, ...]:
        """The stages the rank at ``position`` holds, ascending."""
        return tuple(s for s in range(num_stages) if self.position_of(s, pipeline_ranks) == position)

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

    def compiled_stages_refusal(self) -> str | None:
        """Why ``compile_stages`` cannot run under this schedule, naming the fix; None when it can
        (Note [zero-bubble schedules] in partitioner/solver/zero_bubble.py: a compiled stage's
        backward is one graph)."""
        if not self.split_backward:
            return None
        return (f"compile_stages with schedule {self.name} does not run yet (a compiled stage's backward is one graph, "
                "not split into input- and weight-gradient actions): recompile with --schedule 1f1b, gpipe or "
                "interleaved, or without --compile-stages")

    def canary_refusal(self, what: str) -> str | None:
        """Why a compute canary (Note [compute canaries] in runtime/resilience/canary.py) cannot run
        under this schedule, ``what`` naming the setting; None when it can: a canary records and
        re-runs the one stage of a rank, its backward as one piece."""
        if self.split_backward:  # Note [zero-bubble schedules]: B and W are separate actions
            return (f"{what}: a canary records a stage's backward as one piece, and schedule {self.name} splits it "
                    "into input- and weight-gradient actions: recompile with --schedule 1f1b or gpipe, or drop it")
        if self.local_stages > 1:
            return (f"{what}: a canary re-runs the one stage of a rank, and the {self.name} schedule puts "
                    f"{self.local_stages} on each: recompile with --schedule 1f1b or gpipe, or drop it")
        return None


@dataclass(frozen=True)
class GPipe(PipelineSchedule):
    """Every forward, then every backward: each stage holds all m microbatches."""

    name: ClassVar[str] = "gpipe"
    torch_class: ClassVar[str] = "ScheduleGPipe"
    preference: ClassVar[int] = 1
    replans: ClassVar[bool] = True

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
    replans: ClassVar[bool] = True

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


def torch_order(schedule_class: str, pipeline_ranks: int, local_stages: int,
                num_microbatches: int) -> dict[int, list]:
    """torch's own ``pipeline_order`` of a zero-bubble schedule (position -> its actions, None for a
    planned wait), computed without stages or process groups (torch: only to print or simulate)."""
    # torch: only to print or simulate the order (plan validation imports no torch)
    from torch.distributed.pipelining import schedules as torch_schedules

    sched = object.__new__(getattr(torch_schedules, schedule_class))
    sched.pp_group_size, sched.n_local_stages = pipeline_ranks, local_stages
    sched.num_stages = sched._num_stages = pipeline_ranks * local_stages
    sched._n_microbatches = num_microbatches
    sched.number_of_rounds = rounds(pipeline_ranks, num_microbatches)
    sched.microbatches_per_round = num_microbatches // sched.number_of_rounds
    sched.pipeline_order = {r: sched._calculate_single_rank_operations(r) for r in range(pipeline_ranks)}
    if hasattr(sched, "_add_bubbles_to_actions"):  # ZB1P adds its waits as torch's __init__ does
        sched.pipeline_order = sched._add_bubbles_to_actions(pipeline_ranks * local_stages)
    return sched.pipeline_order


_KINDS = {"F": "F", "I": "B", "W": "W", "B": "B"}  # torch's I (input gradient) is our B


@lru_cache(maxsize=1024)
def _split_order(schedule_class: str, position: int, pipeline_ranks: int, local_stages: int,
                 num_microbatches: int) -> tuple[Action, ...]:
    acts = []
    for a in torch_order(schedule_class, pipeline_ranks, local_stages, num_microbatches)[position]:
        if a is None:
            continue
        kind = getattr(a.computation_type, "value", str(a.computation_type))
        acts.append((_KINDS[kind], a.stage_index, a.microbatch_index))
    return tuple(acts)


@dataclass(frozen=True)
class ZeroBubble(Interleaved):
    """torch's ScheduleInterleavedZeroBubble (ZB1P): interleaved placement (stage s on position
    s % pp), backward split into B (input gradient) and W (weight gradient) actions, W filling the
    bubble (Note [zero-bubble schedules] in partitioner/solver/zero_bubble.py)."""

    name: ClassVar[str] = "zb"
    torch_class: ClassVar[str] = "ScheduleInterleavedZeroBubble"
    preference: ClassVar[int] = 3
    split_backward: ClassVar[bool] = True

    def refusal(self, num_stages, num_microbatches):
        why = super().refusal(num_stages, num_microbatches)
        return why and why.replace("schedule interleaved", "schedule zb").replace(
            "ScheduleInterleaved1F1B", self.torch_class)

    def rank_in_flight(self, position, pipeline_ranks, num_microbatches):
        """Microbatch-stages whose forward activations the rank holds at its peak (an F not yet
        followed by its W), read from torch's order."""
        return peak_held(self.rank_order(position, pipeline_ranks, pipeline_ranks * self.local_stages,
                                         num_microbatches))

    def in_flight(self, stage, num_stages, num_microbatches):
        """Microbatches whose activations ``stage`` holds at its peak: from its F until its W
        (Note [zero-bubble memory] in partitioner/solver/zero_bubble.py)."""
        pp = self.pipeline_ranks(num_stages)
        order = self.rank_order(self.position_of(stage, pp), pp, num_stages, num_microbatches)
        return peak_held([a for a in order if a[1] == stage])

    def rank_order(self, position, pipeline_ranks, num_stages, num_microbatches):
        return list(_split_order(self.torch_class, position, pipeline_ranks, self.local_stages, num_microbatches))

    def words(self) -> str:
        return f"the zb schedule (interleaved zero-bubble) at {self.local_stages} stages per rank"


@dataclass(frozen=True)
class ZeroBubbleV(ZeroBubble):
    """torch's ScheduleZBVZeroBubble: two stages per rank in a V (rank r holds stages r and
    2 pp - 1 - r, torch's ``generate_stage_to_rank_mapping(style="v")``), backward split as zb."""

    local_stages: int = 2
    name: ClassVar[str] = "zbv"
    torch_class: ClassVar[str] = "ScheduleZBVZeroBubble"
    preference: ClassVar[int] = 4

    def refusal(self, num_stages, num_microbatches):
        if self.local_stages != 2 or num_stages != 2 * (num_stages // 2) or num_stages < 4:
            return (f"schedule zbv needs exactly 2 stages on each of at least 2 pipeline ranks "
                    f"(torch's ScheduleZBVZeroBubble), got {num_stages} stages at {self.local_stages} per rank")
        return None

    def fix(self, num_stages):
        return "an even number of stages (2 per pipeline rank), or --schedule zb"

    def position_of(self, stage, pipeline_ranks):
        return stage if stage < pipeline_ranks else 2 * pipeline_ranks - 1 - stage

    def position_words(self) -> str:
        return "(stage, or 2 pp - 1 - stage: a V)"

    def words(self) -> str:
        return "the zbv schedule (V-shaped zero-bubble) at 2 stages per rank"


def peak_held(order: list[Action]) -> int:
    """The peak, along ``order``, of microbatch-stages holding activations: from F until W, and a
    microbatch between its B and its W counted twice (its kept gradients; Note [zero-bubble
    memory] in partitioner/solver/zero_bubble.py)."""
    held = peak = 0
    for kind, _stage, _mb in order:
        held += {"F": 1, "B": 1, "W": -2}[kind]
        peak = max(peak, held)
    return peak


# Note [DualPipeV refused]: torch 2.13's ScheduleDualPipeV overlaps one microbatch's forward with
# another's backward in one action (OVERLAP_F_B), which our generated stages cannot run as one
# and the cost model has no time for; its order also needs microbatches >= stages. So it is named
# and refused rather than run as something else.
REFUSED = {"dualpipev": "schedule dualpipev (torch's ScheduleDualPipeV) is not offered: its overlapped "
                        "forward+backward actions (OVERLAP_F_B) have no price in the cost model and it "
                        "needs microbatches >= stages; use --schedule zbv (the same V placement)"}

SCHEDULES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls for cls in (GPipe, OneFOneB, Interleaved, ZeroBubble, ZeroBubbleV)}


def schedule_named(name: str, local_stages: int = 1) -> PipelineSchedule:
    """The schedule object of a plan's schedule name; ``local_stages``: stages per rank (interleaved)."""
    if name in REFUSED:
        raise ValueError(REFUSED[name])
    try:
        cls = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"schedule={name!r} is not one of {tuple(SCHEDULES)}: use --schedule "
                         f"{' | '.join(SCHEDULES)}") from None
    if cls is ZeroBubbleV:
        return cls(2) if local_stages in (1, 2) else cls(local_stages)
    return cls(local_stages) if cls.several_per_rank else cls()


def compiled_stages_refusal(name: str) -> str | None:
    """``compiled_stages_refusal`` of the schedule a request names, before the solve; None for a
    name that is no schedule here ("auto", or one refused elsewhere with its own line)."""
    cls = SCHEDULES.get(name)
    return None if cls is None else cls().compiled_stages_refusal()
