"""The zero-bubble schedules (zb, zbv) as the solver prices them: torch 2.13's own action order,
simulated over each stage's forward (F), input-gradient (B) and weight-gradient (W) times.

Note [zero-bubble schedules]
    torch 2.13's zero-bubble schedules split each backward into an input-gradient action (B) and a
    weight-gradient action (W) run later, to fill the bubble: ``zb`` (ZB1P, placed as interleaved,
    v = 2-4) and ``zbv`` (2 stages per rank in a V: every placement question asks the schedule's
    ``position_of``); ``dualpipev`` is refused (Note [DualPipeV refused] in
    runtime/program/schedules.py). The runtime drives torch's class over the generated stages;
    recompute takes the non-reentrant checkpoint (Note [recompute under a split backward] in
    runtime/execute/recompute.py); the gradient syncs run after ``schedule.step``, so after every
    stage's last W, and an fp16 overflow skips the W updates with the optimizer step. Tensor
    parallelism (Note [a stage output is no view] in runtime/parallel/tensor_parallel.py), mixed
    precision, ZeRO-1, the replica check, the memory tier and lossless checkpoints run with them
    (tests/e2e/test_zero_bubble_combinations.py); compiled stages and SDC canaries are refused.

Note [weight-gradient flops]
    The flops pass counts, per node, the part of its backward that produces parameter gradients
    (``ir.FlopsMeta.bwd_weight_flops``): for a node reading a trainable parameter, the gradient
    product into that parameter costs what its forward product costs (dW = Xᵀ·dY for Y = X·W, the
    same for a convolution's weight), so it is min(forward, backward) FLOPs; every other node's is
    0. ``RegionCost.bwd_weight_flops_per_sample`` sums them (plan.json ``flops_bwd_weight``) and a
    region's W seconds are its backward seconds times weight / backward FLOPs (so a measured
    backward splits in the same proportion); B is the rest of the stage's backward work.

Note [zero-bubble pricing]
    Each rank runs torch's order (``rank_order``: torch's ``_calculate_single_rank_operations``, the
    lowered ``pipeline_order``), each action as soon as its inputs are ready: F(s, i) after
    F(s - 1, i), B(s, i) after F(s, i) and B(s + 1, i), W(s, i) after B(s, i). The step is then a
    longest path in a DAG, and every path's length is a linear form nF·F + nB·B + nW·W when every
    stage takes the same F, B and W. ``path_forms`` lists the Pareto-maximal (nF, nB, nW) of all
    paths (a DP over the DAG in the order the simulation resolves it). Priced as interleaved is
    (Note [interleaved pricing] in interleaved.py): every stage raised to the worst stage's
    F = max_s f_s, W = max_s w_s and B = max_s (T_s - f_s - w_s), the pipeline is the largest form:
    exact for equal stages, never below torch's timeline (a longest path cannot shrink when a
    duration grows). The ILP holds it as an epigraph: pipeline >= each form, over three epigraph
    variables (linear). tests/unit/test_zero_bubble_pricing.py holds ``simulate_s`` (per-stage
    durations) against an event-driven run of torch's lowered program with its sends and receives,
    and the forms against the simulation at equal stages.

Note [zero-bubble memory]
    Between a microbatch's B and its W torch keeps the stage's autograd graph (retain_graph) and
    the gradients flowing into the weight-producing ops. Priced conservatively: a stage holds a
    microbatch's saved activations from its F until its W (not until B), and a microbatch between
    its B and its W counts twice (its activations and the kept gradients, each at most the saved
    activations' bytes): ``ZeroBubble.in_flight`` is the peak of that count along torch's order of
    the stage; a rank's peak is the sum of its stages' (interleaved's rule).
"""

from __future__ import annotations

from functools import lru_cache

Form = tuple[int, int, int]  # (nF, nB, nW) of one path


def _deps(kind: str, stage: int, mb: int, num_stages: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "B":
        return [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < num_stages - 1 else [])
    return [("B", stage, mb)]


def _resolved(orders: list[list[tuple[str, int, int]]], num_stages: int):
    """(position, action, predecessors) in an order where every predecessor comes first."""
    done: set = set()
    nxt = [0] * len(orders)
    out = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for pos, order in enumerate(orders):
            while nxt[pos] < len(order):
                act = order[nxt[pos]]
                deps = _deps(*act, num_stages)
                if any(d not in done for d in deps):
                    break
                prev = [order[nxt[pos] - 1]] if nxt[pos] else []
                out.append((pos, act, prev + deps))
                done.add(act)
                nxt[pos] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the schedule deadlocks in simulation: {orders}")
    return out


def _orders(schedule, pipeline_ranks: int, num_microbatches: int):
    p = pipeline_ranks * schedule.local_stages
    return [schedule.rank_order(pos, pipeline_ranks, p, num_microbatches) for pos in range(pipeline_ranks)], p


def simulate_s(schedule, pipeline_ranks: int, num_microbatches: int, seconds) -> float:
    """The step's pipeline seconds when action (kind, stage) takes ``seconds(kind, stage)``."""
    orders, p = _orders(schedule, pipeline_ranks, num_microbatches)
    end: dict = {}
    for _pos, act, preds in _resolved(orders, p):
        end[act] = max([end[d] for d in preds], default=0.0) + seconds(act[0], act[1])
    return max(end.values(), default=0.0)


def _pareto(forms: set[Form]) -> set[Form]:
    return {f for f in forms if not any(g != f and all(x >= y for x, y in zip(g, f)) for g in forms)}


@lru_cache(maxsize=256)
def path_forms(schedule, pipeline_ranks: int, num_microbatches: int) -> tuple[Form, ...]:
    """The Pareto-maximal (nF, nB, nW) over every path of torch's order (Note [zero-bubble pricing])."""
    orders, p = _orders(schedule, pipeline_ranks, num_microbatches)
    index = {"F": 0, "B": 1, "W": 2}
    forms: dict = {}
    for _pos, act, preds in _resolved(orders, p):
        into = set().union(*(forms[d] for d in preds)) if preds else {(0, 0, 0)}
        k = index[act[0]]
        forms[act] = _pareto({tuple(n + (i == k) for i, n in enumerate(f)) for f in into})
    return tuple(sorted(_pareto(set().union(*forms.values()))))


def worst_stage_s(forms, fwd_s: float, input_grad_s: float, weight_grad_s: float) -> float:
    """The pipeline at every stage's worst F, B and W: the largest path form."""
    return max(nf * fwd_s + nb * input_grad_s + nw * weight_grad_s for nf, nb, nw in forms)
