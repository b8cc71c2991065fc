"""The region graph as the problem reads it, off the annotated graph: each region's costs
(``region_table``), the bytes between regions (``region_edges``, ``region_cut_edges``) and the
state several regions read (``region_ties``). Reads ``partitioner.region`` (passes/regions.py) and
the cost passes' keys; writes no node key.

Note [one priced reader]
    A tensor read in several regions (Llama's normed input by q, k and v; the residual stream by
    a norm and, later, by the add) is sent across a boundary once, then forwarded (Note [stages
    talk only to their neighbours] in partitioner/codegen/split.py): it crosses boundary k when
    its producer's stage <= k < the latest reader's stage. The problem prices it on one edge,
    to a reader that is always on the latest stage, and keeps 0-byte edges to the other readers
    (true dependencies). Such a reader exists when one reader is reached from every other one
    through data dependencies (the add after the norm): then it is exact, with no extra
    constraint. When several readers are maximal (q, k, v at ``op`` granularity: none feeds
    another), the one of highest id is priced and 0-byte ordering edges from the other maximal
    readers to it make it the latest: that is a constraint no data dependency implies, and it
    narrows the plans searched. ``ordering_edges`` lists those; tests/unit/test_passes_regions.py
    solves the model zoo's problems with and without them (without them the problem underprices,
    so its optimum is a lower bound) and checks the optima agree.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from passes import ir


@dataclass(frozen=True)
class RegionRow:
    """Costs of one region for one microbatch; FLOPs and bytes are sums over its nodes."""

    region_id: int
    name: str
    layer: int | None  # the block index for block.<i>[.*] regions, else None
    node_names: tuple[str, ...]
    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_activation_bytes: int
    held_bytes: int  # kept outside autograd's saved tensors, recompute or not (the loss on the output node)
    bwd_param_grad_bytes: int  # the largest of its nodes'
    bwd_transient_bytes: int  # the largest of its nodes' (Note [backward transients] in passes/memory.py)
    output_bytes: int  # bytes of this region's tensors consumed by other regions (each tensor once)
    # Note [tensor-parallel roles] in passes/tp_roles.py (0 until that pass ran):
    tp_comm_bytes: int = 0  # all-reduce payload tensor parallelism adds in forward, this batch
    tp_sharded_param_bytes: int = 0  # parameter bytes a tensor group divides
    # backward all-reduces and forward all-gathers, this batch; per-step gradient all-gathers; and
    # how many collectives each of the three is (Note [tensor-parallel traffic])
    tp_comm_bwd_bytes: int = 0
    tp_gather_bytes: int = 0
    tp_step_gather_bytes: int = 0
    tp_lookup_bytes: int = 0  # of tp_comm_bytes, the vocab lookups' (not autocast: the model's dtype)
    tp_collectives: tuple[int, int, int] = (0, 0, 0)  # (forward, backward, per step)
    bwd_weight_flops: int = 0  # of bwd_flops, the parameter gradients' (Note [weight-gradient flops])


@dataclass(frozen=True)
class TieRow:
    """Module state (a tied parameter, a shared buffer) read by more than one region."""

    name: str
    bytes: int
    regions: tuple[int, ...]  # the first is the region that owns it (where its bytes are counted)
    # A trained parameter's copies have their gradients summed; anything else (a buffer, a frozen
    # parameter, a lifted constant) is only held by each stage that reads it.
    trainable: bool = True


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "block" and parts[1].split("+")[0].isdigit():
        return int(parts[1].split("+")[0])
    return None


def _consumed_bytes(node: fx.Node, users: list[fx.Node]) -> int:
    """Bytes of ``node``'s output that ``users`` read: for a tuple read only through getitem, the
    elements they take; otherwise the whole output."""
    if users and all(u.op == "call_function" and u.target is operator.getitem for u in users):
        items = {u.args[1]: u for u in users}
        return sum(ir.get(u, ir.SHAPE).output_bytes for u in items.values())
    return ir.get(node, ir.SHAPE).output_bytes


def region_edges(gm: fx.GraphModule) -> list[tuple[int, int, int]]:
    """(src region, dst region, bytes): tensors produced in src and read in dst, each tensor once
    per destination region; parameter reads (get_attr) are not edges (see :func:`region_ties`).
    Edges carrying only non-tensor values have 0 bytes but are kept: they are dependencies."""
    edges: dict[tuple[int, int], int] = {}
    for node, src, by_dst in _readers(gm):
        for dst, users in by_dst.items():
            edges[(src, dst)] = edges.get((src, dst), 0) + _consumed_bytes(node, users)
    return [(s, d, b) for (s, d), b in sorted(edges.items())]


def _readers(gm: fx.GraphModule):
    """(node, its region, {other region: the node's users there}) for every value-producing node."""
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        src = ir.get(node, ir.REGION).region_id
        by_dst: dict[int, list[fx.Node]] = {}
        for user in node.users:
            dst = ir.get(user, ir.REGION).region_id
            if dst != src:
                by_dst.setdefault(dst, []).append(user)
        yield node, src, by_dst


def region_cut_edges(gm: fx.GraphModule, *, order_readers: bool = True) -> list[tuple[int, int, int]]:
    """Edges for pricing stage boundaries: each tensor once per boundary it crosses
    (Note [one priced reader]). Same (src, dst) pairs summed; sorted.

    ``order_readers=False`` leaves out the ordering edges of that Note: the problem is then a
    relaxation (it may underprice a plan that puts a non-priced reader after the priced one),
    used to show that they do not change the optimum (tests/unit/test_passes_regions.py)."""
    edges: dict[tuple[int, int], int] = {}

    def add(src: int, dst: int, num_bytes: int) -> None:
        edges[(src, dst)] = edges.get((src, dst), 0) + num_bytes

    readers = list(_readers(gm))
    reach = _reachability(readers)
    for node, src, by_dst in readers:
        if not by_dst:
            continue
        # the readers no other reader depends on: one of them is on the latest stage
        maximal = [r for r in by_dst if not any(other != r and (reach[r] >> other) & 1 for other in by_dst)]
        last = max(maximal)
        add(src, last, max(_consumed_bytes(node, users) for users in by_dst.values()))
        for dst in by_dst:
            if dst != last:
                add(src, dst, 0)
        if order_readers:
            for dst in maximal:
                if dst != last:
                    add(dst, last, 0)
    return [(s, d, b) for (s, d), b in sorted(edges.items())]


def ordering_edges(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """The (reader, priced reader) pairs Note [one priced reader] adds that no data dependency
    implies: each one narrows the plans searched."""
    true = {(s, d) for s, d, _ in region_cut_edges(gm, order_readers=False)}
    return sorted((s, d) for s, d, _ in region_cut_edges(gm) if (s, d) not in true)


def _reachability(readers) -> dict[int, int]:
    """Region -> bitmask of the regions it reaches through data dependencies."""
    succ: dict[int, set[int]] = {}
    regions: set[int] = set()
    for _, src, by_dst in readers:
        regions.add(src)
        for dst in by_dst:
            regions.add(dst)
            if dst > src:
                succ.setdefault(src, set()).add(dst)
    reach: dict[int, int] = {}
    for r in sorted(regions, reverse=True):  # region ids are topological: successors first
        mask = 0
        for dst in succ.get(r, ()):
            mask |= (1 << dst) | reach.get(dst, 0)
        reach[r] = mask
    return reach


def region_ties(gm: fx.GraphModule) -> list[TieRow]:
    """Module state (get_attr targets) read from more than one region, e.g. GPT-2's tied
    embedding / LM head. Bytes are counted (Note [who owns model state] in passes/memory.py) in
    the first listed region only."""
    regions_of: dict[str, list[int]] = {}
    nbytes: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner = ir.get(node, ir.REGION).region_id
        found = regions_of.setdefault(node.target, [])
        for rid in [owner] + sorted(ir.get(u, ir.REGION).region_id for u in node.users):
            if rid not in found:
                found.append(rid)
        nbytes[node.target] = ir.get(node, ir.SHAPE).output_bytes
    return [TieRow(name, nbytes[name], tuple(rids), _is_trainable(gm, name))
            for name, rids in regions_of.items() if len(rids) > 1]


def _is_trainable(gm: fx.GraphModule, target: str) -> bool:
    prefix, _, leaf = target.rpartition(".")
    try:
        owner = gm.get_submodule(prefix) if prefix else gm
    except AttributeError:
        return False
    value = owner._parameters.get(leaf)
    return value is not None and value.requires_grad


def region_table(gm: fx.GraphModule) -> list[RegionRow]:
    """One RegionRow per region, in region-id (topological) order. Needs shapes, flops, memory
    and regions annotated."""
    members: dict[int, list[fx.Node]] = {}
    names: dict[int, str] = {}
    for node in gm.graph.nodes:
        meta = ir.get(node, ir.REGION)
        members.setdefault(meta.region_id, []).append(node)
        names[meta.region_id] = meta.name
    crossing: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        src = ir.get(node, ir.REGION).region_id
        outside = [u for u in node.users if ir.get(u, ir.REGION).region_id != src]
        if outside:
            crossing[src] = crossing.get(src, 0) + _consumed_bytes(node, outside)
    table = []
    for rid in sorted(members):
        nodes = members[rid]
        flops = [ir.get(n, ir.FLOPS) for n in nodes]
        memory = [ir.get(n, ir.MEMORY) for n in nodes]
        table.append(RegionRow(
            region_id=rid,
            name=names[rid],
            layer=_layer_of(names[rid]),
            node_names=tuple(n.name for n in nodes),
            fwd_flops=sum(f.fwd_flops for f in flops),
            bwd_flops=sum(f.bwd_flops for f in flops),
            bwd_weight_flops=sum(f.bwd_weight_flops for f in flops),
            param_bytes=sum(m.param_bytes for m in memory),
            grad_bytes=sum(m.grad_bytes for m in memory),
            optimizer_bytes=sum(m.optimizer_bytes for m in memory),
            saved_activation_bytes=sum(m.saved_activation_bytes for m in memory),
            held_bytes=sum(m.held_bytes for m in memory),
            bwd_transient_bytes=max((m.bwd_transient_bytes for m in memory), default=0),
            bwd_param_grad_bytes=max((m.bwd_param_grad_bytes for m in memory), default=0),
            output_bytes=crossing.get(rid, 0),
            **_tp_figures([ir.get(n, ir.TP) for n in nodes if ir.has(n, ir.TP)]),
        ))
    return table


def _tp_figures(metas) -> dict:
    """A region's tensor-parallel fields of RegionRow: sums over its nodes' TpMeta."""
    return dict(
        tp_comm_bytes=sum(m.comm_bytes for m in metas),
        tp_sharded_param_bytes=sum(m.sharded_param_bytes for m in metas),
        tp_comm_bwd_bytes=sum(m.comm_bwd_bytes for m in metas),
        tp_gather_bytes=sum(m.gather_bytes for m in metas),
        tp_step_gather_bytes=sum(m.step_gather_bytes for m in metas),
        tp_lookup_bytes=sum(m.lookup_bytes for m in metas),
        tp_collectives=(sum(1 for m in metas if m.comm_bytes or m.gather_bytes),
                        sum(1 for m in metas if m.comm_bwd_bytes),
                        sum(1 for m in metas if m.step_gather_bytes)))
