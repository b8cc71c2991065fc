"""The schedules as the solver prices them (Note [one class per schedule] in
runtime/program/schedules.py): each runtime schedule plus its price, the pipeline's time in
``evaluate`` and its lower bound.

GPipe and 1F1B are priced flat ((m - 1) x the slowest stage + the sum of the stages, Note [cost
model] in evaluate.py; the chain DP and the placement search bound them); interleaved by its worst
stage (Note [interleaved pricing] in interleaved.py; its strong bound is its cheap one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from partitioner.solver.interleaved import LOCAL_STAGE_OPTIONS, pipeline_slots
from partitioner.solver.problem import (core_sharing_factor, microbatch_overhead_s, place_stages, plan_links,
                                       region_times_s)
from runtime.program.schedules import GPipe, Interleaved, OneFOneB, PipelineSchedule

__all__ = ["priced_schedule", "PricedSchedule", "SCHEDULE_ORDER"]


class PricedSchedule:
    """The price of a schedule; mixed into a runtime schedule class (the fields are its)."""

    # the chain DP and the placement search price this schedule's stages (else: the cheap bound)
    chain_priced: ClassVar[bool] = True
    # priced on one device class only (a heterogeneous cluster refuses it; auto leaves it out)
    one_device_class: ClassVar[bool] = False
    # the stages per rank the solver tries when the request leaves them open
    local_stage_options: ClassVar[tuple[int, ...]] = (1,)

    def pipeline_terms(self, problem, a, stage_costs, dp_links, scale):
        """(pipeline s, data-parallel all-reduce s, rank peak bytes, rank capacity bytes) of plan
        ``a``'s stage costs; rank figures empty where a rank holds one stage."""
        bottleneck = max(st.time_s for st in stage_costs)
        total = sum(st.time_s for st in stage_costs)
        return ((a.num_microbatches - 1) * bottleneck + total, max(st.dp_allreduce_s for st in stage_costs), (), ())

    def lower_bound_s(self, problem, cluster, *, num_stages, dp, num_microbatches, microbatch_size,
                      allow_recompute) -> float | None:
        """A bound of its own on every plan of the candidate, or None for the flat pipeline's
        (bounds.candidate_lower_bound_s)."""
        return None

    def chain_hint(self) -> PipelineSchedule:
        """The schedule whose chain DP split seeds this one's model (a hint only)."""
        return self


@dataclass(frozen=True)
class PricedGPipe(PricedSchedule, GPipe):
    pass


@dataclass(frozen=True)
class PricedOneFOneB(PricedSchedule, OneFOneB):
    pass


@dataclass(frozen=True)
class PricedInterleaved(PricedSchedule, Interleaved):
    chain_priced: ClassVar[bool] = False
    one_device_class: ClassVar[bool] = True
    local_stage_options: ClassVar[tuple[int, ...]] = LOCAL_STAGE_OPTIONS

    def pipeline_terms(self, problem, a, stage_costs, dp_links, scale):
        """The worst-stage bound on torch's timeline, the all-reduce of each rank's stages'
        gradients at once, and each rank's peak as the sum of its stages' less the v - 1 extra
        copies of the global batch (Note [interleaved pricing])."""
        pp, v, d, m, b = a.pipeline_ranks, a.local_stages, a.dp, a.num_microbatches, a.microbatch_size
        fwd_max = max(st.forward_s for st in stage_costs)
        bwd_max = max(st.time_s - st.forward_s for st in stage_costs)
        pipeline = pipeline_slots(pp, v, m) * (fwd_max + bwd_max)
        allreduce = 0.0
        batch = d * m * b * (problem.input_bytes_per_sample + problem.target_bytes_per_sample)
        rank_memory, rank_capacity = [], []
        for pos in range(pp):
            mine = stage_costs[pos::pp]
            link = dp_links[pos]
            step_s = sum(st.step_s for st in mine)
            if link is not None:
                grads = sum(st.grads_bytes for st in mine)
                step_s += scale * 2 * (d - 1) * (grads / d / link.bandwidth_bytes_per_s + link.latency_s)
            allreduce = max(allreduce, step_s)
            rank_memory.append(sum(st.memory_bytes for st in mine) - (v - 1) * batch)
            rank_capacity.append(mine[0].capacity_bytes)
        return pipeline, allreduce, tuple(rank_memory), tuple(rank_capacity)

    def lower_bound_s(self, problem, cluster, *, num_stages, dp, num_microbatches, microbatch_size,
                      allow_recompute):
        """Every interleaved plan of (p, d, m, b) on one device class: the pipeline is slots·(F + B)
        and F + B >= max_s T_s >= max(sum_s T_s / p, the largest region's work), sum_s T_s >= the
        work + both directions' boundary latencies + p overheads; some rank holds >= 1/pp of the
        gradients (its all-reduce); ties >= 0; times the placement's core-sharing factor. Never
        inf: memory is left to CP-SAT."""
        p, d, m, b, v = num_stages, dp, num_microbatches, microbatch_size, self.local_stages
        pp = p // v
        placement = place_stages(cluster, p, d, local_stages=v)
        device = cluster.devices[0]
        boundary, dp_links, _ = plan_links(cluster, placement)
        works = [sum(region_times_s(r, device, b)) for r in problem.regions]
        total = sum(works) + 2 * sum(link.latency_s for link in boundary) + p * microbatch_overhead_s(problem, device)
        pipeline = pipeline_slots(pp, v, m) * max(total / p, max(works))
        allreduce = 0.0
        links = [link for link in dp_links if link is not None]
        if d > 1 and links:
            grads = sum(r.grad_bytes for r in problem.regions)
            bandwidth = max(link.bandwidth_bytes_per_s for link in links)
            allreduce = 2 * (d - 1) * (grads / (pp * d * bandwidth) + min(link.latency_s for link in links))
        return (pipeline + allreduce) * core_sharing_factor(cluster, placement)

    def chain_hint(self):
        return PricedOneFOneB()  # the 1F1B split of the same stages (the model checks memory per rank)


_PRICED = {cls.name: cls for cls in (PricedGPipe, PricedOneFOneB, PricedInterleaved)}
# --schedule auto's order, its tie-break: fewer activations first, then fewer stages
SCHEDULE_ORDER = tuple(sorted(_PRICED, key=lambda name: _PRICED[name].preference))


def priced_schedule(name: str, local_stages: int | None = 1) -> PricedSchedule:
    """The solver's object for schedule ``name`` at ``local_stages`` stages per rank (interleaved;
    ignored by the one-stage-per-rank schedules)."""
    if name not in _PRICED:
        raise ValueError(f"schedule={name!r} is not one of {tuple(_PRICED)}: use --schedule "
                         f"{', '.join(_PRICED)} or auto")
    cls = _PRICED[name]
    return cls(local_stages or 0) if issubclass(cls, Interleaved) else cls()
