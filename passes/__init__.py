"""Graph analyses over a traced GraphModule. Each pass writes one ``partitioner.ir`` key on every
node; they run in the order of :func:`run_all` (shapes -> flops -> memory -> regions).

shapes.py          what each node produces (``partitioner.shape``)
flops.py           forward and backward FLOPs per node (``partitioner.flops``)
memory.py          bytes each node holds during training (``partitioner.memory``)
regions.py         nodes grouped into a DAG of regions (``partitioner.region``); the region table
tensor_parallel.py which nodes a tensor group shards, and how (``tp_role``)
tp_activations.py  what a tensor group splits of saved activations and FLOPs (reads, writes no key)
_fake_run.py       every node run once on fake inputs: the engine of the flops and memory passes
"""

from __future__ import annotations

import torch.fx as fx

from passes.flops import annotate_flops
from passes.memory import annotate_memory
from passes.regions import (RegionRow, TieRow, annotate_regions, region_cut_edges, region_edges, region_table,
                            region_ties)
from passes.shapes import annotate_shapes

__all__ = [
    "annotate_shapes", "annotate_flops", "annotate_memory", "annotate_regions",
    "region_table", "region_edges", "region_cut_edges", "region_ties", "RegionRow", "TieRow", "run_all",
]


def run_all(gm: fx.GraphModule, *, granularity: str = "block", optimizer: str = "adamw") -> fx.GraphModule:
    """All four passes, in their fixed order; returns the same (annotated) GraphModule."""
    annotate_shapes(gm)
    annotate_flops(gm)
    annotate_memory(gm, optimizer=optimizer)
    annotate_regions(gm, granularity=granularity)
    return gm
