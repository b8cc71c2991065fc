"""Which rank holds what, and the process groups every rank creates: derived from the program
object (runtime/program.py), pure Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the program builds its layout from here
    from runtime.program import Program


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
    def from_program(program: Program) -> "Layout":
        """With tensor parallelism this is the layout of the tensor groups (logical rank g is
        physical ranks g*tp .. g*tp+tp-1, Note [tensor-parallel stages] in runtime/tensor_parallel.py):
        every tensor index runs the same pipelines over its own ranks."""
        tp = program.tensor_parallel
        world, p, dp = program.world_size // tp, program.num_stages, program.dp
        if program.world_size % tp:
            raise ValueError(f"world_size={program.world_size} is not a multiple of tensor_parallel={tp}")
        entries = list(program.ranks)
        if tp > 1:
            by_rank = {e.rank: e for e in entries}
            for e in entries:
                first = by_rank.get(e.rank - e.tp_index)
                if e.tp_index != e.rank % tp or first is None or (first.stages, first.replica) != (e.stages, e.replica):
                    raise ValueError(f"rank entry {e.to_dict()}: with tensor_parallel={tp} rank r has tp_index "
                                     f"r % {tp} and the stages and replica of rank r - r % {tp}: recompile")
            entries = [dataclasses.replace(e, rank=e.rank // tp) for e in entries if e.tp_index == 0]
        stages_of = [()] * world
        replica_of = [0] * world
        for entry in entries:
            r = entry.rank
            if not 0 <= r < world:
                raise ValueError(f"rank entry {entry.to_dict()} is outside world_size={world}")
            stages_of[r] = tuple(sorted(entry.stages))
            replica_of[r] = entry.replica
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
        for tie in program.ties:
            per_rep = []
            for pl in pipelines:
                per_rep.append(tuple(r for r in pl if set(stages_of[r]) & set(tie.stages)))
            tie_groups.append(tuple(per_rep))
        return Layout(world, p, dp, tuple(stages_of), tuple(replica_of), tuple(pipelines),
                      dp_groups, tuple(tie_groups))

    @property
    def pp_size(self) -> int:
        return len(self.pipelines[0])

    def pipeline_ranks(self, rank: int) -> list[int]:
        """The rank holding each stage of ``rank``'s replica's pipeline, by stage."""
        return [self.stage_rank(k, self.replica_of_rank[rank]) for k in range(self.num_stages)]

    def data_parallel_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same stage(s) as ``rank``, one per replica (itself included)."""
        return sorted({self.stage_rank(k, rep) for k in self.stages_of_rank[rank] for rep in range(self.dp)})

    def stage_rank(self, stage: int, replica: int) -> int:
        return self.pipelines[replica][stage % self.pp_size]
