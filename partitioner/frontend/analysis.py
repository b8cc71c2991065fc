"""The compiler's front end: trace, key the random ops, run the cost passes, and state the
partition problem as plain numbers. compile() (partitioner/compiler.py) runs it once at the example
batch; lowering (partitioner/codegen/lower.py) runs the trace and the passes again at the plan's microbatch.

    traced   = trace the model (torch.export, symbolic_trace fallback), random ops keyed
    annotate = passes.PIPELINE: shapes → flops → memory → regions → tensor-parallel roles, each
               checked for what it declares
    problem  = the region graph as plain numbers, per sample, priced by the fitted profiles if any
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from passes import ir
from partitioner.calibrate import apply_profiles
from partitioner.calibrate.features import region_features
from partitioner.codegen.randomness import lower_randomness
from partitioner.codegen.split import mutated_buffers
from partitioner.solver import problem as sp
from partitioner.frontend.trace import Traced, trace
from partitioner.frontend.workload import Workload
from runtime.execute import randomness

# Costing runs keyed random ops on fake (or, calibrating, real) tensors: they need a context,
# and no draw's value reaches a cost.
COSTING_RANDOMNESS = randomness.Context(seed=0, step=0, first_sample=0, microbatch=0)


def trace_keyed(workload: Workload, example_args: tuple, *, batch_size: int, example_kwargs: dict | None = None):
    """trace, then key every random op (partitioner/codegen/randomness.py): the graph the cost passes
    price is the graph the stages run (keyed attention with dropout is explicit attention, which
    keeps more than the fused kernel). Returns (Traced, the keyed ops)."""
    kwargs = workload.example_kwargs if example_kwargs is None else example_kwargs
    traced = trace(workload.model, example_args, kwargs)
    return traced, lower_randomness(traced.gm, batch_size=batch_size)


def annotate(traced: Traced, *, granularity: str = "block", optimizer: str = "adamw",
             loss_outside_graph: bool = False) -> fx.GraphModule:
    """The cost passes over the traced graph: ``passes.run_all``, the one pass list."""
    # lazy: loads networkx
    import passes

    with randomness.restored(COSTING_RANDOMNESS):
        return passes.run_all(traced.gm, granularity=granularity, optimizer=optimizer,
                              loss_outside_graph=loss_outside_graph)


def analyze(workload: Workload, *, granularity: str = "block"):
    """Trace and annotate: the graph and its per-region cost table."""
    # lazy: loads networkx
    from passes.region_graph import region_table

    traced, _keyed = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity=granularity, loss_outside_graph=workload.loss_fn is not None)
    return gm, region_table(gm)


def build_problem(gm: fx.GraphModule, batch_size: int, *, profiles=(), target_bytes: int = 0) -> sp.PartitionProblem:
    """The region graph as plain numbers per sample (costs are linear in the microbatch size).

    ``target_bytes``: the loss target of one example batch (``target_bytes_of``).

    ``profiles`` (calibrate.DeviceProfile, one per device kind) price every region by the fitted
    time model on their kind (Note [the fitted time model] in partitioner/calibrate/)."""
    # lazy: loads networkx
    from passes.region_graph import region_cut_edges, region_edges, region_table, region_ties

    # lazy: loads networkx
    from passes.tp_activations import sharded_flops, sharded_saved_bytes

    table = region_table(gm)
    split = sharded_saved_bytes(gm)  # Note [sharded activations]
    split_flops = sharded_flops(gm)  # Note [tensor-parallel pricing]
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
                                                        -(-(r.saved_activation_bytes + r.held_bytes) // batch_size))),
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


def updating_regions(gm: fx.GraphModule) -> set[str]:
    """Names of the regions holding a node that updates a buffer in place (BatchNorm's running
    statistics).

    Note [recompute never updates twice]: recomputing such a region in backward would run its
    update a second time (running statistics counted twice per microbatch). The problem prices
    its recompute as saving nothing, so the solver, which pays the extra forward, never picks it,
    and lowering (partitioner/codegen/lower.py) does not checkpoint it even if a hand-made plan asks to."""
    updaters = {name for names in mutated_buffers(gm).values() for name in names}
    return {ir.get(n, ir.REGION).name for n in gm.graph.nodes if n.name in updaters}


def target_bytes_of(workload: Workload) -> int:
    """Bytes of the loss target of one example batch (every rank builds the global batch's)."""
    if workload.loss_fn is None or workload.make_batch is None:
        return 0
    _args, target = workload.make_batch(0, workload.example_batch_size)
    return sum(t.numel() * t.element_size() for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor))
