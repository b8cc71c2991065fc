"""What ``solve`` returns (Solution), what it records per candidate (CandidateRecord), and what it
reports while it runs (SolveProgress).

Note [rank layout]
    rank = stage * dp + replica. A stage's data-parallel replicas are consecutive ranks, so the
    gradient all-reduce (the big, per-step traffic) stays inside a node whenever dp divides the
    node size, and pipeline neighbours (small, per-microbatch activations) are dp ranks apart
    (Megatron-LM's order with pipeline outermost). On a homogeneous cluster rank r runs on device
    r; on a heterogeneous one ``device_of_stage_replica[stage][replica]`` names the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from partitioner.config.cluster import GIB
from partitioner.solver.baselines import BaselineCost
from partitioner.solver.evaluate import StageCost, TieCost
from partitioner.solver.problem import Assignment

__all__ = ["CandidateRecord", "Solution", "SolveProgress"]

# Note [fewer devices than given]: the solver may leave devices idle: on a small model dp 2's
# all-reduce, or a second stage's transfers, cost more than they save, and the plan on fewer
# devices is the faster one. That is right, but the compile's last line ("1 ranks: torchrun
# --nproc-per-node 1") then reads as a device ignored, so compile says why in one line from what
# the solver recorded about the candidates on more devices: the fastest of them it priced and
# what it adds, else the best lower bound that pruned them (at least the plan's step), else that
# the time limit ran out first, else that none fit in memory, else that the request left none open.


def _seconds(value: float) -> str:
    return f"{value * 1e3:.4g} ms" if value < 1 else f"{value:.4g} s"


@dataclass(frozen=True)
class CandidateRecord:
    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    status: str                 # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, PRUNED, SKIPPED
    step_time_s: float | None
    lower_bound_step_time_s: float
    solve_time_s: float
    tensor_parallel: int = 1        # the variant (Note [one enumeration] in space.py)
    shard_optimizer: bool = False
    local_stages: int = 1           # stages per rank (interleaved, zb, zbv)

    @property
    def ranks(self) -> int:
        """The devices this candidate runs on: its pipeline ranks x dp x the tensor-parallel degree."""
        return self.num_stages // self.local_stages * self.dp * self.tensor_parallel

    def shape(self) -> str:
        tp = f"tp {self.tensor_parallel} x " if self.tensor_parallel > 1 else ""
        return f"{tp}{self.num_stages} stage{'s' * (self.num_stages > 1)} x dp {self.dp}"


@dataclass(frozen=True)
class SolveProgress:
    """One update of solve()'s enumeration, handed to its ``progress`` callback; str() is a
    status line, ``candidate_line()`` the line of the candidate just finished (if any)."""

    done: int                        # candidates finished: solved, infeasible, skipped or pruned
    total: int
    incumbent_s: float | None        # the best plan's step time so far
    incumbent: tuple[int, int, int] | None  # its (stages, dp, microbatches)
    bound_s: float | None            # lower bound on the best step time over every candidate
    elapsed_s: float
    candidate: CandidateRecord | None = None
    finished: bool = False
    status: str | None = None        # the Solution's status, when finished
    incumbent_tp: int = 1            # the best plan's tensor-parallel degree

    def __str__(self) -> str:
        text = f"solve: {self.done}/{self.total} candidates"
        if self.incumbent_s is not None:
            p, d, m = self.incumbent
            tp = f"tp {self.incumbent_tp} x " if self.incumbent_tp > 1 else ""
            text += f", best {self.incumbent_s * 1e3:.4g} ms ({tp}{p} stage{'s' * (p > 1)} x dp {d}, {m} microbatch" \
                    f"{'es' * (m > 1)})"
        if self.bound_s is not None and math.isfinite(self.bound_s):
            text += f", bound {self.bound_s * 1e3:.4g} ms"
        if self.incumbent_s and self.bound_s is not None and math.isfinite(self.bound_s):
            text += f" (gap {max(0.0, 1 - self.bound_s / self.incumbent_s):.1%})"
        return text + (f", {self.status}" if self.finished and self.status else "")

    def candidate_line(self) -> str | None:
        r = self.candidate
        if r is None:
            return None
        time_s = "-" if r.step_time_s is None else f"{r.step_time_s * 1e3:.4g} ms"
        tp = f"tp {r.tensor_parallel} x " if r.tensor_parallel > 1 else ""
        shard = " (sharded state)" if r.shard_optimizer else ""
        return (f"candidate {tp}{r.num_stages} stage{'s' * (r.num_stages > 1)} x dp {r.dp}{shard}, {r.num_microbatches} "
                f"microbatch{'es' * (r.num_microbatches > 1)} of "
                f"{r.microbatch_size}: {r.status}, step {time_s}, bound {r.lower_bound_step_time_s * 1e3:.4g} ms, "
                f"{r.solve_time_s:.2f} s")


@dataclass(frozen=True)
class Solution:
    """The chosen plan and every figure it was chosen by (Note [rank layout] for devices)."""

    stage_of_region: tuple[int, ...]
    recompute: tuple[bool, ...]
    device_of_stage_replica: tuple[tuple[int, ...], ...]
    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    schedule: str
    global_batch: int
    # predicted, recomputed in floats by evaluate.evaluate
    stages: tuple[StageCost, ...]
    step_time_s: float
    bubble_fraction: float
    lower_bound_step_time_s: float
    ties: tuple[TieCost, ...]
    # solver
    status: str
    objective: int | None        # in time units (time_unit_s)
    bound: int | None
    solve_time_s: float
    time_unit_s: float
    memory_unit_bytes: int
    rounding_slack_units: float
    exact_links: bool
    baselines: Mapping[str, float | None] = field(default_factory=dict, compare=False)  # name -> step_time_s (None: fits nothing)
    baseline_details: Mapping[str, BaselineCost] = field(default_factory=dict, compare=False)
    candidates: tuple[CandidateRecord, ...] = ()
    optimal_over: str = ""  # what OPTIMAL is a proof over (solve.optimality_scope)
    # The variant that won (Note [one enumeration] in space.py): devices above are tensor groups
    # of this many ranks when > 1; the figures are of SearchSpace.inputs(variant, dp).
    tensor_parallel: int = 1
    shard_optimizer: bool = False
    # The per-step terms beside the ILP's objective (Note [terms outside the ILP] in space.py):
    # the plan's predicted step is step_time_s + extra_step_s, and plans are compared on that sum.
    extra_step_s: float = 0.0

    @property
    def total_step_s(self) -> float:
        return self.step_time_s + self.extra_step_s

    @property
    def assignment(self) -> Assignment:
        return Assignment(
            stage_of_region=self.stage_of_region,
            recompute=self.recompute,
            device_of_stage_replica=self.device_of_stage_replica,
            num_stages=self.num_stages,
            dp=self.dp,
            num_microbatches=self.num_microbatches,
            microbatch_size=self.microbatch_size,
            schedule=self.schedule,
        )

    @property
    def local_stages(self) -> int:
        """Stages per rank: v under interleaved, else 1 (Note [interleaved pricing] in interleaved.py)."""
        return self.assignment.local_stages

    @property
    def num_ranks(self) -> int:
        return self.num_stages // self.local_stages * self.dp

    def rank_of(self, stage: int, replica: int) -> int:
        return self.assignment.rank_of(stage, replica)

    def stage_replica_of_rank(self, rank: int) -> tuple[int, int]:
        """(the first stage the rank holds, its replica)."""
        return divmod(rank, self.dp)

    def device_of_rank(self, rank: int) -> int:
        stage, replica = divmod(rank, self.dp)
        return self.device_of_stage_replica[stage][replica]

    def fewer_devices_line(self, devices: int) -> str | None:
        """Why the plan leaves some of ``devices`` idle, in one line from the candidates the solver
        priced (Note [fewer devices than given]); None when it uses them all."""
        used = self.num_ranks * self.tensor_parallel
        if used >= devices:
            return None
        head = f"the plan uses {used} of {devices} devices"
        ours = self.total_step_s
        wider = [c for c in self.candidates if c.ranks > used]
        priced = [c for c in wider if c.step_time_s is not None]
        if priced:
            best = min(priced, key=lambda c: (c.step_time_s, c.ranks))
            return (f"{head}: the fastest plan on more, {best.shape()} on {best.ranks}, would be predicted "
                    f"{_seconds(best.step_time_s)}/step against {_seconds(ours)}/step ({self._adds(best)})")
        pruned = [c for c in wider if c.status == "PRUNED"]  # its lower bound is at least the plan's step
        if pruned:
            best = min(pruned, key=lambda c: c.lower_bound_step_time_s)
            return (f"{head}: no plan on more can be faster: the best of them, {best.shape()} on {best.ranks}, is "
                    f"at least {_seconds(best.lower_bound_step_time_s)}/step by its lower bound, against "
                    f"{_seconds(ours)}/step ({self._adds(best)})")
        if any(c.status != "INFEASIBLE" for c in wider):  # SKIPPED, UNKNOWN: out of time before a plan
            return (f"{head}: the solver ran out of time on the plans on more before it found one: give it more "
                    f"with --time-limit")
        if wider:
            return (f"{head}: none of the {len(wider)} plans on more that the solver tried fits in memory "
                    f"({min(wider, key=lambda c: c.ranks).shape()} and up)")
        return (f"{head}: no plan on more was open to the solver (stages, dp and microbatches as the flags, the "
                f"global batch of {self.global_batch} and the model's regions allow): give --stages or --dp to ask "
                "for one")

    def _adds(self, wider: CandidateRecord) -> str:
        """What ``wider`` pays for its devices, in words."""
        costs = [what for grew, what in (
            (wider.dp > self.dp, f"dp {wider.dp}'s gradient all-reduce"),
            (wider.num_stages > self.num_stages, f"{wider.num_stages} stages' transfers and bubble"),
            (wider.tensor_parallel > self.tensor_parallel, f"tp {wider.tensor_parallel}'s collectives"))
            if grew] or ["the devices it adds"]
        return (f"{' and '.join(costs)} cost{'s' * (len(costs) == 1)} more than "
                f"{'it saves' if len(costs) == 1 else 'they save'}")

    def summary(self) -> str:
        lines = [
            f"{self.num_stages} stages x dp {self.dp}, {self.num_microbatches} microbatches of "
            f"{self.microbatch_size}, {self.schedule}: step {self.step_time_s:.6g} s "
            f"(lower bound {self.lower_bound_step_time_s:.6g} s, bubble {self.bubble_fraction:.1%}), "
            f"solver {self.status} in {self.solve_time_s:.2f} s",
            f"{'stage':>5} {'ranks':>12} {'regions':>9} {'compute_s':>11} {'comm_s':>10} {'mem_GiB':>8} {'cap_GiB':>8}",
        ]
        for s, st in enumerate(self.stages):
            ranks = f"{self.rank_of(s, 0)}..{self.rank_of(s, self.dp - 1)}"
            lines.append(f"{s:>5} {ranks:>12} {len(st.regions):>9} {st.compute_s:>11.4g} {st.comm_s:>10.3g} "
                         f"{st.memory_bytes / GIB:>8.3f} {st.capacity_bytes / GIB:>8.2f}")
        for name, base in self.baseline_details.items():
            lines.append(f"baseline {name}: " + (f"{base.step_time_s:.6g} s" if base.fits_memory else "does not fit memory"))
        return "\n".join(lines)


# The solve's figures as plan.json records them (partitioner/compiler.py make_plan).


def solution_summary(solution) -> dict:
    return {
        "status": solution.status,
        "objective": None if solution.objective is None else float(solution.objective),
        "bound": None if solution.bound is None else float(solution.bound),
        "gap": (float(max(0, solution.objective - solution.bound) / solution.objective)
                if solution.objective and solution.bound is not None else None),
        "solve_time_s": float(solution.solve_time_s),
    }


def baseline_figures(solution) -> dict:
    """name -> its step time (None when it fits no configuration) and the configuration it was
    priced at (Note [fair baselines] in partitioner/solver/fair_baselines.py)."""
    out = {}
    for name, value in sorted(solution_baselines(solution).items()):
        detail = (getattr(solution, "baseline_details", {}) or {}).get(name)
        out[name] = {"step_time_s": value}
        if detail is not None and detail.num_stages is not None:
            out[name].update(fits_memory=detail.fits_memory, num_stages=detail.num_stages, dp=detail.dp,
                             num_microbatches=detail.num_microbatches, recompute=detail.recompute)
    return out


def solution_baselines(solution) -> dict:
    return dict(getattr(solution, "baselines", {}) or {})


