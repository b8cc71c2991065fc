"""Which saved activations a tensor group splits: read-only, over the metadata of passes/memory.py
(saved bytes per node) and passes/tp_roles.py (roles). Writes no node key. Also which row
linears sequence parallelism reduce-scatters (``any_row_scatters``).

Note [sharded activations]: between a column-parallel linear and the row-parallel linear it
feeds, every tensor is split on heads / hidden features (Note [tensor-parallel roles]): each
member of the group holds 1/tp of it. A node's output is split when the node is a column linear,
or when it is no linear or embedding of its own and a tensor input of it is split (the attention,
activation functions, dropout and views between the pair); a row linear's output, all-reduced, is
whole again, as is everything a whole tensor feeds (residual adds, norms, the vocab layers'
outputs). ``sharded_saved_bytes`` sums, per region, the saved activation bytes (MemoryMeta) of the
split nodes: what the solver divides by tp (Note [tensor-parallel pricing] in
partitioner/solver/tensor_groups.py); the rest stays whole on every member.
"""

from __future__ import annotations

import torch.fx as fx

from passes import ir


def split_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose output each tensor-parallel member holds 1/tp of (Note [sharded activations])."""
    split: set[fx.Node] = set()
    for n in gm.graph.nodes:
        role = ir.get(n, ir.TP).role if ir.has(n, ir.TP) else None
        if role == "column":
            split.add(n)
        elif role is None and n.op == "call_function" and any(
                isinstance(a, fx.Node) and a in split for a in n.all_input_nodes):
            split.add(n)
    return split


def tp_divided_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose work a tensor group divides: the split nodes and the row and vocab layers."""
    return split_nodes(gm) | {n for n in gm.graph.nodes if ir.has(n, ir.TP)
                              and ir.get(n, ir.TP).role in ("row", "vocab")}


def sharded_flops(gm: fx.GraphModule) -> dict[int, int]:
    """region id -> forward + backward FLOPs (per traced batch) a tensor group divides by tp: the
    split nodes' (Note [sharded activations]: the column linears and everything between them and
    their row linear, the attention core included) and the row and vocab layers' own matmuls, each
    member computing its slice (Note [tensor-parallel pricing] in partitioner/solver/tensor_groups.py).
    Norms, residual adds and anything else on whole tensors run whole on every member."""
    out: dict[int, int] = {}
    for n in tp_divided_nodes(gm):
        if ir.has(n, ir.FLOPS) and ir.has(n, ir.REGION):
            rid = ir.get(n, ir.REGION).region_id
            meta = ir.get(n, ir.FLOPS)
            out[rid] = out.get(rid, 0) + meta.fwd_flops + meta.bwd_flops
    return out


def sharded_saved_bytes(gm: fx.GraphModule) -> dict[int, int]:
    """region id -> saved activation bytes (per traced batch) of its split nodes."""
    out: dict[int, int] = {}
    for n in split_nodes(gm):
        if ir.has(n, ir.MEMORY) and ir.has(n, ir.REGION):
            rid = ir.get(n, ir.REGION).region_id
            out[rid] = out.get(rid, 0) + ir.get(n, ir.MEMORY).saved_activation_bytes
    return out


def scatters(node: fx.Node, tp: int) -> bool:
    """Whether a row linear's output splits into ``tp`` equal sequence slices (the dim before the
    features: Note [sequence parallelism] in runtime/parallel/tensor_parallel.py)."""
    shape = tuple(getattr(node.meta.get("val"), "shape", ()))
    return len(shape) >= 2 and int(shape[-2]) % tp == 0


def any_row_scatters(gm: fx.GraphModule, tp: int) -> bool:
    """Whether a row-parallel linear of ``gm`` (Note [tensor-parallel roles]) reduce-scatters its
    output at degree ``tp`` under sequence parallelism."""
    return any(ir.has(n, ir.TP) and ir.get(n, ir.TP).role == "row" and scatters(n, tp) for n in gm.graph.nodes)


# Note [sharded transients]: a node's backward transient (Note [backward transients] in
# passes/memory.py: the gradient frontier, its input gradients, its own temporaries) is made of
# gradients of tensors, and a tensor group splits a gradient as it splits the tensor: the split
# nodes' (Note [sharded activations]) are 1/tp on each member (the attention scores' and softmax's
# gradients, tp x larger than anything whole in an eager-attention block), the rest whole. Per
# node n, whole_n is what its transient counts of unsplit tensors; a region's transient on a
# member is then max_n(whole_n + (T_n - whole_n)/tp) <= W + (T - W)/tp, with T = max_n T_n (the
# region's transient) and W = max_n whole_n, for every tp: so ``sharded_transient_bytes`` gives T - W
# per region, and the solver holds W whole and T - W once per group (tp_problem in
# partitioner/solver/tensor_groups.py). Nodes that are not call_functions (the loss on the output
# node) count whole.
def sharded_transient_bytes(gm: fx.GraphModule) -> dict[int, int]:
    """region id -> the part of its backward transient (per traced batch) a tensor group splits
    (Note [sharded transients])."""
    nodes = list(gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    split = split_nodes(gm)

    def frontier(keep) -> list[int]:  # bytes of the kept owners' gradients alive at each node
        delta = [0] * (len(nodes) + 1)
        for i, n in enumerate(nodes):
            if keep(n) and ir.has(n, ir.MEMORY):
                for last_user, nbytes in ir.get(n, ir.MEMORY).grad_spans:
                    delta[i] += nbytes
                    delta[position[last_user]] -= nbytes
        out, running = [], 0
        for i in range(len(nodes)):
            running += delta[i]
            out.append(running)
        return out

    every, unsplit = frontier(lambda n: True), frontier(lambda n: n not in split)
    total: dict[int, int] = {}
    whole: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if not (ir.has(n, ir.MEMORY) and ir.has(n, ir.REGION)):
            continue
        transient = ir.get(n, ir.MEMORY).bwd_transient_bytes
        if not transient:
            continue
        rid = ir.get(n, ir.REGION).region_id
        part = transient
        if n.op == "call_function":
            grads = [(a, ir.get(a, ir.MEMORY).output_grad_bytes) for a in n.all_input_nodes
                     if a.op != "get_attr" and ir.has(a, ir.MEMORY)]
            own = transient - every[i] - sum(g for _, g in grads)  # its temporary, as passes/memory.py counts it
            part = min(transient, unsplit[i] + sum(g for a, g in grads if a not in split) + (0 if n in split else own))
        total[rid] = max(total.get(rid, 0), transient)
        whole[rid] = max(whole.get(rid, 0), part)
    return {rid: total[rid] - whole[rid] for rid in total}
