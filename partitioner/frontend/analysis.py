"""The compiler's front end: trace, key the random ops, run the cost passes. compile()
(partitioner/compiler.py) runs it once at the example batch; lowering (partitioner/codegen/lower.py)
runs the trace and the passes again at the plan's microbatch.

    traced   = trace the model (torch.export, symbolic_trace fallback), random ops keyed
    annotate = passes.PIPELINE: shapes → flops → memory → regions → attention cores → tensor-parallel
               roles, each checked for what it declares

The annotated graph becomes the solver's problem, priced, in partitioner/calibrate/priced_problem.py.
"""

from __future__ import annotations

import sys

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from partitioner.frontend.randomness import lower_randomness
from partitioner.frontend.trace import Traced, trace
from partitioner.frontend.workload import Workload
from partitioner.inspect.table import unpriced_line
from runtime.execute import randomness

# Costing runs keyed random ops on fake (or, calibrating, real) tensors: they need a context,
# and no draw's value reaches a cost.
COSTING_RANDOMNESS = randomness.Context(seed=0, step=0, first_sample=0, microbatch=0)


def trace_keyed(workload: Workload, example_args: tuple, *, batch_size: int, example_kwargs: dict | None = None):
    """trace, then key every random op (partitioner/frontend/randomness.py): the graph the cost passes
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


def unpriced_field(gm: fx.GraphModule) -> dict:
    """``{"unpriced_flops": ...}`` for plan.json's ``predicted`` when expert modules are priced at 0
    FLOPs, said on stderr as well, once per compile; ``{}`` for a dense model, whose plan hashes as
    before (Note [experts priced at 0] in passes/flops.py)."""
    # lazy: as annotate's passes
    from passes.flops import unpriced_experts

    record = unpriced_experts(gm)
    if record:
        print(f"note: {unpriced_line(record)}", file=sys.stderr, flush=True)
    return {"unpriced_flops": record} if record else {}


def analyze(workload: Workload, *, granularity: str = "block"):
    """Trace and annotate: the graph and its per-region cost table."""
    # lazy: loads networkx
    from passes.region_graph import region_table

    traced, _keyed = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity=granularity, loss_outside_graph=workload.loss_fn is not None)
    return gm, region_table(gm)


def target_bytes_of(workload: Workload) -> int:
    """Bytes of the loss target of one example batch (every rank builds the global batch's)."""
    if workload.loss_fn is None or workload.make_batch is None:
        return 0
    _args, target = workload.make_batch(0, workload.example_batch_size)
    return sum(t.numel() * t.element_size() for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor))
