"""Each baseline at its own best configuration, under the same cost model as our plan.

Note [fair baselines]
    A baseline priced at our plan's (stages, dp, microbatches) and without recompute is a split
    nobody would pick: a person using it would tune those too. So each baseline (uniform,
    param_balanced) is priced by ``evaluate`` on every candidate (p, d, m) the request allows
    (the same list ``solve`` searches), with recompute off and, where the solver may recompute,
    on for every region it saves memory in (activation checkpointing is one switch in practice;
    with recompute pinned, only as pinned),
    and the fastest that fits memory is kept. Devices are what a careful person picks by hand:
    on one class, cluster order (rank = stage * dp + replica); on mixed classes, the fastest
    class first or last, each class's devices node by node (``place_stages``), and "uniform" gives each
    stage blocks in proportion to its device's speed (1 / its time for the whole model). A
    baseline no configuration fits is reported as not fitting: no time, no ratio. A plan with
    tensor parallelism is compared with the baselines over its own tensor groups (the same degree:
    the person's split of the same devices), not at tp 1 on the devices a fixed --stages x --dp
    would leave them.
"""

from __future__ import annotations

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.baselines import BaselineCost, param_balanced_split, uniform_split
from partitioner.solver.evaluate import evaluate
from partitioner.solver.placements import is_launchable
from partitioner.solver.problem import Assignment, PartitionProblem, region_times_s
from partitioner.solver.recompute_cost import saves_memory
from partitioner.solver.device_layout import place_stages
from partitioner.solver.schedules import priced_schedule

__all__ = ["best_baselines", "hand_placement", "hand_placements"]


def hand_placements(cluster: ClusterSpec, num_stages: int, dp: int, *,
                    local_stages: int = 1, position_of=None) -> list[tuple[tuple[int, ...], ...]]:
    """Devices a person picks (Note [fair baselines]): cluster order on one class; on mixed
    classes the fastest stage slots, fastest class first and, as the other natural try, last
    (the head then lands on a fast device); [] when the classes cannot host p x d."""
    if cluster.is_homogeneous:
        return [place_stages(cluster, num_stages, dp, local_stages=local_stages, position_of=position_of)]
    counts: dict[tuple, int] = {}
    for device in cluster.devices:
        counts[device.device_class] = counts.get(device.device_class, 0) + 1
    slots = [c for c in sorted(counts, key=lambda c: -c[2]) for _ in range(counts[c] // dp)][:num_stages]
    if len(slots) < num_stages:
        return []
    orders = [slots] + ([slots[::-1]] if slots[::-1] != slots else [])
    placements = [place_stages(cluster, num_stages, dp, order) for order in orders]
    return [pl for pl in placements if is_launchable(cluster, pl)]


def hand_placement(cluster: ClusterSpec, num_stages: int, dp: int) -> tuple[tuple[int, ...], ...] | None:
    """The first of ``hand_placements`` (fastest class first), or None."""
    placements = hand_placements(cluster, num_stages, dp)
    return placements[0] if placements else None


def best_baselines(problem: PartitionProblem, cluster: ClusterSpec, candidates, global_batch: int, *,
                   schedule: str, recompute: str = "auto", bound_of=None,
                   local_stages: int = 1, step_terms=None) -> dict[str, BaselineCost]:
    """name -> the fastest fitting configuration of that baseline over ``candidates`` ((p, d, m)
    tuples); a baseline that fits none is the least-over-memory one, with fits_memory False.

    ``bound_of``: (p, d, m) -> a lower bound on every plan of it (the search's, Note [candidate
    pruning]); candidates are then priced in order of it, and once both baselines fit, one
    whose bound is at least both of their times is skipped: it cannot beat them. A split
    depends on p (and the devices' speeds) only, so each is computed once. ``step_terms``
    (space.StepTerms): the gradient norm and replica check the plan's own step time holds, priced
    on the baselines alike."""
    n = problem.num_regions
    recompute_options = [(False,) * n]
    saving = tuple(saves_memory(r) for r in problem.regions)
    if recompute == "full":  # pinned: the baselines too (Note [recompute a user pins] in recompute_cost.py)
        recompute_options = [saving]
    elif recompute == "auto" and any(saving):
        recompute_options.append(saving)
    speed_of: dict[tuple, float] = {}
    splits: dict[tuple, tuple] = {}
    best: dict[str, tuple] = {}
    bound_of = bound_of or {}
    for p, d, m in sorted(candidates, key=lambda c: bound_of.get(c, 0.0)):
        fitting = [key[1] for key, _ in best.values() if key[0] == 0]
        if len(fitting) == 2 and bound_of.get((p, d, m), 0.0) >= max(fitting):
            break  # sorted by bound: every later candidate is bounded at or above both
        for placement in hand_placements(cluster, p, d, local_stages=local_stages,
                                         position_of=priced_schedule(schedule, local_stages).position_of):
            _price(problem, cluster, placement, p, d, m, global_batch // (d * m), schedule, recompute_options,
                   speed_of, best, splits, step_terms)
    return {name: value for name, (_, value) in sorted(best.items())}


def _price(problem, cluster, placement, p, d, m, b, schedule, recompute_options, speed_of, best, splits,
           step_terms=None) -> None:
    """Both baselines on one placement and configuration, kept in ``best`` if they beat it."""
    speeds = []
    for row in placement:
        device = cluster.devices[row[0]]
        if device.device_class not in speed_of:
            speed_of[device.device_class] = 1.0 / max(
                sum(sum(region_times_s(r, device, 1)) for r in problem.regions), 1e-30)
        speeds.append(speed_of[device.device_class])
    key = (p, tuple(speeds))
    if key not in splits:
        splits[key] = (("uniform", uniform_split(problem, p, speeds)),
                       ("param_balanced", param_balanced_split(problem, p)))
    for name, split in splits[key]:
        if split is None:
            continue
        for recompute in recompute_options:
            terms = {} if step_terms is None else dict(sdc_every=step_terms.every(d), global_norm=step_terms.global_norm)
            cost = evaluate(problem, cluster, Assignment(split, recompute, placement, p, d, m, b, schedule), **terms)
            over = max(st.memory_bytes / st.capacity_bytes for st in cost.stages)
            # fitting first, then fastest; among the unfit, the least over memory
            key = (0, cost.step_time_s) if cost.fits_memory else (1, over)
            if name not in best or key < best[name][0]:
                best[name] = (key, BaselineCost(cost.step_time_s, cost.fits_memory, split, p, d, m,
                                                any(recompute)))
