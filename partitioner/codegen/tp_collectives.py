"""Where a tensor group settles its collectives, written into a stage's graph (partitioner/codegen/lower.py
runs it on every stage of a tp > 1 plan; partitioner/calibrate/tp_overheads.py on the traced
model to time DTensor's dispatch)."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.tp_activations import scatters

from runtime.execute import randomness
from runtime.parallel import tensor_parallel


def tensor_parallel_calls(gm: fx.GraphModule, tp_sharded: dict, sequence_parallel: int = 0) -> None:
    """The calls where a tensor group settles its collectives, Megatron's places (Note
    [tensor-parallel stages] in runtime/parallel/tensor_parallel.py): a vocab-split lookup becomes
    ``tensor_parallel.vocab_embedding`` (all-reduced at once), a row-parallel linear
    ``tensor_parallel.row_linear`` (its partial sums all-reduced at once), the input of a
    sublayer's column-parallel linears (and of a vocab-split head) passes ``tensor_parallel.column_input`` (their input
    gradients all-reduced once in backward), attention ``tensor_parallel.attention`` (torch's kernel
    on each rank's heads), keyed attention dropout ``randomness.tensor_parallel_attention`` (the same, each
    rank's slice of the keyed mask). ``sequence_parallel``: the degree when on (Note [sequence
    parallelism] in runtime/parallel/tensor_parallel.py), then a row linear whose tokens divide by it
    is ``tensor_parallel.row_linear_scatter`` (``scatters`` says which will)."""
    def role(node, index):
        arg = node.args[index] if len(node.args) > index else None
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            return tp_sharded.get(arg.target, ("",))[0]
        return ""

    graph = gm.graph
    entered: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.embedding.default and role(node, 0) == "vocab":
            node.target = tensor_parallel.vocab_embedding
        elif node.target is torch.ops.aten.linear.default and role(node, 1) == "row":
            node.target = (tensor_parallel.row_linear_scatter if sequence_parallel and scatters(node, sequence_parallel)
                           else tensor_parallel.row_linear)
        elif node.target is torch.ops.aten.linear.default and role(node, 1) in ("column", "vocab"):
            x = node.args[0]
            if x not in entered:
                with graph.inserting_after(x):
                    entered[x] = graph.call_function(tensor_parallel.column_input, (x,))
                entered[x].meta = dict(x.meta)
            node.args = (entered[x], *node.args[1:])
        elif node.target is torch.ops.aten.scaled_dot_product_attention.default:
            node.target = tensor_parallel.attention
        elif node.target is randomness.attention:  # keyed attention dropout (Note [randomness keyed by meaning])
            node.target = randomness.tensor_parallel_attention
    gm.recompile()

