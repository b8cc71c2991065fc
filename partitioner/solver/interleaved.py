"""Interleaved 1F1B: the facts about torch 2.13's ``ScheduleInterleaved1F1B`` that the cost
model prices, as plain numbers (no torch), each checked against torch's own action order in
tests/unit/test_solver_interleaved.py (Note [interleaved pricing]).

Notation: ``pipeline_ranks`` (pp) ranks per pipeline, ``local_stages`` (v) stages per rank, so
pp * v stages in all, stage s on pipeline position s % pp (runtime/program/layout.py); m microbatches.

Note [interleaved pricing]
    ``--schedule interleaved`` is priced by the worst stage, an upper bound on torch's timeline
    that is exact when the stages are equal; no formula that can under-predict is used.
    * Time with equal stages (forward f, backward b per microbatch on every stage): torch's
      order takes exactly (max(m * v + pp, pp * v + m) - 1) * (f + b) (``uniform_pipeline_s``,
      ``pipeline_slots``). For m >= pp the bubble is (pp - 1) / v of a rank's per-microbatch work,
      v times smaller than 1F1B's over pp stages; for m < pp one microbatch still crosses all
      pp * v stages.
    * Time with unequal stages: linear forms in the stage times are optimistic (the form exact
      for equal stages, (m - 1/v) max_r R_r + sum_s T_s / v with R_r rank r's stages' total, is
      below torch's order by up to 23% on random instances with m a multiple of pp, 47% with
      other m; so are m max_r R_r + (pp - 1) max_s T_s and (m - 1) max_r R_r + sum_s T_s). What
      is safe: each rank runs a fixed order and every action starts when its inputs are ready, so
      the step is a longest path in a DAG and cannot shrink when a duration grows. Raising every
      stage's forward to F = max_s f_s and backward to B = max_s b_s gives the equal-stage case,
      so pipeline_slots * (F + B) bounds the timeline from above. That is what ``evaluate`` and
      the ILP price (two epigraph variables, F and B: linear), with f_s = forward compute + the
      activation send and b_s = backward (+ recompute) + the gradient send + the per-microbatch
      overhead, so F + B >= every stage's T_s. It is an exact simulation of nothing: a plan the
      solver calls OPTIMAL is optimal for this bound, and on unequal stages torch's own order
      finishes earlier (tests check the bound against the simulated order, runtime/execute/schedule.py
      ``timed_actions``). At F + B = max_s (f_s + b_s) it also held on every random instance
      tried (worst 0.96 of it), but that is not proven, so it is not used.
    * Memory is per rank, not per stage: a rank's v stages share one device. At its peak a rank
      holds ``Interleaved.rank_in_flight`` microbatch-stages of activations and no single stage holds more
      than min(m, that), so every stage is priced with min(m, rank_in_flight) in flight, and a
      rank's peak as the sum of its stages' peaks (Note [memory model] in evaluate.py) less the
      v - 1 extra copies of the global batch each stage's figure counts: conservative (it
      over-counts the later stages, which hold fewer, and sums transients that do not overlap).
    * Data-parallel all-reduce per rank: its stages' gradients in one flat all-reduce
      (runtime/parallel/grad_sync.py ``sync_gradients``): 2 (d - 1) (G_rank / (d bw) + latency).
    * Scope: one device class (a heterogeneous cluster refuses it; auto leaves it out there),
      pp >= 2 ranks and v >= 2 stages per rank, v in ``LOCAL_STAGE_OPTIONS`` unless fixed
      (SolverConfig.local_stages). The chain DP and the placement search are 1F1B/GPipe-only, so
      an interleaved candidate's strong bound is its cheap one (``PricedInterleaved.lower_bound_s`` in schedules.py).

The zero-bubble schedules (zb: the same placement, backward split into B and W; zbv: a V) are
priced from torch's own order instead (see Note [zero-bubble pricing] in zero_bubble.py).
"""

from __future__ import annotations

# torch's rules for this schedule (its refusal, rounds, what a rank holds) live with the schedule
# the runtime drives: runtime/program/schedules.py ``Interleaved`` (Note [one class per schedule]).
__all__ = ["LOCAL_STAGE_OPTIONS", "pipeline_slots", "uniform_pipeline_s"]

LOCAL_STAGE_OPTIONS = (2, 3, 4)  # v tried when SolverConfig.local_stages is None


def uniform_pipeline_s(fwd_s: float, bwd_s: float, pipeline_ranks: int, local_stages: int,
                       num_microbatches: int) -> float:
    """Pipeline time when every stage takes ``fwd_s`` forward and ``bwd_s`` backward per
    microbatch: exact for torch's order; with each stage's worst forward and worst backward, an
    upper bound for unequal stages (Note [interleaved pricing])."""
    return pipeline_slots(pipeline_ranks, local_stages, num_microbatches) * (fwd_s + bwd_s)


def pipeline_slots(pipeline_ranks: int, local_stages: int, num_microbatches: int) -> int:
    """Forward-plus-backward slots of torch's order with equal stages: max(m v + pp, pp v + m) - 1."""
    m, pp, v = num_microbatches, pipeline_ranks, local_stages
    return max(m * v + pp, pp * v + m) - 1
