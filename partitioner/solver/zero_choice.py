"""Whether to shard the optimizer state over the data-parallel replicas (ZeRO-1): a plan decision.

Note [sharding as a candidate]: sharded optimizer state (runtime/parallel/zero.py, Note [sharded optimizer
state]) changes two cost-model terms of every stage with d > 1 replicas, and nothing else:
- memory: AdamW state / d per replica (the runtime's pieces are views of the parameters: no
  master copy), and the step phase holds the whole flat gradient the reduce-scatter reads
  instead of one all-reduce bucket (``allreduce_bucket_bytes`` unbounded);
- time: under NCCL, reduce-scatter + all-gather move the same ring bytes, 2·(d-1)/d of the
  gradient, as the all-reduce they replace: no extra term. Under gloo (the cpu kind) the runtime
  all-reduces and then all-gathers the updated slices (gloo's reduce-scatter is slower than its
  all-reduce, Note [sharded optimizer state]): one ring all-gather more, (d-1)·(G/d/bw + latency)
  for a stage of G parameter bytes, the slowest stage's, times the core-sharing factor
  (``allgather_s``). It is added to the candidate's step time after its solve (the ILP does not
  see it: within one (p, d, m) it is nearly constant, the parameters being split over the stages
  either way) and to the plan's predicted step time (partitioner/compiler.py).
So a sharded candidate is the same partition problem with those terms changed
(``sharded_problem``), solved by the same ILP, chain DP and checker, for each dp degree (the
division depends on d). It is one variant of each candidate (p, d, m) of the one enumeration
(Note [one enumeration] in space.py), and the faster plan wins; at equal predicted time the unsharded one (one
collective fewer per step in practice, and its optimizer state needs no resharding). Sharding
therefore wins exactly when memory is what holds the unsharded plans back: a candidate that
fits only with sharded state (fewer stages, bigger microbatches, less recompute) is faster.
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
