"""The annotated graph as the solver's PartitionProblem: the region graph as plain numbers per
sample, each region priced by the fitted time model of every device kind (Note [the fitted time
model] in partitioner/calibrate/)."""

from __future__ import annotations

import torch.fx as fx

from passes import ir
from partitioner.calibrate import apply_profiles
from partitioner.calibrate.features import region_features
from partitioner.codegen.split import updating_regions
from partitioner.solver import problem as sp


def build_problem(gm: fx.GraphModule, batch_size: int, *, profiles=(), target_bytes: int = 0) -> sp.PartitionProblem:
    """The region graph as plain numbers per sample (costs are linear in the microbatch size).

    ``target_bytes``: the loss target of one example batch (``target_bytes_of``).

    ``profiles`` (calibrate.DeviceProfile, one per device kind) price every region by the fitted
    time model on their kind (Note [the fitted time model] in partitioner/calibrate/)."""
    # lazy: loads networkx
    from passes.region_graph import region_cut_edges, region_edges, region_table, region_ties

    # lazy: loads networkx
    from passes.tp_activations import sharded_flops, sharded_saved_bytes, sharded_transient_bytes

    table = region_table(gm)
    split = sharded_saved_bytes(gm)  # Note [sharded activations]
    split_flops = sharded_flops(gm)  # Note [tensor-parallel pricing]
    split_transient = sharded_transient_bytes(gm)  # Note [sharded transients]
    ops = region_features(gm)  # per region id (fwd, bwd): what a tensor group dispatches per op
    edges = region_edges(gm)
    incoming = {r.region_id: 0 for r in table}
    for src, dst, num_bytes in edges:
        incoming[dst] += num_bytes
    updating = updating_regions(gm)
    regions = tuple(
        sp.RegionCost(
            name=r.name,
            fwd_flops_per_sample=r.fwd_flops / batch_size,
            bwd_flops_per_sample=r.bwd_flops / batch_size,
            bwd_weight_flops_per_sample=r.bwd_weight_flops / batch_size,
            param_bytes=int(r.param_bytes),
            grad_bytes=int(r.grad_bytes),
            optimizer_bytes=int(r.optimizer_bytes),
            activation_bytes_per_sample=-(-(r.saved_activation_bytes + r.held_bytes) // batch_size),
            # A recomputed region keeps only its inputs (and what the runtime holds outside
            # autograd, the loss) and runs its forward again in backward; one that updates a buffer
            # saves nothing by it (Note [recompute never updates twice]).
            recompute_activation_bytes_per_sample=-(-(max(incoming[r.region_id], r.saved_activation_bytes
                                                          if r.name in updating else 0) + r.held_bytes)
                                                    // batch_size),
            layer=r.layer,
            # max over nodes of each part: at least the max of their sums, at any microbatch size
            transient_bytes_per_sample=-(-r.bwd_transient_bytes // batch_size),
            transient_fixed_bytes=r.bwd_param_grad_bytes,
            fwd_ops=int(ops[r.region_id][0].num_ops), bwd_ops=int(ops[r.region_id][1].num_ops),
            tp=sp.TensorParallelCost(
                comm_bytes=-(-r.tp_comm_bytes // batch_size),
                sharded_param_bytes=int(r.tp_sharded_param_bytes),
                comm_bwd_bytes=-(-r.tp_comm_bwd_bytes // batch_size),
                gather_bytes=-(-r.tp_gather_bytes // batch_size),
                lookup_bytes=-(-r.tp_lookup_bytes // batch_size),
                step_gather_bytes=int(r.tp_step_gather_bytes),
                fwd_collectives=r.tp_collectives[0], bwd_collectives=r.tp_collectives[1],
                step_collectives=r.tp_collectives[2],
                sharded_flops_per_sample=split_flops.get(r.region_id, 0) / batch_size,
                sharded_activation_bytes_per_sample=min(-(-split.get(r.region_id, 0) // batch_size),
                                                        -(-(r.saved_activation_bytes + r.held_bytes) // batch_size)),
                sharded_transient_bytes_per_sample=split_transient.get(r.region_id, 0) // batch_size),
        )
        for r in table
    )
    problem_edges = tuple(sp.Edge(src, dst, int(round(b / batch_size))) for src, dst, b in region_cut_edges(gm))
    # A buffer read by regions on several stages costs each holder its bytes and nothing else:
    # no gradient, no optimizer state, no sum (Note [stages talk only to their neighbours]).
    ties = tuple(sp.SharedParam(regions=tuple(sorted(set(t.regions))), param_bytes=int(t.bytes),
                        **({} if t.trainable else {"grad_bytes": 0, "optimizer_bytes": 0}))
                 for t in region_ties(gm) if len(set(t.regions)) > 1)
    inputs = sum(ir.get(n, ir.SHAPE).output_bytes for n in gm.graph.nodes if n.op == "placeholder")
    # The all-reduce's flat bucket (runtime/parallel/grad_sync.py allreduce_flat_): 2**25 elements, or one
    # larger gradient alone; 4-byte elements, the largest there are (Note [memory model]).
    largest_grad = max((ir.get(n, ir.MEMORY).grad_bytes for n in gm.graph.nodes), default=0)
    problem = sp.PartitionProblem(regions=regions, edges=problem_edges, ties=ties,
                                  input_bytes_per_sample=-(-inputs // batch_size),
                                  target_bytes_per_sample=-(-target_bytes // batch_size),
                                  allreduce_bucket_bytes=max(4 * sp.ALLREDUCE_BUCKET_ELEMS, largest_grad))
    return apply_profiles(problem, gm, batch_size, profiles)
