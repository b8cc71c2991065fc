"""Graph analyses over a traced GraphModule. Each pass writes one ``partitioner.ir`` key on every
node; they run in the order of :func:`run_all` (shapes -> flops -> memory -> regions)."""

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
