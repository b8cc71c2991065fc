"""Tensor parallelism in the cost model: a tensor group planned as one device.

Note [tensor groups]: with a tensor-parallel degree tp, the solver plans pipeline stages x
data-parallel replicas over *tensor groups*: tp consecutive devices of one node acting as one
device (logical device g is physical ranks g*tp .. g*tp+tp-1, the tensor index innermost, as
Megatron lays them out). This first version prices a group as

- ``group_cluster``: one device with tp times the memory and tp times the FLOP/s of its members
  (compute divides perfectly), joined to the other groups by today's links;
- ``tp_problem``: the parameter, gradient and optimizer bytes that the tensor group shards
  (``RegionCost.tp_sharded_param_bytes``, from passes/tensor_parallel.py) held once per group
  instead of once per device, i.e. divided by tp, and everything else (norms, biases of row
  linears, activations) held whole by every member: so the group's memory is tp x one member's.

Not priced yet (the collectives ``RegionCost.tp_comm_bytes`` names on the intra-node link, the
compute efficiency of smaller matmuls, activations that stay whole on every rank): the next
version of this module.
"""

from __future__ import annotations

import dataclasses

from partitioner.cluster import ClusterSpec


def group_cluster(cluster: ClusterSpec, tp: int) -> ClusterSpec:
    """Each run of ``tp`` consecutive devices as one device: memory x tp, FLOP/s x tp, on their
    node. Refuses groups that straddle nodes or mix device classes."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel={tp!r} must be an int >= 1")
    if tp == 1:
        return cluster
    n = cluster.num_devices
    if n % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide the cluster's {n} devices: give a degree "
                         f"that divides {n}, or a cluster of a multiple of {tp} devices")
    groups = []
    for g in range(n // tp):
        members = cluster.devices[g * tp:(g + 1) * tp]
        nodes = {d.node for d in members}
        if len(nodes) > 1:
            raise ValueError(f"tensor group {g} ({', '.join(d.name for d in members)}) spans nodes "
                             f"{sorted(nodes)}: tensor parallelism stays within a node; give a degree "
                             "that divides each node's device count")
        classes = {d.device_class for d in members}
        if len(classes) > 1:
            raise ValueError(f"tensor group {g} ({', '.join(d.name for d in members)}) mixes device "
                             "classes: a tensor group must be identical devices")
        first = members[0]
        groups.append(dataclasses.replace(
            first, name=f"{first.name}..{members[-1].name}",
            memory_bytes=first.memory_bytes * tp, flops_per_s=first.flops_per_s * tp,
            memory_reserve_bytes=first.memory_reserve_bytes * tp))
    return dataclasses.replace(cluster, devices=tuple(groups))


def tp_problem(problem, tp: int):
    """``problem`` restated per tensor group (Note [tensor groups]): a group's memory is tp
    members', so every byte a member holds whole (replicated parameters, activations, transients,
    the batch) counts tp times and the sharded parameter, gradient and optimizer bytes once (each
    member holds 1/tp of them). Against ``group_cluster``'s tp x memory that is each member's
    replicated + sharded / tp + activations against its own memory. Not scaled: edges (their
    bytes price the sends, which one member's pipeline makes; the receive buffers they also size
    are under-counted by tp) and ties (kept whole: a vocab-split tied embedding is over-counted)."""
    if tp == 1:
        return problem
    regions = []
    for r in problem.regions:
        share = min(1.0, r.tp_sharded_param_bytes / r.param_bytes) if r.param_bytes else 0.0

        def per_group(nbytes: int) -> int:  # replicated part on every member, sharded part once
            return int(round(nbytes * (1 - share) * tp + nbytes * share))

        regions.append(dataclasses.replace(
            r, param_bytes=per_group(r.param_bytes), grad_bytes=per_group(r.grad_bytes),
            optimizer_bytes=per_group(r.optimizer_bytes), transient_fixed_bytes=per_group(r.transient_fixed_bytes),
            activation_bytes_per_sample=r.activation_bytes_per_sample * tp,
            recompute_activation_bytes_per_sample=r.recompute_activation_bytes_per_sample * tp,
            transient_bytes_per_sample=r.transient_bytes_per_sample * tp))
    return dataclasses.replace(problem, regions=tuple(regions),
                               input_bytes_per_sample=problem.input_bytes_per_sample * tp,
                               target_bytes_per_sample=problem.target_bytes_per_sample * tp,
                               allreduce_bucket_bytes=problem.allreduce_bucket_bytes * tp)
