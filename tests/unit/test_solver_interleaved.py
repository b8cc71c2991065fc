"""Interleaved 1F1B facts (partitioner/solver/interleaved.py) against torch 2.13's own action
order (runtime.execute.schedule asks ScheduleInterleaved1F1B for it): the terms Note [interleaved
pricing] prices (tests/unit/test_solver_interleaved_plan.py tests the plans)."""

from __future__ import annotations

import random

import pytest

from partitioner.solver.interleaved import uniform_pipeline_s
from runtime.program.schedules import Interleaved
from runtime.execute.schedule import _rank_orders, timed_actions

# (pp, v, m) torch accepts: m a multiple of max(1, m // pp)
GRID = [(pp, v, m) for pp in (2, 3, 4) for v in (2, 3) for m in range(1, 13)
        if m % max(1, m // pp) == 0]


def test_refusal_follows_torch_rounds_rule():
    # torch's docstring examples: pp=4, m=10 (2 rounds) and m=3 (1 round) run; m=9 (2 rounds) does not
    assert Interleaved(2).refusal(8, 10) is None
    assert Interleaved(2).refusal(8, 3) is None
    why = Interleaved(2).refusal(8, 9)
    assert why is not None and "multiple of its rounds" in why and "9" in why
    assert "5 stages at 2 per rank" in Interleaved(2).refusal(5, 4)  # every rank the same number of stages
    assert "at least 2 pipeline ranks" in Interleaved(3).refusal(3, 4)
    for pp, v, m in GRID:
        assert Interleaved(v).refusal(pp * v, m) is None


@pytest.mark.parametrize("pp,v,m", GRID)
def test_rank_in_flight_is_torch_order_peak(pp, v, m):
    """The most microbatch-stages a rank holds forward activations of, walking torch's order."""
    for pos, acts in enumerate(_rank_orders("interleaved", pp, pp * v, m)):
        held = peak = 0
        per_stage: dict[int, int] = {}
        stage_peak: dict[int, int] = {}
        for kind, stage, _mb in acts:
            step = 1 if kind == "F" else -1
            held += step
            per_stage[stage] = per_stage.get(stage, 0) + step
            peak = max(peak, held)
            stage_peak[stage] = max(stage_peak.get(stage, 0), per_stage[stage])
        assert Interleaved(v).rank_in_flight(pos, pp, m) == peak
        # the per-stage bound the memory note relies on: no stage above min(m, rank peak)
        assert max(stage_peak.values()) <= min(m, peak)


@pytest.mark.parametrize("fwd_s,bwd_s", [(1.0, 2.0), (1.0, 1.0), (2.0, 0.5)])
def test_uniform_pipeline_time_is_torch_order_makespan(fwd_s, bwd_s):
    for pp, v, m in GRID:
        acts = timed_actions("interleaved", pp, pp * v, m, lambda kind, s: fwd_s if kind == "F" else bwd_s)
        assert max(end for *_, end in acts) == pytest.approx(uniform_pipeline_s(fwd_s, bwd_s, pp, v, m)), (pp, v, m)


def _random_instances(seed, count, m_choices):
    rng = random.Random(seed)
    for _ in range(count):
        pp, v = rng.choice([2, 3, 4]), rng.choice([2, 3])
        m = rng.choice(m_choices(pp))
        fwd = [rng.uniform(0.1, 2.0) for _ in range(pp * v)]
        bwd = [rng.uniform(0.5, 3.0) * f for f in fwd]
        acts = timed_actions("interleaved", pp, pp * v, m, lambda kind, s: fwd[s] if kind == "F" else bwd[s])
        yield pp, v, m, fwd, bwd, max(end for *_, end in acts)


def test_worst_stage_uniform_time_bounds_unequal_stages():
    """The conservative time: every stage at the worst forward and the worst backward."""
    for pp, v, m, fwd, bwd, makespan in _random_instances(3, 80, lambda pp: [k for k in range(1, 13)
                                                                           if k % max(1, k // pp) == 0]):
        assert makespan <= uniform_pipeline_s(max(fwd), max(bwd), pp, v, m) + 1e-9, (pp, v, m)


def test_linear_form_is_not_conservative_on_unequal_stages():
    """Why the solver does not price the schedule with the form exact for equal stages: with
    unequal stages torch's order is slower than it, so it would be optimistic."""
    worst = 1.0
    for pp, v, m, fwd, bwd, makespan in _random_instances(1, 60, lambda pp: list(range(pp, 13, pp))):
        t = [f + b for f, b in zip(fwd, bwd)]
        per_rank = [sum(t[s] for s in range(r, pp * v, pp)) for r in range(pp)]
        worst = min(worst, ((m - 1 / v) * max(per_rank) + sum(t) / v) / makespan)
    assert worst < 0.95
