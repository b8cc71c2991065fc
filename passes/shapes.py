"""shapes: what each node produces (``partitioner.shape``), read from torch's ``val`` metadata.

A get_attr node describes the parameter or buffer itself; a tuple/list output has one entry per
tensor element (non-tensor elements are skipped); nodes producing no tensor (placeholders of
ints, asserts, the output node) get empty tuples and 0 bytes. ``output_bytes`` is
numel x element size of each tensor (the logical size: a view reports its own size, not its base's
storage). Nothing runs: this works for models on the meta device.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import ir
from passes._fake_run import get_module_attr, output_list


def _tensors_of(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    if node.op == "output":
        return []
    val = node.meta.get("val")
    if val is None and node.op == "get_attr":
        try:
            val = get_module_attr(gm, node.target)
        except AttributeError:
            val = None
    return [v for v in output_list(val) if isinstance(v, torch.Tensor)]


def tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


@ir.graph_pass(reads=(), writes=(ir.SHAPE,))  # reads torch's ``val``
def annotate_shapes(gm: fx.GraphModule) -> fx.GraphModule:
    for node in gm.graph.nodes:
        tensors = _tensors_of(gm, node)
        ir.put(node, ir.SHAPE, ir.ShapeMeta(
            shapes=tuple(tuple(int(s) for s in t.shape) for t in tensors),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
            output_bytes=sum(tensor_bytes(t) for t in tensors),
        ))
    return gm
