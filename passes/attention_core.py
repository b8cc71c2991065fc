"""attention_core: which nodes form an attention core (``partitioner.attention_core``).

Note [the attention core]
    The attention core is what Korthikanti et al. 2022 (arXiv 2205.05198) recompute under
    selective recompute: the scores q kᵀ, their scale and mask, the softmax, the attention dropout
    and the product with v, or one scaled_dot_product_attention call (torch's or the keyed one a
    dropout lowers to). Its saved tensors grow with seq² while its FLOPs are a small part of the
    block's, so it is the cheapest memory to rebuild. Pattern, per softmax: back through
    elementwise ops (scale, mask, cast) to a matmul, forward through casts and a dropout to the
    matmul that reads the probabilities, all in one region. The core is those two matmuls and every
    node between them in graph order; it is tagged only when every such node serves the core
    (is a descendant of the first matmul or feeds only core nodes, as the causal mask does), so a
    tagged core is one contiguous run of the graph: the unit partitioner/codegen/recompute.py
    checkpoints and partitioner/solver/recompute_cost.py prices, the same nodes for both.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from passes import ir
from runtime.execute import randomness as keyed

aten = torch.ops.aten

_SDPA = {aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention, keyed.attention,
         keyed.tensor_parallel_attention}
_MATMUL = {aten.matmul.default, aten.bmm.default, torch.matmul, torch.bmm, operator.matmul}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, torch.softmax, F.softmax}
# between the scores matmul and the softmax: scale, mask, bias, cast
_SCORE_OPS = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.masked_fill.Scalar,
              aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarOther, aten.to.dtype,
              aten._to_copy.default, aten.to.dtype_layout, operator.mul, operator.truediv, operator.add}
# between the softmax and the product with v: casts and the attention dropout
_PROB_OPS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.dropout.default,
             aten.native_dropout.default, operator.getitem, keyed.dropout, keyed.native_dropout, F.dropout,
             aten.type_as.default}


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.op != "get_attr"]


def _scores_matmul(softmax: fx.Node) -> fx.Node | None:
    """The matmul the softmax's input comes from through score ops (first tensor input each step)."""
    node = softmax.args[0] if softmax.args and isinstance(softmax.args[0], fx.Node) else None
    while node is not None and node.op == "call_function":
        if node.target in _MATMUL:
            return node
        if node.target not in _SCORE_OPS:
            return None
        node = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    return None


def _values_matmul(softmax: fx.Node) -> fx.Node | None:
    """The matmul that reads the probabilities (first argument), through casts and dropout."""
    node = softmax
    while True:
        users = [u for u in node.users if u.op == "call_function" and u.target not in _DROPPED]
        if len(users) != 1:
            return None
        node = users[0]
        if node.target in _MATMUL:
            return node
        if node.target not in _PROB_OPS:
            return None


# export's metadata asserts: no work, dropped from stages (partitioner/codegen/split.py DROPPED_TARGETS)
_DROPPED = {aten._assert_tensor_metadata.default}


def _core(first: fx.Node, last: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The nodes from ``first`` to ``last`` in graph order, when every one serves the core."""
    between = [n for n in first.graph.nodes if order[first] <= order[n] <= order[last]]
    downstream = {first}
    for node in between[1:]:
        if any(a in downstream for a in node.all_input_nodes):
            downstream.add(node)
    core = set(downstream)
    for node in reversed(between):  # the mask and other side inputs made only for the core
        if node not in core and all(u in core for u in node.users):
            core.add(node)
    if len(core) != len(between) or any(u not in core for n in between if n is not last for u in n.users):
        return None  # something else runs in between, or a score escapes: not one unit
    return between


@ir.graph_pass(reads=(ir.REGION,), writes=(ir.ATTENTION,))
def annotate_attention_cores(gm: fx.GraphModule) -> fx.GraphModule:
    """Tag every node with the attention core it belongs to (Note [the attention core]); ids in
    graph order, None outside every core."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cores: list[list[fx.Node]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SDPA:
            cores.append([node])
        elif node.target in _SOFTMAX:
            first, last = _scores_matmul(node), _values_matmul(node)
            if first is None or last is None:
                continue
            core = _core(first, last, order)
            if core and len({ir.get(n, ir.REGION).region_id for n in core}) == 1:
                cores.append(core)
    tag = {n: i for i, core in enumerate(cores) for n in core}
    for node in gm.graph.nodes:
        ir.put(node, ir.ATTENTION, ir.AttentionCoreMeta(tag.get(node)))
    return gm


def attention_cores(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The tagged cores of ``gm`` (a whole graph or one stage's), each its nodes in graph order."""
    cores: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        meta = node.meta.get(ir.ATTENTION)
        if meta is not None and meta.core_id is not None:
            cores.setdefault(meta.core_id, []).append(node)
    return list(cores.values())
