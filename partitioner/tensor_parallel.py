"""What compile() accepts with a tensor-parallel degree, refused before the trace in words.

Note [what tensor parallelism runs with]: the generated program shards each stage over its
tensor group with DTensor (runtime/tensor_parallel.py). It runs fp32 training with pipelining,
data parallelism (each tensor index's replicas all-reduce and digest their own pieces), keyed
dropout, tied embeddings and gradient clipping (the global norm counts a split gradient's pieces
once each and a replicated one on tensor index 0 only, runtime/grad_norm.py). Not yet with it, and
refused here rather than at the first step: ZeRO-1 (its flat pieces are views of plain
parameters), mixed precision (autocast over DTensor is untested here) and the in-memory
checkpoint tier.
"""

from __future__ import annotations

from partitioner.cluster import ClusterSpec


def check_tensor_parallel(tensor_parallel, cluster: ClusterSpec, *, shard_optimizer, precision, training,
                          dp) -> int:
    """The degree compile() plans with (None: 1), or ValueError naming the value and the fix."""
    if tensor_parallel is None:
        return 1
    tp = tensor_parallel
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel={tp!r} must be an int >= 1 (ranks per tensor group), e.g. --tp 2")
    if tp == 1:
        return 1
    from partitioner.solver.tensor_parallel import group_cluster

    group_cluster(cluster, tp)  # refuses a degree the cluster cannot group
    training = training or {}

    def refuse(what: str, fix: str) -> None:
        raise ValueError(f"tensor_parallel={tp} does not run with {what} yet (Note [what tensor parallelism "
                         f"runs with] in partitioner/tensor_parallel.py): {fix}, or compile with --tp 1")

    if shard_optimizer in (True, "on"):
        refuse("a sharded optimizer (ZeRO-1)", "pass --shard-optimizer off")
    chosen = precision or training.get("precision")
    if chosen not in (None, "fp32") or (chosen is None and cluster.devices[0].kind != "cpu"):
        refuse(f"mixed precision ({chosen or 'bf16-mixed, the GPU default'})", "pass --precision fp32")
    if training.get("memory_tier") not in (None, "none") and training.get("memory_tier") != {"mode": "none"}:
        refuse("the in-memory checkpoint tier", "pass --memory-tier none")
    return tp


def grouped(cluster: ClusterSpec, tp: int) -> ClusterSpec:
    """The cluster the solver plans over: each tensor group as one device."""
    from partitioner.solver.tensor_parallel import group_cluster

    return group_cluster(cluster, tp)
