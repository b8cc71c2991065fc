"""Graph analyses over a traced GraphModule. Each pass writes one ``passes.ir`` key on every
node and declares the keys it reads (``@ir.graph_pass``); ``PIPELINE`` is their order, and
:func:`run_all` runs it: the one pass list, the compiler's (partitioner/frontend/analysis.py ``annotate``)
and the tests' alike.

ir.py              the metadata contract between passes: node keys, ``graph_pass`` (docs/design.md §4)
shapes.py          what each node produces (``partitioner.shape``)
flops.py           forward and backward FLOPs per node (``partitioner.flops``)
memory.py          bytes each node holds during training (``partitioner.memory``)
regions.py         nodes grouped into a DAG of regions (``partitioner.region``)
attention_core.py  which nodes form an attention core, the unit of selective recompute (``partitioner.attention_core``)
region_graph.py    the region graph the problem reads: costs per region, edges, ties (writes no key)
tp_roles.py        which nodes a tensor group shards, and how (``tp_role``)
tp_activations.py  what a tensor group splits of saved activations and FLOPs (reads, writes no key)
_fake_run.py       every node run once on fake inputs: the engine of the flops and memory passes
"""

from __future__ import annotations

import torch.fx as fx

from passes.attention_core import annotate_attention_cores
from passes.flops import annotate_flops
from passes.memory import annotate_memory
from passes.region_graph import RegionRow, TieRow, region_cut_edges, region_edges, region_table, region_ties
from passes.regions import annotate_regions
from passes.shapes import annotate_shapes
from passes.tp_roles import annotate_tensor_parallel

__all__ = [
    "annotate_shapes", "annotate_flops", "annotate_memory", "annotate_regions", "annotate_attention_cores",
    "annotate_tensor_parallel",
    "region_table", "region_edges", "region_cut_edges", "region_ties", "RegionRow", "TieRow", "PIPELINE", "run_all",
]

# Each pass reads only keys an earlier one wrote (tests/unit/test_pass_contract.py).
PIPELINE = (annotate_shapes, annotate_flops, annotate_memory, annotate_regions, annotate_attention_cores,
            annotate_tensor_parallel)


def run_all(gm: fx.GraphModule, *, granularity: str = "block", optimizer: str = "adamw",
            loss_outside_graph: bool = False) -> fx.GraphModule:
    """Every pass of ``PIPELINE``, in order, each given the options it takes; returns the same
    (annotated) GraphModule. ``loss_outside_graph``: the Workload applies a ``loss_fn`` to the
    graph's outputs (passes/memory.py)."""
    options = {annotate_memory: {"optimizer": optimizer, "loss_outside_graph": loss_outside_graph},
               annotate_regions: {"granularity": granularity}}
    for graph_pass in PIPELINE:
        graph_pass(gm, **options.get(graph_pass, {}))
    return gm
