"""What compile() accepts with a tensor-parallel degree, refused before the trace in words.

Note [what tensor parallelism runs with]: the generated program shards each stage over its
tensor group with DTensor (runtime/parallel/tensor_parallel.py). It runs fp32, bf16-mixed and fp16-mixed
training (Note [tensor parallelism under autocast]) with pipelining under every schedule (zb and zbv
included: Note [a stage output is no view] in runtime/parallel/tensor_parallel.py), data parallelism (each tensor
index's replicas all-reduce and digest their own pieces), ZeRO-1 (each tensor index's replicas
shard the optimizer state of their local tensors, Note [sharded state with tensor parallelism]
in runtime/resilience/checkpoint/tp_pieces.py), keyed dropout, tied embeddings and gradient clipping (the
global norm counts a split gradient's pieces once each and a replicated one on tensor index 0
only, runtime/execute/grad_norm.py). Not yet with it, and refused here rather than at the first step: the
in-memory checkpoint tier (its slots and parity groups copy whole-rank state along replica
groups that do not know tensor groups; refused at run time too, runtime/launch/rank.py). Compiled
stages run with it (Note [compiled stages] in runtime/execute/compile_stages.py).
"""

from __future__ import annotations

from partitioner.config.cluster import ClusterSpec


def check_tensor_parallel(tensor_parallel, cluster: ClusterSpec, settings) -> int:
    """The degree compile() plans with (None: 1) under ``settings`` (partitioner/config/settings.py
    TrainingSettings), or ValueError naming the value and the fix."""
    if tensor_parallel is None:
        return 1
    tp = tensor_parallel
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel={tp!r} must be an int >= 1 (ranks per tensor group), e.g. --tp 2")
    if tp == 1:
        return 1
    # lazy: loads OR-Tools
    from partitioner.solver.tensor_groups import group_cluster

    group_cluster(cluster, tp)  # refuses a degree the cluster cannot group

    def refuse(what: str, fix: str) -> None:
        raise ValueError(f"tensor_parallel={tp} does not run with {what} yet (Note [what tensor parallelism "
                         f"runs with] in partitioner/frontend/tp_support.py): {fix}, or compile with --tp 1")

    if settings.memory_tier is not None:  # any mode, "none" too: a tier without redundancy
        refuse("the in-memory checkpoint tier", "leave --memory-tier out (disk checkpoints still run)")
    if settings.recompute == "selective":  # Note [selective recompute] in partitioner/solver/recompute_cost.py
        refuse("selective recompute (the attention core on DTensors)", "use --recompute full or auto")
    return tp


def grouped(cluster: ClusterSpec, tp: int) -> ClusterSpec:
    """The cluster the solver plans over: each tensor group as one device."""
    # lazy: loads OR-Tools
    from partitioner.solver.tensor_groups import group_cluster

    return group_cluster(cluster, tp)
