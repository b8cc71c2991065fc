"""Tensor parallelism in the cost model: a tensor group planned as one device.

Note [tensor groups]: with a tensor-parallel degree tp, the solver plans pipeline stages x
data-parallel replicas over *tensor groups*: tp consecutive devices of one node acting as one
device (logical device g is physical ranks g*tp .. g*tp+tp-1, the tensor index innermost, as
Megatron lays them out). This first version prices a group as

- ``group_cluster``: one device with tp times the memory and tp times the FLOP/s of its members
  (compute divides perfectly), joined to the other groups by today's links;
- ``tp_problem``: the parameter, gradient and optimizer bytes that the tensor group shards
  (``RegionCost.tp.sharded_param_bytes``, from passes/tp_roles.py) held once per group
  instead of once per device, i.e. divided by tp, and everything else (norms, biases of row
  linears, activations) held whole by every member: so the group's memory is tp x one member's.

``tp_priced_problem`` adds what the solver prices on top (Note [tensor-parallel pricing] below:
the compute a group does not divide, the collectives ``RegionCost.tp.comm_bytes`` names on the
intra-node link, the activations a group splits); the search over degrees is
``degrees_to_search`` with solver/space.py (Note [one enumeration]). Not priced: the lower
efficiency of smaller matmuls.
"""

from __future__ import annotations

import dataclasses

from partitioner.config.cluster import ClusterSpec
from partitioner.solver.problem import measured_or_preset


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
    # each member all-reduces its own share of the group's gradients (Note [collectives as NCCL runs them])
    return dataclasses.replace(cluster, devices=tuple(groups), collective_lanes=cluster.collective_lanes * tp)


# Note [boundary holders]: a tensor group's members each run their own pipeline (one per tensor
# index, runtime/program/layout.py), so every member sends, receives and keeps the whole boundary
# tensor: the stage output PipelineStage holds until its backward (in flight) and the receive
# buffers it allocates for every microbatch (Note [memory model] in evaluate.py). The edges keep
# one member's bytes (they price the sends, which the members make side by side on their own
# lanes); ``PartitionProblem.boundary_holders`` (tp after ``tp_problem``) multiplies them wherever
# they are memory: ``stage_memory`` in evaluate.py, the ILP's memory rows (model_memory.py,
# model.py's can-bind test) and the chain DP's segment memory. Before it, a tensor group's boundary
# memory was counted once per group, 1/tp of what each member holds.
def tp_problem(problem, tp: int):
    """``problem`` restated per tensor group (Note [tensor groups]): a group's memory is tp
    members', so every byte a member holds whole (replicated parameters, activations, transients,
    the batch) counts tp times and the sharded parameter, gradient and optimizer bytes and the split
    part of the backward transient once (each member holds 1/tp of them). Against
    ``group_cluster``'s tp x memory that is each member's replicated + sharded / tp + activations
    against its own memory. Not scaled: edges (their
    bytes price the sends, which one member's pipeline makes; the memory they size is counted tp
    times through ``boundary_holders``, Note [boundary holders]) and ties (kept whole: a
    vocab-split tied embedding is over-counted)."""
    if tp == 1:
        return problem
    regions = []
    for r in problem.regions:
        share = r.tp_param_share

        def per_group(nbytes: int) -> int:  # replicated part on every member, sharded part once
            return int(round(nbytes * (1 - share) * tp + nbytes * share))

        # the split part of the transient once per group (Note [sharded transients] in passes/tp_activations.py)
        split = min(r.tp.sharded_transient_bytes_per_sample, r.transient_bytes_per_sample)
        regions.append(dataclasses.replace(
            r, param_bytes=per_group(r.param_bytes), grad_bytes=per_group(r.grad_bytes),
            optimizer_bytes=per_group(r.optimizer_bytes), transient_fixed_bytes=per_group(r.transient_fixed_bytes),
            activation_bytes_per_sample=r.activation_bytes_per_sample * tp,
            recompute_activation_bytes_per_sample=r.recompute_activation_bytes_per_sample * tp,
            transient_bytes_per_sample=(r.transient_bytes_per_sample - split) * tp + split))
    return dataclasses.replace(problem, regions=tuple(regions), boundary_holders=problem.boundary_holders * tp,
                               input_bytes_per_sample=problem.input_bytes_per_sample * tp,
                               target_bytes_per_sample=problem.target_bytes_per_sample * tp,
                               allreduce_bucket_bytes=problem.allreduce_bucket_bytes * tp)


# Note [tensor-parallel pricing]: what a tensor group costs besides ``tp_problem``'s bytes (the
# group is one device of tp x a member's FLOP/s and memory). Compute: a region's split nodes'
# FLOPs (``sharded_flops``, counted per node: a tied vocab head and the attention core own no
# parameters, so a parameter share would miss them) are divided by tp; the rest runs whole on
# every member. Collectives (Note [tensor-parallel traffic] in passes/tp_roles.py): ring
# all-reduces and all-gathers over the intra-node link, per collective 2 (tp-1) latencies and the
# fixed cost of Note [tensor-parallel overheads]; they go into the region's per-kind times, so
# every pricer sees them alike, and the once-a-step gathers of split gradients into its ``step_s``.
# Activations between a column and its row linear are held 1/tp per member (Note [sharded
# activations] in passes/tp_activations.py), the rest whole on every member.


# Note [tensor-parallel overheads]: two fixed costs a tensor group pays that bytes and FLOPs miss,
# by device kind (measured: partitioner/calibrate/tp_overheads.py, else the preset's): DTensor's
# Python dispatch per op (``dtensor_op_s`` x the region's ops), and per collective gloo's call and
# wake-up (``tp_collective_s``) plus ``tp_skew``: every collective waits for the slowest member,
# and on shared CPU cores members drift apart in proportion to what they compute between two
# collectives, so a region's compute and dispatch count (1 + tp_skew) times. On accelerators all
# three are 0: the host dispatches ahead of the kernels, NCCL's per-call cost is the link's
# latency, and each member has a device of its own to run on.


def dtensor_op_s(problem, kind: str) -> float:
    """Seconds of DTensor dispatch per op on ``kind`` (Note [tensor-parallel overheads])."""
    return _overhead(problem.dtensor_op_s_by_kind, kind, "dtensor_op_s")


def collective_fixed_s(problem, kind: str) -> float:
    """Seconds per tensor-parallel collective on ``kind`` beyond the link's terms."""
    return _overhead(problem.tp_collective_s_by_kind, kind, "tp_collective_s")


def skew(problem, kind: str) -> float:
    """Seconds the members of a tensor group wait for each other per second one computes, on ``kind``."""
    return _overhead(problem.tp_skew_by_kind, kind, "tp_skew")


def _overhead(measured, kind: str, preset_field: str) -> float:
    return measured_or_preset(measured, kind, preset_field)


def sent_bytes(region, tp: int) -> tuple[float, float, float]:
    """(forward per sample, backward per sample, per step) bytes one member of a tensor group of
    ``tp`` sends for ``region``'s collectives under ring algorithms (Note [tensor-parallel
    pricing]); benchmarks/tensor_parallel.py compares their sum over a step with what the program
    sends."""
    if tp == 1:
        return 0.0, 0.0, 0.0
    reduce, gather = 2 * (tp - 1) / tp, (tp - 1) / tp
    return (reduce * region.tp.comm_bytes + gather * region.tp.gather_bytes, reduce * region.tp.comm_bwd_bytes,
            gather * region.tp.step_gather_bytes)


def region_step_s(region, kind: str) -> float:
    return (region.step_s_by_kind or {}).get(kind, 0.0)


def tp_priced_problem(problem, cluster: ClusterSpec, tp: int):
    """``tp_problem`` with the compute and collectives of Note [tensor-parallel pricing] and the
    overheads of Note [tensor-parallel overheads]."""
    if tp == 1:
        return problem
    grouped = tp_problem(problem, tp)
    link = cluster.intra_node_link
    rate_of = {}  # kind -> one member's FLOP/s
    for device in cluster.devices:
        rate_of.setdefault(device.kind, device.flops_per_s)
    regions = []
    for original, r in zip(problem.regions, grouped.regions):
        share = original.tp_flop_share
        whole = share + (1 - share) * tp  # FLOPs in units of one group's rate
        split = min(original.tp.sharded_activation_bytes_per_sample, original.activation_bytes_per_sample)
        changes = dict(fwd_flops_per_sample=original.fwd_flops_per_sample * whole,
                       bwd_flops_per_sample=original.bwd_flops_per_sample * whole,
                       activation_bytes_per_sample=(original.activation_bytes_per_sample - split) * tp + split)
        fwd_sent, bwd_sent, step_sent = sent_bytes(original, tp)
        state_share = original.tp_param_share  # what divides the per-step seconds (AdamW's step)
        fwd, bwd, fwd_fixed, bwd_fixed, step = {}, {}, {}, {}, {}
        for kind, rate in rate_of.items():
            # of one member's seconds: the split nodes' part of a profile's seconds, else the FLOP share
            split = (original.tp.split_fraction_by_kind or {}).get(kind, share)
            fraction = split / tp + (1 - split)
            per_collective = 2 * (tp - 1) * link.latency_s + collective_fixed_s(problem, kind)
            per_op = dtensor_op_s(problem, kind)
            drift = 1 + skew(problem, kind)  # the members wait for each other in proportion to what they compute
            f_meas = (original.fwd_s_per_sample_by_kind or {}).get(kind)
            b_meas = (original.bwd_s_per_sample_by_kind or {}).get(kind)
            fwd[kind] = drift * (f_meas * fraction if f_meas is not None else
                                 original.fwd_flops_per_sample * fraction / rate) + fwd_sent / link.bandwidth_bytes_per_s
            bwd[kind] = drift * (b_meas * fraction if b_meas is not None else
                                 original.bwd_flops_per_sample * fraction / rate) + bwd_sent / link.bandwidth_bytes_per_s
            fwd_fixed[kind] = drift * (((original.fwd_s_per_microbatch_by_kind or {}).get(kind, 0.0) if f_meas is not None
                                        else 0.0) + original.fwd_ops * per_op) + original.tp.fwd_collectives * per_collective
            bwd_fixed[kind] = drift * (((original.bwd_s_per_microbatch_by_kind or {}).get(kind, 0.0) if b_meas is not None
                                        else 0.0) + original.bwd_ops * per_op) + original.tp.bwd_collectives * per_collective
            step[kind] = (original.tp.step_collectives * per_collective + step_sent / link.bandwidth_bytes_per_s
                          + region_step_s(original, kind) * (state_share / tp + 1 - state_share))
        changes.update(fwd_s_per_sample_by_kind=fwd, bwd_s_per_sample_by_kind=bwd,
                       fwd_s_per_microbatch_by_kind=fwd_fixed, bwd_s_per_microbatch_by_kind=bwd_fixed,
                       step_s_by_kind=step if any(step.values()) else None)
        regions.append(dataclasses.replace(r, **changes))
    return dataclasses.replace(grouped, regions=tuple(regions))


def degrees_to_search(cluster: ClusterSpec, runs=lambda tp: True) -> tuple[int, ...]:
    """Tensor-parallel degrees the solver weighs: each divides every node's device count (a group
    stays within a node, of one device class) and ``runs(tp)`` (the program runs it: the degree
    divides the heads, features and vocabulary the sharded nodes split, and the settings allow it;
    partitioner/compiler.py)."""
    per_node: dict[int, int] = {}
    for device in cluster.devices:
        per_node[device.node] = per_node.get(device.node, 0) + 1
    out = []
    for tp in range(1, min(per_node.values()) + 1):
        if any(count % tp for count in per_node.values()):
            continue
        try:
            group_cluster(cluster, tp)
        except ValueError:  # a group would straddle nodes or mix classes
            continue
        if tp == 1 or runs(tp):
            out.append(tp)
    return tuple(out)
