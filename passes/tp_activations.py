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
