"""The splits people use without a solver, costed by the same ``evaluate`` as our plans.

* uniform: an equal number of transformer blocks per stage, the embedding (regions before the
  first block) on the first stage and the head (regions after the last block) on the last, as
  torchtitan and Megatron-LM do. With L blocks on p stages the first L mod p stages get one
  more block.
* param_balanced: DeepSpeed's ``partition_method="parameters"``: contiguous stages (in the
  regions' topological order) minimizing the largest parameter count.
``baseline_assignments`` prices them at one given configuration without recompute (the hints
of solve_candidate); fair_baselines.best_baselines gives each its own best configuration, and
"uniform" on mixed devices blocks in proportion to speed (Note [fair baselines] there). A
contiguous split of a topological order never sends data backwards, so both are valid for any DAG.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.evaluate import evaluate
from partitioner.solver.problem import Assignment, PartitionProblem

__all__ = ["BaselineCost", "uniform_split", "param_balanced_split", "min_max_contiguous_split",
           "baseline_assignments", "evaluate_baselines"]


@dataclass(frozen=True)
class BaselineCost:
    step_time_s: float
    fits_memory: bool
    stage_of_region: tuple[int, ...]
    # the configuration it was priced at (fair_baselines.best_baselines: its own best)
    num_stages: int | None = None
    dp: int | None = None
    num_microbatches: int | None = None
    recompute: bool = False


def proportional_counts(total: int, speeds: list[float]) -> list[int] | None:
    """``total`` items over len(speeds) stages in proportion to their speeds, at least one each
    (largest remainder; ties to earlier stages); None when total < stages."""
    p = len(speeds)
    if total < p:
        return None
    shares = [total * v / sum(speeds) for v in speeds]
    counts = [max(1, int(x)) for x in shares]
    while sum(counts) > total:  # the minimum of one pushed us over: take from the largest
        counts[max(range(p), key=lambda s: (counts[s] - shares[s], counts[s]))] -= 1
    while sum(counts) < total:
        counts[max(range(p), key=lambda s: (shares[s] - counts[s], -s))] += 1
    return counts


def uniform_split(problem: PartitionProblem, num_stages: int,
                  speeds: list[float] | None = None) -> tuple[int, ...] | None:
    """Stage of every region for equal blocks per stage (with ``speeds``, one per stage: blocks in
    proportion to them, what one does by hand on mixed devices); None when there are fewer blocks
    than stages. Regions without a block index follow the block before them (the head, after the
    last block, goes to the last stage). Without any block index, regions are split by count."""
    n, p = problem.num_regions, num_stages
    layers = sorted({r.layer for r in problem.regions if r.layer is not None})
    total = len(layers) if layers else n
    if total < p:
        return None
    if speeds is not None and len(set(speeds)) > 1:
        counts = proportional_counts(total, speeds)
    else:
        per_stage, extra = divmod(total, p)
        counts = [per_stage + (1 if s < extra else 0) for s in range(p)]
    if not layers:
        return tuple(s for s in range(p) for _ in range(counts[s]))
    stage_of_layer, layer_index = {}, 0
    for s in range(p):
        for _ in range(counts[s]):
            stage_of_layer[layers[layer_index]] = s
            layer_index += 1
    last_layer_region = max(i for i, r in enumerate(problem.regions) if r.layer is not None)
    stages, current = [], 0
    for i, region in enumerate(problem.regions):
        if region.layer is not None:
            current = max(current, stage_of_layer[region.layer])  # monotone: never send backwards
        elif i > last_layer_region:
            current = p - 1
        stages.append(current)
    return tuple(stages)


def min_max_contiguous_split(weights: list[float] | np.ndarray, num_stages: int) -> tuple[int, ...] | None:
    """Contiguous non-empty stages minimizing the largest sum of ``weights`` (exact DP over
    prefixes; ties broken towards earlier cuts). None when there are fewer items than stages."""
    w = np.asarray(weights, dtype=float)
    n, p = len(w), num_stages
    if n < p:
        return None
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    best = np.full((p, n + 1), np.inf)  # best[k][j]: first j items in k + 1 stages
    cut = np.zeros((p, n + 1), dtype=int)
    best[0, 1:] = prefix[1:]
    rows, cols = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    for k in range(1, p):
        if n <= 1024:  # every j at once (the same floats, the first minimum): O(n^2) memory, O(p) numpy calls
            cost = np.where((rows >= k) & (rows < cols), np.maximum(best[k - 1][:, None], prefix[None, :] - prefix[:, None]),
                            np.inf)[:, k + 1:]
            at = np.argmin(cost, axis=0)
            best[k, k + 1:], cut[k, k + 1:] = cost[at, np.arange(n - k)], at
            continue
        for j in range(k + 1, n + 1):
            i = np.arange(k, j)
            cost = np.maximum(best[k - 1, i], prefix[j] - prefix[i])
            at = int(np.argmin(cost))
            best[k, j], cut[k, j] = cost[at], i[at]
    stages = [0] * n
    j = n
    for k in range(p - 1, 0, -1):
        i = cut[k, j]
        for r in range(i, j):
            stages[r] = k
        j = i
    return tuple(stages)


def param_balanced_split(problem: PartitionProblem, num_stages: int) -> tuple[int, ...] | None:
    return min_max_contiguous_split([r.param_bytes for r in problem.regions], num_stages)


def baseline_assignments(
    problem: PartitionProblem,
    *,
    num_stages: int,
    dp: int,
    num_microbatches: int,
    microbatch_size: int,
    schedule: str,
    placement: tuple[tuple[int, ...], ...],
) -> dict[str, Assignment]:
    """The baselines that exist for this stage count, as Assignments on ``placement``."""
    out = {}
    for name, split in (("uniform", uniform_split(problem, num_stages)),
                        ("param_balanced", param_balanced_split(problem, num_stages))):
        if split is not None:
            out[name] = Assignment(
                stage_of_region=split,
                recompute=(False,) * problem.num_regions,
                device_of_stage_replica=placement,
                num_stages=num_stages,
                dp=dp,
                num_microbatches=num_microbatches,
                microbatch_size=microbatch_size,
                schedule=schedule,
            )
    return out


def evaluate_baselines(problem: PartitionProblem, cluster: ClusterSpec, **kwargs) -> dict[str, BaselineCost]:
    """``baseline_assignments(problem, **kwargs)`` costed by ``evaluate``."""
    out = {}
    for name, assignment in baseline_assignments(problem, **kwargs).items():
        cost = evaluate(problem, cluster, assignment)
        out[name] = BaselineCost(cost.step_time_s, cost.fits_memory, assignment.stage_of_region)
    return out
