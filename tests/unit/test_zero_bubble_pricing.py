"""The zero-bubble schedules' price (Note [zero-bubble pricing] in partitioner/solver/zero_bubble.py)
against torch's own lowered program: torch's compute order with the sends and receives its
``_add_send_recv`` inserts, run event by event (a receive waits for its send), on 20 random
instances of per-stage F, B and W times; the path forms against the simulation at equal stages;
the V placement and the refusals."""

from __future__ import annotations

import dataclasses
import itertools
import random
import subprocess
import sys

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from partitioner.config.cluster import ClusterSpec
from partitioner.solver import SolverConfig, check_assignment, evaluate, solve
from partitioner.solver.schedules import priced_schedule
from partitioner.solver.zero_bubble import path_forms, simulate_s, worst_stage_s
from runtime.program.schedules import schedule_named, torch_order
from tests.unit.test_solver_hand import chain, region


def _torch_lowered_s(schedule, pp: int, m: int, seconds) -> float:
    """Torch's lowered program (compute + SEND/RECV actions per rank) run as its
    ``_PipelineScheduleRuntime`` runs it: each rank in its order; a send is posted at once, a receive
    is posted (irecv) and waited for by the compute action that reads it (``_wait_batch_p2p`` in
    FORWARD / BACKWARD_INPUT), so that action starts no earlier than its send; a compute action
    takes ``seconds(kind, stage)``."""
    p = pp * schedule.local_stages
    order = {r: [a for a in acts if a is not None]
             for r, acts in torch_order(schedule.torch_class, pp, schedule.local_stages, m).items()}
    lowered = torch_schedules._add_send_recv(order, lambda s: schedule.position_of(s, pp), p)
    kinds = {"F": "F", "I": "B", "W": "W", "B": "B"}
    clock = {r: 0.0 for r in lowered}
    nxt = {r: 0 for r in lowered}
    sent: dict = {}  # (direction, sending stage, microbatch) -> when its send was posted
    posted: dict = {r: {} for r in lowered}  # rank -> (stage, direction, microbatch) -> the send it waits for
    while any(nxt[r] < len(lowered[r]) for r in lowered):
        progressed = False
        for r, acts in lowered.items():
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                kind, stage, mb = a.computation_type.value, a.stage_index, a.microbatch_index
                if kind in ("SEND_F", "SEND_B"):
                    sent[(kind[-1], stage, mb)] = clock[r]
                elif kind in ("RECV_F", "RECV_B"):  # from the stage before (F) or after (B)
                    posted[r][(stage, kind[-1], mb)] = (kind[-1], stage - 1 if kind == "RECV_F" else stage + 1, mb)
                else:
                    key = posted[r].get((stage, "F" if kind == "F" else "B", mb)) if kind in ("F", "I", "B") else None
                    if key is not None:
                        if key not in sent:
                            break
                        clock[r] = max(clock[r], sent[key])
                    clock[r] += seconds(kinds[kind], stage)
                    if kind in ("F", "I", "B"):
                        posted[r].pop((stage, "F" if kind == "F" else "B", mb), None)
                nxt[r] += 1
                progressed = True
        assert progressed, "torch's lowered program deadlocks"
    return max(clock.values())


def _instances():
    rng = random.Random(30)
    out = []
    while len(out) < 20:
        name = rng.choice(["zb", "zbv"])
        pp = rng.choice([2, 3, 4])
        v = 2 if name == "zbv" else rng.choice([2, 3])
        m = rng.choice([pp, 2 * pp, 3 * pp]) if name == "zb" else rng.randint(pp, 3 * pp)
        times = {(k, s): rng.uniform(0.5, 2.0) for k in "FBW" for s in range(pp * v)}
        out.append((name, pp, v, m, times))
    return out


@pytest.mark.parametrize("name,pp,v,m,times", _instances())
def test_the_simulated_order_is_torchs_lowered_program_within_two_percent(name, pp, v, m, times):
    schedule = schedule_named(name, v)
    seconds = lambda kind, stage: times[(kind, stage)]  # noqa: E731
    predicted = simulate_s(schedule, pp, m, seconds)
    measured = _torch_lowered_s(schedule, pp, m, seconds)
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


@pytest.mark.parametrize("name,pp,v,m", [("zb", 2, 2, 4), ("zb", 4, 2, 8), ("zbv", 2, 2, 3), ("zbv", 4, 2, 8),
                                         ("zb", 3, 3, 6)])
def test_path_forms_are_the_simulation_at_equal_stages(name, pp, v, m):
    schedule = schedule_named(name, v)
    forms = path_forms(schedule, pp, m)
    rng = random.Random(pp * 10 + m)
    for _ in range(5):
        f, b, w = (rng.uniform(0.1, 3.0) for _ in range(3))
        want = simulate_s(schedule, pp, m, lambda kind, _s: {"F": f, "B": b, "W": w}[kind])
        assert worst_stage_s(forms, f, b, w) == pytest.approx(want, rel=1e-12)


def test_the_worst_stage_price_never_falls_below_the_simulated_order():
    for name, pp, v, m, times in _instances():
        schedule = priced_schedule(name, v)
        forms = schedule.time_forms(pp, m)
        worst = [max(times[(k, s)] for s in range(pp * v)) for k in "FBW"]
        assert worst_stage_s(forms, *worst) >= simulate_s(schedule, pp, m, lambda k, s: times[(k, s)]) - 1e-9


def test_zero_bubble_beats_1f1b_at_equal_work_and_zbv_places_a_v():
    """At F = B = W = 1 per stage, 2 ranks of 2 stages, 4 microbatches: zb takes 25 slots (1 of a
    rank's 24 actions idle), 1F1B over 2 stages of twice the work (5 · 6 = 30)."""
    zb = schedule_named("zb", 2)
    assert worst_stage_s(path_forms(zb, 2, 4), 1, 1, 1) == 25
    zbv = schedule_named("zbv")
    assert [zbv.position_of(s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert zbv.stages_at(0, 3, 6) == (0, 5)
    assert zbv.refusal(5, 4) is not None and zbv.refusal(4, 4) is None


def test_dualpipev_is_refused_in_one_line_with_its_reason(tmp_path):
    result = subprocess.run([sys.executable, "-m", "partitioner", "compile", "gpt:layers=2,width=16,vocab=32,seq=8",
                             "--devices", "2", "--schedule", "dualpipev", "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "dualpipev" in lines[0] and "OVERLAP_F_B" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def _weighted_chain(seed: int, n: int = 8):
    """A chain of regions of random forward work whose backward is two thirds weight gradients' at
    most (Note [weight-gradient flops]: a matmul's dW costs its forward)."""
    rng = random.Random(seed)
    regions = []
    for i in range(n):
        fwd = rng.uniform(0.5e9, 2e9)
        regions.append(region(f"r{i}", fwd=fwd, bwd_weight_flops_per_sample=fwd * rng.uniform(0.3, 1.0)))
    return chain(regions)


@pytest.mark.parametrize("name", ["zb", "zbv"])
def test_the_ilp_prices_zero_bubble_as_evaluate_does_and_is_optimal_over_every_split(name):
    """The ILP's objective (path forms over three worst-stage variables) is evaluate's step, the
    checker agrees, and no split of the chain into 4 stages is cheaper (brute force)."""
    problem = _weighted_chain(3)
    cluster = ClusterSpec.homogeneous(2, cores=2)
    sol = solve(problem, cluster, 8, num_stages=4, dp=1, microbatches=4, schedule=name, config=SolverConfig(time_limit_s=10))
    assert sol.schedule == name and sol.status == "OPTIMAL"
    check_assignment(problem, cluster, sol)
    a = sol.assignment
    assert sol.step_time_s == pytest.approx(evaluate(problem, cluster, a).step_time_s, rel=1e-6)
    rows = [row[0] for row in a.device_of_stage_replica]
    assert rows == ([0, 1, 1, 0] if name == "zbv" else [0, 1, 0, 1])
    best = min(evaluate(problem, cluster, dataclasses.replace(
        a, stage_of_region=tuple(sum(r >= c for c in cuts) for r in range(8)), recompute=(False,) * 8)).step_time_s
        for cuts in itertools.combinations(range(1, 8), 3))
    assert sol.step_time_s <= best * (1 + 1e-6)


def test_auto_weighs_the_zero_bubble_schedules():
    """Eight equal regions on 2 ranks, 4 microbatches: every schedule's plan is priced and the
    fastest kept; at F = B = W (no links to speak of) a zero-bubble schedule is it."""
    problem = chain([region(f"r{i}", fwd=1e9, bwd_weight_flops_per_sample=1e9) for i in range(8)], edge_bytes=0)
    cluster = ClusterSpec.homogeneous(2, cores=2)
    auto = solve(problem, cluster, 8, dp=1, microbatches=4, schedule="auto", config=SolverConfig(time_limit_s=10))
    assert "zb" in auto.optimal_over and "zbv" in auto.optimal_over
    assert auto.schedule in ("zb", "zbv"), auto.optimal_over


def test_a_stage_holds_activations_until_its_w_and_kept_gradients_between_b_and_w():
    """Along torch's order of one stage, F adds a microbatch, B adds its kept gradients, W releases
    both (as Note [zero-bubble memory] prices it); the peak is never below 1F1B's for the same stage."""
    from runtime.program.schedules import peak_held

    assert peak_held([("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)]) == 3
    zbv = schedule_named("zbv")
    onef = schedule_named("1f1b")
    for pp, m in ((2, 4), (4, 8)):
        held = [zbv.in_flight(s, 2 * pp, m) for s in range(2 * pp)]
        assert all(k >= 1 for k in held) and held[0] >= onef.in_flight(0, pp, m)
