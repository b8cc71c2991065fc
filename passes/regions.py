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
higher one. What the problem reads of the regions is passes/region_graph.py.
"""

from __future__ import annotations

import re

import networkx as nx
import torch.fx as fx

from passes import ir

GRANULARITIES = ("block", "sublayer", "op", "node")
_CALL_SUFFIX = re.compile(r"@\d+$")


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
