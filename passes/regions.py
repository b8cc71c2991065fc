"""regions: group nodes along module boundaries into a DAG of regions (``partitioner.region``).

Note [regions from the module tree]: torch.export stamps every call_function node with
``nn_module_stack`` (module paths from the root down). The repeated blocks are the children of the
ModuleList (or Sequential) whose numbered children cover the most nodes: ``blocks.3``,
``transformer.h.3``, ``model.layers.3``, ``bert.encoder.layer.3``. Then, by granularity:

- ``"block"``: everything before the first block node (in graph order) is ``embed``, each block
  is ``block.<i>``, everything after the last block node is ``head`` (final norm, LM head, loss);
  model-level ops between two blocks go with the block before them.
- ``"sublayer"``: each block is split by its direct children. Norm children (type name contains
  "Norm") go with the sublayer that follows them (pre-norm: ``ln_1`` with ``attn``); block-level
  ops (residual adds) go with the sublayer before them. Names are ``block.<i>.<child>``
  (``block.3.attn``, ``block.3.mlp``, ``block.3.self_attn`` - the child's attribute name).
- ``"op"``: each sublayer is split further at its matmuls: a matmul-like node (linear, mm,
  bmm, attention) starts a new region and the cheap ops after it (reshapes, rotary embedding,
  activations, the residual add) follow it; the ops before a sublayer's first matmul (its norm)
  go with that matmul. Names are ``block.<i>.<child>.<module>`` (``block.3.self_attn.q_proj``,
  ``block.3.mlp.down_proj``; the node's name where no submodule owns the op). Region ids stay
  monotone in graph order, so the result is a DAG without merging. With a sublayer near a third
  of a block, the stages of a deep pipeline can only differ by whole sublayers; matmul-sized
  regions let the solver balance them (benchmarks/partition_quality.py measures the gain).
- ``"node"``: one region per call_function node (``block.<i>.<node>``, ``embed.<node>``,
  ``head.<node>``).

A model without numbered children falls back to its top-level children as units (model-level ops
go with the unit before them), one unit per call (Note [one region per call]).

Note [one region per call]: a child the forward calls several times (ALBERT's one block applied
4 times) is a region per call, ``block``, ``block@1``, ... (torch.export numbers the calls in
``nn_module_stack``'s keys), so its repeats' compute can go to different stages; their shared
weights are a tie (``region_ties``), replicated on every stage that calls the block and summed
once per step, as a tied embedding is. One region for all the calls would pin them to one stage.

get_attr nodes join the region of their first user (a tied parameter used by several regions is
reported by :func:`region_ties` and is not a data edge); placeholders join the first region, the
output node the last. If module boundaries would make the region graph cyclic, the regions on a
cycle are merged (strongly connected components), so the result is always a DAG; region ids are a
topological order (ties broken by first node position), so every edge goes from a lower id to a
higher one.

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
import re
from dataclasses import dataclass

import networkx as nx
import torch.fx as fx

from partitioner import ir

GRANULARITIES = ("block", "sublayer", "op", "node")
_CALL_SUFFIX = re.compile(r"@\d+$")


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
    # Note [tensor-parallel roles] in passes/tensor_parallel.py (0 until that pass ran):
    tp_comm_bytes: int = 0  # all-reduce payload tensor parallelism adds in forward, this batch
    tp_sharded_param_bytes: int = 0  # parameter bytes a tensor group divides
    # backward all-reduces and forward all-gathers, this batch; per-step gradient all-gathers; and
    # how many collectives each of the three is (Note [tensor-parallel traffic])
    tp_comm_bwd_bytes: int = 0
    tp_gather_bytes: int = 0
    tp_step_gather_bytes: int = 0
    tp_lookup_bytes: int = 0  # of tp_comm_bytes, the vocab lookups' (not autocast: the model's dtype)
    tp_collectives: tuple[int, int, int] = (0, 0, 0)  # (forward, backward, per step)


@dataclass(frozen=True)
class TieRow:
    """Module state (a tied parameter, a shared buffer) read by more than one region."""

    name: str
    bytes: int
    regions: tuple[int, ...]  # the first is the region that owns it (where its bytes are counted)
    # A trained parameter's copies have their gradients summed; anything else (a buffer, a frozen
    # parameter, a lifted constant) is only held by each stage that reads it.
    trainable: bool = True


def _module_paths(node: fx.Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path, kind = value if isinstance(value, tuple) else (str(value), "")
        kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
        paths.append((_CALL_SUFFIX.sub("", path), kind))
    return paths


def _top_call(node: fx.Node) -> str | None:
    """The top-level child whose call ``node`` belongs to, one unit per call (Note [one region per
    call]): ``block`` for its first call, ``block@1`` for the second, ..."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else str(value)
        path = _CALL_SUFFIX.sub("", path)
        if not path:
            continue
        top = path.split(".")[0]
        if "." in path:  # a deeper first entry: its top-level call is not in the stack's keys
            return top
        call = re.search(r"@(\d+)$", str(key))
        return f"{top}@{call.group(1)}" if call else top
    return None


def _block_prefix(nodes: list[fx.Node]) -> str | None:
    """The module path whose numbered children cover the most nodes (shallowest on ties)."""
    covered: dict[str, set[fx.Node]] = {}
    for node in nodes:
        for path, _ in _module_paths(node):
            parts = path.split(".") if path else []
            for k, part in enumerate(parts):
                if part.isdigit():
                    covered.setdefault(".".join(parts[:k]), set()).add(node)
    if not covered:
        return None
    return max(covered, key=lambda p: (len(covered[p]), -p.count(".") - (p != "")))


def _block_position(node: fx.Node, prefix: str) -> tuple[int | None, str | None, bool]:
    """(block index, direct child of the block or None, whether that child is a norm)."""
    start = prefix + "." if prefix else ""
    index, child, is_norm = None, None, False
    for path, kind in _module_paths(node):
        if not path.startswith(start):
            continue
        rest = path[len(start):].split(".")
        if not rest[0].isdigit():
            continue
        index = int(rest[0])
        if len(rest) >= 2 and child is None:
            child = rest[1]
            is_norm = "norm" in kind.rsplit(".", 1)[-1].lower()
    return index, child, is_norm


def _sublayer_owners(items: list[tuple[fx.Node, str | None, bool]]) -> dict[fx.Node, str | None]:
    """Owner sublayer of each node of one block (Note [regions from the module tree])."""
    owner: dict[fx.Node, str | None] = {}
    for node, child, is_norm in items:
        if child is not None and not is_norm:
            owner[node] = child
    # Norms: the next non-norm child after them.
    upcoming = None
    for node, child, is_norm in reversed(items):
        if node in owner:
            upcoming = owner[node]
        elif child is not None:
            owner[node] = upcoming
    # Block-level ops: the sublayer before them.
    last = None
    for node, child, _ in items:
        if owner.get(node) is not None:
            last = owner[node]
        else:
            owner[node] = last
    upcoming = None
    for node, _, _ in reversed(items):  # block-level ops before any sublayer: the next one
        if owner[node] is not None:
            upcoming = owner[node]
        else:
            owner[node] = upcoming
    return owner


def _units(gm: fx.GraphModule, granularity: str) -> dict[fx.Node, str]:
    """The unit (region name, before cycle merging) of each call_function node."""
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    prefix = _block_prefix(compute)
    unit: dict[fx.Node, str] = {}
    if prefix is None:  # no repeated blocks: top-level children
        last = None
        for node in compute:
            top = _top_call(node)
            last = top if top is not None else last
            unit[node] = last
        first = next((u for u in unit.values() if u is not None), "model")
        unit = {n: (u if u is not None else first) for n, u in unit.items()}
        if granularity == "node":
            unit = {n: f"{u}.{n.name}" for n, u in unit.items()}
        return unit

    positions = {node: _block_position(node, prefix) for node in compute}
    in_block = [n for n in compute if positions[n][0] is not None]
    order = {n: k for k, n in enumerate(compute)}
    first_pos, last_pos = order[in_block[0]], order[in_block[-1]]

    owners: dict[fx.Node, str | None] = {}
    if granularity in ("sublayer", "op"):
        by_block: dict[int, list] = {}
        for node in in_block:
            index, child, is_norm = positions[node]
            by_block.setdefault(index, []).append((node, child, is_norm))
        for items in by_block.values():
            owners.update(_sublayer_owners(items))

    op_label = _op_labels(in_block, positions, owners, prefix) if granularity == "op" else {}
    previous = None
    for node in compute:
        index = positions[node][0]
        if index is not None:
            name = f"block.{index}"
            if granularity in ("sublayer", "op") and owners.get(node):
                name += f".{owners[node]}"
                if node in op_label:
                    name += f".{op_label[node]}"
            previous = name
        elif order[node] < first_pos:
            name = "embed"
        elif order[node] > last_pos:
            name = "head"
        else:
            name = previous  # model-level op between blocks: with the block before it
        unit[node] = f"{name}.{node.name}" if granularity == "node" else name
    return unit


_MATMUL_OPS = ("linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "conv", "convolution",
               "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _is_matmul(node: fx.Node) -> bool:
    target = node.target
    name = getattr(target, "__name__", str(target))  # "linear.default", "scaled_dot_product_attention"
    return node.op == "call_function" and name.split(".")[0] in _MATMUL_OPS


def _op_labels(in_block: list[fx.Node], positions, owners, prefix: str) -> dict[fx.Node, str]:
    """For ``"op"`` granularity: the label of the matmul each block node follows (Note [regions
    from the module tree]); nodes before their sublayer's first matmul get that first matmul's."""
    by_sublayer: dict[tuple, list[fx.Node]] = {}
    for node in in_block:
        if owners.get(node):
            by_sublayer.setdefault((positions[node][0], owners[node]), []).append(node)
    labels: dict[fx.Node, str] = {}
    for (index, child), nodes in by_sublayer.items():
        base = f"{prefix}.{index}.{child}." if prefix else f"{index}.{child}."
        used: set[str] = set()
        current, pending = None, []
        for node in nodes:
            if _is_matmul(node):
                owner = max((p for p, _ in _module_paths(node) if p.startswith(base)), key=len, default="")
                label = (owner[len(base):].replace(".", "_") if owner
                         else getattr(node.target, "__name__", node.name).split(".")[0])
                if label in used:
                    label = f"{label}_{sum(1 for u in used if u.startswith(label))}"
                used.add(label)
                current = label
                for waiting in pending:
                    labels[waiting] = label
                pending = []
            if current is None:
                pending.append(node)
            else:
                labels[node] = current
        # A sublayer without a matmul keeps its sublayer name (no label).
    return labels


def _data_inputs(node: fx.Node) -> list[fx.Node]:
    return [m for m in node.all_input_nodes if m.op != "get_attr"]


@ir.graph_pass(reads=(), writes=(ir.REGION,))  # reads torch's ``nn_module_stack``
def annotate_regions(gm: fx.GraphModule, *, granularity: str = "block") -> fx.GraphModule:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    nodes = list(gm.graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    unit = _units(gm, granularity)

    graph = nx.DiGraph()
    graph.add_nodes_from(set(unit.values()))
    for node, dst in unit.items():
        for src_node in _data_inputs(node):
            if src_node in unit and unit[src_node] != dst:
                graph.add_edge(unit[src_node], dst)
    # Merge the regions on a cycle, then order the DAG topologically, first node position first.
    condensed = nx.condensation(graph)
    first_node: dict[str, int] = {}
    for node, name in unit.items():
        first_node[name] = min(first_node.get(name, position[node]), position[node])
    members = condensed.graph["mapping"]  # unit -> component
    component_key = {c: min(first_node[u] for u in condensed.nodes[c]["members"]) for c in condensed.nodes}
    topo = list(nx.lexicographical_topological_sort(condensed, key=lambda c: component_key[c]))
    region_id = {c: k for k, c in enumerate(topo)}
    region_name = {}
    for c in topo:
        names = sorted(condensed.nodes[c]["members"], key=lambda u: first_node[u])
        region_name[c] = "+".join(names)

    assigned: dict[fx.Node, int] = {n: region_id[members[u]] for n, u in unit.items()}
    last_region = len(topo) - 1 if topo else 0
    for node in nodes:
        if node.op == "placeholder":
            assigned[node] = 0
        elif node.op == "output":
            assigned[node] = last_region
    for node in nodes:
        if node.op == "get_attr":
            users = sorted((u for u in node.users if u in assigned), key=position.get)
            assigned[node] = assigned[users[0]] if users else 0
    names = {k: region_name[c] for c, k in region_id.items()} or {0: "model"}
    for node in nodes:
        rid = assigned[node]
        ir.put(node, ir.REGION, ir.RegionMeta(region_id=rid, name=names[rid]))
    return gm


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
