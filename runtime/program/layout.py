"""Which rank holds what, and the process groups every rank creates: derived from the program
object (runtime/program/spec.py), pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.program.schedules import schedule_named

if TYPE_CHECKING:  # annotations only: the program builds its layout from here
    from runtime.program.spec import Program


@dataclass(frozen=True)
class Layout:
    """Which rank holds what, and the process groups every rank must create (in this order).

    Note [group order]: ``torch.distributed.new_group`` is collective over the world, so every rank
    creates every group, members or not, in one fixed order: pipelines (by replica, then tensor
    index), then data-parallel groups (by pipeline position, then tensor index), then tie groups
    (by tie, then pipeline), then tensor groups. Groups of one rank are not created except
    pipelines, which PipelineStage needs.

    With tensor parallelism (Note [tensor-parallel stages] in runtime/parallel/tensor_parallel.py) each
    tensor index t runs its own copy of the pp x dp layout: pipeline ``replica * tp + t`` is the
    ranks of that replica with tensor index t, a data-parallel group joins the replicas' ranks of
    one position and one t, and the ranks of one stage replica form a tensor group.
    """

    world_size: int
    num_stages: int
    dp: int
    stages_of_rank: tuple[tuple[int, ...], ...]  # rank -> its stage indices (ascending)
    replica_of_rank: tuple[int, ...]
    pipelines: tuple[tuple[int, ...], ...]  # replica * tp + t -> ranks, ascending == pipeline group rank order
    dp_groups: tuple[tuple[int, ...], ...]  # (pipeline position, t) -> ranks (one per replica)
    tie_groups: tuple[tuple[tuple[int, ...], ...], ...]  # tie -> pipeline -> ranks holding a copy
    tensor_parallel: int = 1
    tp_index_of_rank: tuple[int, ...] = ()
    tensor_groups: tuple[tuple[int, ...], ...] = ()  # the ranks of one stage replica (tp > 1 only)
    position_of_stage: tuple[int, ...] = ()  # stage -> pipeline position (s % pp, or the V schedules')

    @staticmethod
    def from_program(program: Program) -> "Layout":
        world, p, dp, tp = program.world_size, program.num_stages, program.dp, program.tensor_parallel
        stages_of = [()] * world
        replica_of = [0] * world
        tp_of = [0] * world
        for entry in program.ranks:
            r = entry.rank
            if not 0 <= r < world:
                raise ValueError(f"rank entry {entry.to_dict()} is outside world_size={world}")
            stages_of[r] = tuple(sorted(entry.stages))
            replica_of[r] = entry.replica
            tp_of[r] = entry.tp_index
        if tp > 1:
            if world % tp:
                raise ValueError(f"world_size={world} is not a multiple of tensor_parallel={tp}: recompile")
            for r in range(world):
                first = r - r % tp
                if tp_of[r] != r % tp or (stages_of[r], replica_of[r]) != (stages_of[first], replica_of[first]):
                    raise ValueError(f"rank {r}: with tensor_parallel={tp} rank r has tp_index r % {tp} and the "
                                     f"stages and replica of rank r - r % {tp} (its tensor group's first): recompile")
        members: dict[tuple[int, int], list[int]] = {}  # one pass over the ranks, not one per pipeline
        for r in range(world):
            members.setdefault((replica_of[r], tp_of[r]), []).append(r)
        pipelines = []
        for rep in range(dp):
            for t in range(tp):
                ranks = tuple(members.get((rep, t), ()))
                held = sorted(s for r in ranks for s in stages_of[r])
                if held != list(range(p)):
                    raise ValueError(f"replica {rep} (ranks {list(ranks)}) holds stages {held}; "
                                     f"each replica must hold every stage 0..{p - 1} exactly once")
                pipelines.append(ranks)
        sizes = {len(pl) for pl in pipelines}
        if len(sizes) != 1:
            raise ValueError(f"replicas have pipelines of different lengths: {pipelines}")
        pp = sizes.pop()
        # torch.distributed.pipelining places stage s on pipeline-group rank s % group size, or in
        # a V for the V schedules (group ranks follow ascending global rank): the plan must agree
        # (Note [one class per schedule]).
        schedule = schedule_named(program.schedule, p // pp)
        for rep, pl in enumerate(pipelines):
            for pos, r in enumerate(pl):
                want = schedule.stages_at(pos, pp, p)
                if stages_of[r] != want:
                    raise ValueError(
                        f"rank {r} (position {pos} of pipeline {list(pl)}) holds stages {list(stages_of[r])}, "
                        f"but {schedule.words()} places stages {list(want)} there: give it stages {list(want)}")
        position_of_stage = tuple(schedule.position_of(s, pp) for s in range(p))
        dp_groups = tuple(tuple(pipelines[rep * tp + t][pos] for rep in range(dp))
                          for pos in range(pp) for t in range(tp))
        tie_groups = []
        for tie in program.ties:
            per_pipeline = []
            for pl in pipelines:
                per_pipeline.append(tuple(r for r in pl if set(stages_of[r]) & set(tie.stages)))
            tie_groups.append(tuple(per_pipeline))
        tensor_groups = tuple(tuple(range(g, g + tp)) for g in range(0, world, tp)) if tp > 1 else ()
        return Layout(world, p, dp, tuple(stages_of), tuple(replica_of), tuple(pipelines),
                      dp_groups, tuple(tie_groups), tp, tuple(tp_of), tensor_groups, position_of_stage)

    @property
    def pp_size(self) -> int:
        return len(self.pipelines[0])

    def pipeline_index(self, rank: int) -> int:
        """Which of ``pipelines`` ``rank`` is in: replica * tp + its tensor index."""
        return self.replica_of_rank[rank] * self.tensor_parallel + (self.tp_index_of_rank[rank]
                                                                    if self.tp_index_of_rank else 0)

    def pipeline_ranks(self, rank: int) -> list[int]:
        """The rank holding each stage of ``rank``'s replica's pipeline, by stage."""
        pipeline = self.pipelines[self.pipeline_index(rank)]
        return [pipeline[self.position(k)] for k in range(self.num_stages)]

    def position(self, stage: int) -> int:
        """The pipeline position that runs ``stage``."""
        return self.position_of_stage[stage] if self.position_of_stage else stage % self.pp_size

    def data_parallel_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same stage(s) as ``rank``, one per replica (itself included)."""
        t = self.tp_index_of_rank[rank] if self.tp_index_of_rank else 0
        return sorted({self.stage_rank(k, rep, t) for k in self.stages_of_rank[rank] for rep in range(self.dp)})

    def stage_rank(self, stage: int, replica: int, tp_index: int = 0) -> int:
        return self.pipelines[replica * self.tensor_parallel + tp_index][self.position(stage)]
