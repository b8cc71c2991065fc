"""The schedules as the solver prices them (Note [one class per schedule] in
runtime/program/schedules.py): each runtime schedule plus its price, the pipeline's time in
``evaluate`` and its lower bound.

GPipe and 1F1B are priced flat ((m - 1) x the slowest stage + the sum of the stages, Note [cost
model] in evaluate.py; the chain DP and the placement search bound them); interleaved by its worst
stage (Note [interleaved pricing] in interleaved.py; its strong bound is its cheap one); zb and zbv
by torch's own order at the worst stage's F, B and W (Note [zero-bubble pricing] in zero_bubble.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from partitioner.solver.interleaved import LOCAL_STAGE_OPTIONS, pipeline_slots
from partitioner.solver.device_layout import place_stages, plan_links
from partitioner.solver.problem import core_sharing_factor, microbatch_overhead_s, region_times_s
from partitioner.solver.zero_bubble import path_forms, worst_stage_s
from runtime.program.schedules import REFUSED, GPipe, Interleaved, OneFOneB, PipelineSchedule, ZeroBubble, ZeroBubbleV

__all__ = ["AUTO", "REQUEST_CHOICES", "priced_schedule", "PricedSchedule", "requested_schedule", "SCHEDULE_ORDER"]


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


def _allreduce_bound_s(problem, dp_links, pipeline_ranks: int, dp: int) -> float:
    """The ring all-reduce of 1/pipeline_ranks of the gradients over the fastest dp link (0 at dp 1):
    what some rank must spend in every plan of these degrees (the lower bounds below)."""
    links = [link for link in dp_links if link is not None]
    if dp <= 1 or not links:
        return 0.0
    grads = sum(r.grad_bytes for r in problem.regions)
    bandwidth = max(link.bandwidth_bytes_per_s for link in links)
    return 2 * (dp - 1) * (grads / (pipeline_ranks * dp * bandwidth) + min(link.latency_s for link in links))


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

    def time_forms(self, pipeline_ranks: int, num_microbatches: int) -> tuple[tuple[int, int, int], ...]:
        """(nF, nB, nW) forms whose largest, at the worst stage's forward F, backward B (the input
        gradient where split) and weight gradient W, is the pipeline: one form here (B is the whole
        backward, W unused), torch's paths for the split schedules."""
        slots = pipeline_slots(pipeline_ranks, self.local_stages, num_microbatches)
        return ((slots, slots, 0),)

    def worst_stage_pipeline_s(self, a, stage_costs) -> float:
        """The pipeline at every stage raised to the worst stage's F, B and W."""
        fwd_max = max(st.forward_s for st in stage_costs)
        wgt_max = max(st.weight_s for st in stage_costs) if self.split_backward else 0.0
        bwd_max = max(st.time_s - st.forward_s - (st.weight_s if self.split_backward else 0.0) for st in stage_costs)
        return worst_stage_s(self.time_forms(a.pipeline_ranks, a.num_microbatches), fwd_max, bwd_max, wgt_max)

    def pipeline_terms(self, problem, a, stage_costs, dp_links, scale):
        """The worst-stage bound on torch's timeline, the all-reduce of each rank's stages'
        gradients at once, and each rank's peak as the sum of its stages' less the v - 1 extra
        copies of the global batch (Note [interleaved pricing])."""
        pp, v, d, m, b = a.pipeline_ranks, a.local_stages, a.dp, a.num_microbatches, a.microbatch_size
        pipeline = self.worst_stage_pipeline_s(a, stage_costs)
        allreduce = 0.0
        batch = d * m * b * (problem.input_bytes_per_sample + problem.target_bytes_per_sample)
        rank_memory, rank_capacity = [], []
        for pos in range(pp):
            mine = [stage_costs[s] for s in a.stages_at(pos)]
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
        placement = place_stages(cluster, p, d, local_stages=v, position_of=self.position_of)
        device = cluster.devices[0]
        boundary, dp_links, _ = plan_links(cluster, placement)
        works = [sum(region_times_s(r, device, b)) for r in problem.regions]
        total = sum(works) + 2 * sum(link.latency_s for link in boundary) + p * microbatch_overhead_s(problem, device)
        pipeline = pipeline_slots(pp, v, m) * max(total / p, max(works))
        return (pipeline + _allreduce_bound_s(problem, dp_links, pp, d)) * core_sharing_factor(cluster, placement)

    def chain_hint(self):
        return PricedOneFOneB()  # the 1F1B split of the same stages (the model checks memory per rank)


@dataclass(frozen=True)
class PricedZeroBubble(PricedInterleaved, ZeroBubble):
    """zb: torch's order over F, B and W at the worst stage (Note [zero-bubble pricing])."""

    def time_forms(self, pipeline_ranks, num_microbatches):
        return path_forms(ZeroBubble(self.local_stages), pipeline_ranks, num_microbatches)

    def lower_bound_s(self, problem, cluster, *, num_stages, dp, num_microbatches, microbatch_size,
                      allow_recompute):
        """Every plan of (p, d, m, b): some rank runs at least 1/pp of every microbatch's work
        (m · the work / pp) and the all-reduce of 1/pp of the gradients; times the core-sharing
        factor. Interleaved's bound with m · work / pp for its slots."""
        p, d, m, b, v = num_stages, dp, num_microbatches, microbatch_size, self.local_stages
        pp = p // v
        placement = place_stages(cluster, p, d, local_stages=v, position_of=self.position_of)
        device = cluster.devices[0]
        _, dp_links, _ = plan_links(cluster, placement)
        pipeline = m * sum(sum(region_times_s(r, device, b)) for r in problem.regions) / pp
        return (pipeline + _allreduce_bound_s(problem, dp_links, pp, d)) * core_sharing_factor(cluster, placement)


@dataclass(frozen=True)
class PricedZeroBubbleV(PricedZeroBubble, ZeroBubbleV):
    """zbv: two stages per rank in a V, priced as zb (Note [zero-bubble pricing])."""

    local_stage_options: ClassVar[tuple[int, ...]] = (2,)

    def time_forms(self, pipeline_ranks, num_microbatches):
        return path_forms(ZeroBubbleV(2), pipeline_ranks, num_microbatches)


_PRICED = {cls.name: cls for cls in (PricedGPipe, PricedOneFOneB, PricedInterleaved, PricedZeroBubble,
                                     PricedZeroBubbleV)}
# --schedule auto's order, its tie-break: fewer activations first, then fewer stages
SCHEDULE_ORDER = tuple(sorted(_PRICED, key=lambda name: _PRICED[name].preference))


AUTO = "auto"  # --schedule auto: every priced schedule weighed (Note [schedule choice] in schedule_choice.py)
REQUEST_CHOICES = (*_PRICED, *REFUSED, AUTO)  # what --schedule accepts (a refused one, to say why)


def requested_schedule(name: str) -> PricedSchedule | None:
    """A request's schedule name parsed once: its object, None for auto; else ValueError in one line
    naming the choices, or why a refused schedule is refused (Note [DualPipeV refused])."""
    return None if name == AUTO else priced_schedule(name)


def priced_schedule(name: str, local_stages: int | None = 1) -> PricedSchedule:
    """The solver's object for schedule ``name`` at ``local_stages`` stages per rank (interleaved;
    ignored by the one-stage-per-rank schedules)."""
    if name in REFUSED:  # Note [DualPipeV refused]
        raise ValueError(REFUSED[name])
    if name not in _PRICED:
        raise ValueError(f"schedule={name!r} is not one of {tuple(_PRICED)}: use --schedule "
                         f"{', '.join(_PRICED)} or auto")
    cls = _PRICED[name]
    if issubclass(cls, ZeroBubbleV):
        return cls(2)
    return cls(local_stages or 0) if issubclass(cls, Interleaved) else cls()
