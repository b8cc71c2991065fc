"""Interleaved 1F1B: the facts about torch 2.13's ``ScheduleInterleaved1F1B`` that a cost model of
it needs, as plain numbers (no torch), each checked against torch's own action order in
tests/unit/test_solver_interleaved.py. The solver does not price this schedule yet (Note
[interleaved not priced]); these are the terms it has been checked to need.

Notation: ``pipeline_ranks`` (pp) ranks per pipeline, ``local_stages`` (v) stages per rank, so
pp * v stages in all, stage s on pipeline position s % pp (runtime/layout.py); m microbatches.

Note [interleaved not priced]
    ``--schedule interleaved`` is refused by the solver (candidates.validate_options): its terms
    below are checked, but the ILP, chain DP, bounds and codegen do not use them yet.
    * Time with equal stages (forward f, backward b per microbatch on every stage): torch's
      order takes exactly (max(m * v + pp, pp * v + m) - 1) * (f + b) (``uniform_pipeline_s``).
      For m >= pp the bubble is (pp - 1) / v of a rank's per-microbatch work, v times smaller than
      1F1B's over pp stages; for m < pp one microbatch still crosses all pp * v stages.
    * Time with unequal stages: the linear form exact for equal stages,
      (m - 1/v) max_r R_r + sum_s T_s / v (R_r: rank r's stages' total), is below torch's order by
      up to 23% on random instances with m a multiple of pp (47% with other m), as are
      m max_r R_r + (pp - 1) max_s T_s and (m - 1) max_r R_r + sum_s T_s; an optimistic time would
      rank interleaved above plans that are in fact faster. What is conservative: each rank runs
      a fixed order and every action starts when its inputs are ready, so the step is a longest
      path in a DAG and cannot shrink when a duration grows; hence uniform_pipeline_s at
      f = max_s f_s, b = max_s b_s bounds it from above, and is linear in a bottleneck variable
      (what the ILP would transcribe). At f + b = max_s (f_s + b_s) it also held on every random
      instance tried (worst 0.96 of it), but that is not proven.
    * Memory is per rank, not per stage: a rank's v stages share one device. At its peak a rank
      holds ``rank_in_flight`` microbatch-stages of activations and no single stage holds more
      than min(m, that), so sum over its stages of min(m, rank_in_flight) * activations is a
      valid, conservative bound (it over-counts the later stages, which hold fewer).
    Still missing to compile it: candidates (pp, d, m) with pp * v stages and repeated placement
    rows, the bottleneck time above and per-rank memory rows in the ILP, the chain DP and the
    bounds, per-rank all-reduce and core sharing counted once per rank, and a compiled end-to-end
    run (the runtime already drives hand-built interleaved folders: tests/dist/test_runtime_dist.py).
"""

from __future__ import annotations

__all__ = ["interleaved_refusal", "rounds", "rank_in_flight", "uniform_pipeline_s"]


def rounds(pipeline_ranks: int, num_microbatches: int) -> int:
    """torch's ``number_of_rounds``: max(1, m // pp)."""
    return max(1, num_microbatches // pipeline_ranks)


def interleaved_refusal(num_stages: int, pipeline_ranks: int, num_microbatches: int) -> str | None:
    """Why ``ScheduleInterleaved1F1B`` (torch 2.13) or our rank layout would refuse this plan, or
    None (Note [only runnable plans] in problem.py). torch raises unless m is a multiple of its
    rounds, max(1, m // pp); the layout puts stage s on position s % pp, so every rank must get the
    same number of stages."""
    if pipeline_ranks < 1 or num_stages % pipeline_ranks:
        return (f"schedule interleaved gives every pipeline rank the same number of stages, but "
                f"{num_stages} stages do not divide over {pipeline_ranks} ranks")
    r = rounds(pipeline_ranks, num_microbatches)
    if num_microbatches % r:
        return (f"schedule interleaved needs microbatches to be a multiple of its rounds "
                f"(torch's ScheduleInterleaved1F1B: max(1, {num_microbatches} // {pipeline_ranks}) = {r}), "
                f"got {num_microbatches}: choose a multiple of {pipeline_ranks} microbatches")
    return None


def rank_in_flight(position: int, pipeline_ranks: int, local_stages: int, num_microbatches: int) -> int:
    """Microbatch-stages whose activations the rank at ``position`` holds at its peak: torch's
    warm-up count (v - 1) * m_round + 2 * (pp - 1 - position) forwards, plus the steady state's one
    forward before each backward, at most every microbatch of every local stage."""
    m, pp, v = num_microbatches, pipeline_ranks, local_stages
    per_round = m // rounds(pp, m)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - position), m * v)
    return min(warmup + 1, m * v)


def uniform_pipeline_s(fwd_s: float, bwd_s: float, pipeline_ranks: int, local_stages: int,
                       num_microbatches: int) -> float:
    """Pipeline time when every stage takes ``fwd_s`` forward and ``bwd_s`` backward per
    microbatch: exact for torch's order; with each stage's worst forward and worst backward, an
    upper bound for unequal stages (Note [interleaved not priced])."""
    m, pp, v = num_microbatches, pipeline_ranks, local_stages
    return (max(m * v + pp, pp * v + m) - 1) * (fwd_s + bwd_s)
