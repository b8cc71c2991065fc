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
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from passes import ir
from passes._fake_run import run_nodes_on_fake
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


@dataclass(frozen=True)
class CoreCost:
    """What selective recompute changes of one region, for the traced batch (Note [selective
    recompute] in partitioner/solver/recompute_cost.py): the saved bytes it drops, the bytes of
    the cores' inputs it keeps that nothing kept before, the forward FLOPs it runs again, and how
    many cores (checkpoints) that is."""

    dropped_bytes: int
    kept_bytes: int
    fwd_flops: int
    cores: int


def core_costs(gm: fx.GraphModule) -> dict[int, CoreCost]:
    """Per region id with a core, what checkpointing its cores changes. Exact by storage, as the
    memory pass counts (Note [saved activations] in passes/memory.py): a core drops what only its
    own nodes save (their internal tensors, and their outputs no node outside saves); it keeps
    its inputs, new bytes only where no node saved them before. One more fake run of the graph,
    so only a compile that asks for selective recompute pays it."""
    cores = attention_cores(gm)
    if not cores:
        return {}
    sims = run_nodes_on_fake(gm, count_flops=False, record_saved=True)
    member = {n: i for i, core in enumerate(cores) for n in core}
    saved_by: dict = {}  # storage root -> the cores (or -1: outside) whose nodes save it
    for node, sim in sims.items():
        for root in sim.saved_roots:
            saved_by.setdefault(root, set()).add(member.get(node, -1))
    out: dict[int, CoreCost] = {}
    for i, core in enumerate(cores):
        nodes = set(core)
        dropped = sum(sims[n].saved_internal_bytes for n in core if n in sims)
        dropped += sum(sims[root[0]].storage_bytes.get(root[1], 0) for root, who in saved_by.items()
                       if root[0] in nodes and who == {i})
        inputs = {sims[a].roots[0] for n in core for a in n.all_input_nodes
                  if a not in nodes and a in sims and sims[a].roots and sims[a].roots[0] is not None}
        kept = sum(sims[root[0]].storage_bytes.get(root[1], 0) for root in inputs if root not in saved_by)
        flops = sum(ir.get(n, ir.FLOPS).fwd_flops for n in core)
        region = ir.get(core[0], ir.REGION).region_id
        prev = out.get(region, CoreCost(0, 0, 0, 0))
        out[region] = CoreCost(prev.dropped_bytes + dropped, prev.kept_bytes + kept, prev.fwd_flops + flops,
                               prev.cores + 1)
    return out
