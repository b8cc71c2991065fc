"""Whether to shard the optimizer state over the data-parallel replicas (ZeRO-1): a plan decision.

Note [sharding as a candidate]: sharded optimizer state (runtime/zero.py, Note [sharded optimizer
state]) changes two cost-model terms of every stage with d > 1 replicas, and nothing else:
- memory: AdamW state / d per replica (the runtime's pieces are views of the parameters: no
  master copy), and the step phase holds the whole flat gradient the reduce-scatter reads
  instead of one all-reduce bucket (``allreduce_bucket_bytes`` unbounded);
- time: reduce-scatter + all-gather move the same ring bytes, 2·(d-1)/d of the gradient, as the
  all-reduce they replace, so the time model prices them as that all-reduce.
So a sharded candidate is the same partition problem with those two terms changed
(``sharded_problem``), solved by the same ILP, chain DP and checker, for each dp degree (the
division depends on d). ``solve_with_sharding`` solves the unsharded space and, where asked, the
sharded space per d, and keeps the faster plan; at equal predicted time the unsharded one (one
collective fewer per step in practice, and its optimizer state needs no resharding). Sharding
therefore wins exactly when memory is what holds the unsharded plans back: a candidate that
fits only with sharded state (fewer stages, bigger microbatches, less recompute) is faster.
"""

from __future__ import annotations

import dataclasses
import math

from partitioner.errors import PartitionInfeasibleError

SHARD_CHOICES = ("auto", "on", "off")


def sharded_problem(problem, dp: int):
    """``problem`` with each replica holding 1/dp of the optimizer state (Note [sharding as a
    candidate])."""
    regions = tuple(dataclasses.replace(r, optimizer_bytes=int(math.ceil(r.optimizer_bytes / dp)))
                    for r in problem.regions)
    ties = tuple(t if t.optimizer_bytes is None else
                 dataclasses.replace(t, optimizer_bytes=int(math.ceil(t.optimizer_bytes / dp)))
                 for t in problem.ties)
    return dataclasses.replace(problem, regions=regions, ties=ties, allreduce_bucket_bytes=2 ** 62)


def dp_degrees(cluster, global_batch: int, dp: int | None) -> list[int]:
    if dp is not None:
        return [dp] if dp > 1 else []
    return [d for d in range(2, cluster.num_devices + 1) if global_batch % d == 0]


def solve_with_sharding(problem, cluster, global_batch: int, *, shard: str = "auto", dp: int | None = None,
                        **solve_kwargs):
    """(solution, the problem it was solved on, shard_optimizer) of the best plan over the
    unsharded space and, unless ``shard`` is "off", the sharded one per dp degree ("on": only
    sharded plans with dp > 1)."""
    from partitioner.solver.solve import solve

    if shard not in SHARD_CHOICES:
        raise ValueError(f"shard_optimizer {shard!r} is not one of {list(SHARD_CHOICES)}")
    results, errors = [], []
    if shard in ("auto", "off"):
        try:
            results.append((solve(problem, cluster, global_batch, dp=dp, **solve_kwargs), problem, False))
        except PartitionInfeasibleError as exc:
            errors.append(exc)
    if shard in ("auto", "on"):
        for d in dp_degrees(cluster, global_batch, dp):
            variant = sharded_problem(problem, d)
            try:
                results.append((solve(variant, cluster, global_batch, dp=d, **solve_kwargs), variant, True))
            except (PartitionInfeasibleError, ValueError) as exc:  # ValueError: no (p, m) for this d
                errors.append(exc)
    if not results:
        if errors and isinstance(errors[0], PartitionInfeasibleError):
            raise errors[0]
        if shard == "on":
            raise ValueError("shard_optimizer 'on' needs a plan with dp > 1, and none fits this cluster and "
                             "global batch: allow more devices, or use shard_optimizer 'auto'")
        raise errors[0]
    best = min(results, key=lambda r: (r[0].step_time_s, r[2]))  # equal time: unsharded first
    return best
