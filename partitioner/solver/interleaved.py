"""Interleaved 1F1B: the facts about torch 2.13's ``ScheduleInterleaved1F1B`` that the cost
model prices, as plain numbers (no torch), each checked against torch's own action order in
tests/unit/test_solver_interleaved.py (Note [interleaved pricing]).

Notation: ``pipeline_ranks`` (pp) ranks per pipeline, ``local_stages`` (v) stages per rank, so
pp * v stages in all, stage s on pipeline position s % pp (runtime/program/layout.py); m microbatches.

Note [interleaved pricing]
    ``--schedule interleaved`` is priced by the worst stage: every stage's forward raised to
    F = max_s f_s and backward to B = max_s b_s gives equal stages, whose torch order takes exactly
    pipeline_slots * (F + B), and that bounds the real timeline from above (each rank runs a fixed
    order and every action starts when its inputs are ready: a longest path in a DAG, which cannot
    shrink when a duration grows). No formula that can under-predict is used: the linear forms in
    the stage times exact for equal stages fall below torch's order by up to 47% on random
    instances, and F + B = max_s (f_s + b_s), never seen to fail, is not proven. So a plan called
    OPTIMAL is optimal for this bound (tests check it against runtime/execute/schedule.py's order).
    Memory is per rank (its v stages share a device): each stage priced with min(m,
    ``Interleaved.rank_in_flight``) in flight and a rank as the sum of its stages, less the extra
    copies of the global batch: conservative. One flat all-reduce per rank. Scope: one device
    class, pp >= 2, v >= 2; the chain DP and placement search are 1F1B/GPipe-only, so a
    candidate's strong bound is its cheap one.

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
