"""Whether to shard the optimizer state over the data-parallel replicas (ZeRO-1): a plan decision.

Note [sharding as a candidate]: sharded optimizer state (Note [sharded optimizer state] in
runtime/parallel/zero.py) changes two cost-model terms of a stage with d > 1 replicas: AdamW state
/ d per replica, with the step phase holding the whole flat gradient instead of one bucket; and,
under gloo only, one ring all-gather more per step (NCCL's reduce-scatter + all-gather move the
ring bytes of the all-reduce they replace). That time is added after the solve (``allgather_s``:
nearly constant within one (p, d, m)) and to the plan's prediction. So a sharded candidate is the
same partition problem with those terms changed (``sharded_problem``), one variant of each (p, d,
m) (Note [one enumeration] in space.py), and the faster plan wins; at equal time the unsharded
one (one collective fewer in practice, no resharding of its state). Sharding thus wins exactly
when memory holds the unsharded plans back.
"""

from __future__ import annotations

import dataclasses
import math

from partitioner.solver.evaluate import evaluate
from partitioner.solver.problem import core_sharing_factor
from partitioner.solver.device_layout import plan_links

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


def allgather_s(problem, cluster, assignment) -> float:
    """The all-gather a sharded plan adds on gloo (cpu devices); 0 under NCCL or at dp 1."""
    d = assignment.dp
    if d < 2 or cluster.devices[0].kind != "cpu":
        return 0.0
    cost = evaluate(problem, cluster, assignment)
    _, dp_links, _ = plan_links(cluster, assignment.device_of_stage_replica)
    worst = max((d - 1) * (st.grads_bytes / d / link.bandwidth_bytes_per_s + link.latency_s)
                for st, link in zip(cost.stages, dp_links) if link is not None)
    return worst * core_sharing_factor(cluster, assignment.device_of_stage_replica)


def dp_degrees_for_test(cluster, global_batch: int) -> list[int]:
    """Every dp > 1 the batch allows: the separate searches the one enumeration replaced (tests
    compare with them)."""
    return [d for d in range(2, cluster.num_devices + 1) if global_batch % d == 0]
