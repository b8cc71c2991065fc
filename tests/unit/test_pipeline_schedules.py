"""Note [one class per schedule] (runtime/program/schedules.py): each schedule is one object whose
answers agree with each other and with torch. What a stage holds at its peak (``in_flight``, which
the solver's memory model prices) is what walking the schedule's own action order (the order
torch runs, which ``inspect`` draws) holds; the solver's object is the runtime's plus a price."""

from __future__ import annotations

import pytest

from partitioner.solver.schedules import SCHEDULE_ORDER, priced_schedule
from runtime.program.schedules import SCHEDULES, schedule_named


def _walk_peaks(schedule, pp, num_stages, m):
    """Per stage, the most microbatches whose forward ran and backward did not, in rank order."""
    peaks: dict[int, int] = {}
    for pos in range(pp):
        held: dict[int, int] = {}
        for kind, stage, _mb in schedule.rank_order(pos, pp, num_stages, m):
            held[stage] = held.get(stage, 0) + (1 if kind == "F" else -1)
            peaks[stage] = max(peaks.get(stage, 0), held[stage])
    return peaks


# every (schedule, stages per rank, ranks, microbatches) torch runs
CASES = [(name, v, pp, m) for name in SCHEDULES for v in ((2, 3) if SCHEDULES[name].several_per_rank else (1,))
         for pp in (2, 3, 4) for m in range(1, 9) if schedule_named(name, v).refusal(pp * v, m) is None]


@pytest.mark.parametrize("name,v,pp,m", CASES)
def test_in_flight_is_the_peak_of_the_schedules_own_order(name, v, pp, m):
    schedule = schedule_named(name, v)
    p = pp * v
    peaks = _walk_peaks(schedule, pp, p, m)
    claimed = [schedule.in_flight(s, p, m) for s in range(p)]
    if schedule.several_per_rank:  # priced per stage as at most its rank's peak (Note [interleaved pricing])
        assert all(peaks[s] <= claimed[s] for s in range(p)), (peaks, claimed)
    else:
        assert [peaks[s] for s in range(p)] == claimed


def test_every_schedule_has_a_price_and_one_name():
    assert sorted(SCHEDULE_ORDER) == sorted(SCHEDULES)
    for name in SCHEDULES:
        priced = priced_schedule(name, 2)
        assert priced.name == name and isinstance(priced, SCHEDULES[name])
    assert SCHEDULE_ORDER[0] == "1f1b"  # the tie-break: fewer activations first
    with pytest.raises(ValueError, match="--schedule"):
        schedule_named("zigzag")


def test_plan_program_and_assignment_each_parse_the_name_once_into_one_object(tmp_path):
    """plan.json writes the name; what reads it asks ``pipeline_schedule``, the same object on both
    sides (zbv: two stages per rank in a V), and an unknown name is a one-line error at the edge."""
    import partitioner  # lazy: a compile (seconds) only this test needs
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import mlp
    from partitioner.solver.plan import Plan, PlanFieldError
    from partitioner.solver.serialize import assignment_from_dict
    from runtime.program.spec import load_plan, load_program

    compiled = partitioner.compile(mlp(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=4,
                                   dp=1, microbatches=4, schedule="zbv")
    compiled.save(tmp_path / "zbv")
    plan, program = Plan.load(tmp_path / "zbv"), load_program(str(tmp_path / "zbv"))
    body = load_plan(str(tmp_path / "zbv"))
    assignment = assignment_from_dict(body["assignment"])
    want = schedule_named("zbv", 2)
    assert plan.pipeline_schedule == program.pipeline_schedule == assignment.pipeline_schedule == want
    assert [program.layout.position_of_stage[s] for s in range(4)] == [want.position_of(s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert str(want) == plan.schedule == "zbv"
    with pytest.raises(PlanFieldError, match=r"schedule='zigzag' is not one of .*recompile"):
        Plan.from_dict({**plan.to_dict(), "schedule": "zigzag"})
