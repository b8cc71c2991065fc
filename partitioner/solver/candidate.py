"""One candidate of the search: how many stages, replicas and microbatches, the microbatch size
and the schedule, as one value (candidates.py enumerates them, placed.py solves one over its
placements). Its short names p, d, m, b are the notation of the Notes."""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.solver.problem import Assignment
from partitioner.solver.schedules import PricedSchedule, priced_schedule


@dataclass(frozen=True)
class Candidate:
    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    schedule: str = "1f1b"
    local_stages: int = 1  # stages per rank (Note [interleaved pricing] in interleaved.py)

    @classmethod
    def of(cls, num_stages: int, dp: int, num_microbatches: int, global_batch: int, schedule: str,
           local_stages: int | None) -> "Candidate":
        """The candidate (p, d, m) of a global batch; ``local_stages``: SolverConfig's (None: 1,
        or the schedule's own when it puts several stages on a rank)."""
        priced = priced_schedule(schedule, local_stages)
        if priced.several_per_rank and not priced.local_stages:
            raise ValueError(f"schedule {schedule} puts several stages on a rank: the candidate needs "
                             "SolverConfig.local_stages (solve() tries each)")
        return cls(num_stages, dp, num_microbatches, global_batch // (dp * num_microbatches), schedule,
                   priced.local_stages or 1)

    @property
    def p(self) -> int:
        return self.num_stages

    @property
    def d(self) -> int:
        return self.dp

    @property
    def m(self) -> int:
        return self.num_microbatches

    @property
    def b(self) -> int:
        return self.microbatch_size

    @property
    def pipeline_schedule(self) -> PricedSchedule:
        """Note [one class per schedule] in runtime/program/schedules.py."""
        return priced_schedule(self.schedule, self.local_stages)

    def assignment(self, stage_of_region, recompute, placement) -> Assignment:
        return Assignment(stage_of_region=stage_of_region, recompute=recompute, device_of_stage_replica=placement,
                          num_stages=self.p, dp=self.d, num_microbatches=self.m, microbatch_size=self.b,
                          schedule=self.schedule)
