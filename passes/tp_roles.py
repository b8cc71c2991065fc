"""tensor_parallel: which linear / embedding nodes a tensor group shards, and how (``tp_role``).

Note [tensor-parallel roles]: Megatron's pairing, read off the module tree.

- A block's sublayer (``attn``, ``mlp``, ``self_attn``: the block's direct children, as
  passes/regions.py finds them) with at least two linears whose weight is a parameter is sharded:
  the linears no other linear of the sublayer feeds are **column**-parallel (q, k, v, MLP up/gate:
  weight and bias split on the output features), the one they feed is **row**-parallel (the
  attention output, MLP down: weight split on the input features, bias whole). Between them every
  tensor is split on its heads / hidden features, so the pair costs one all-reduce of the row
  linear's output in forward (and one of the sublayer input's gradient in backward).
- A sublayer is left **replicated** when that pairing does not hold (one linear, or several that
  feed the last), or when a column output is cut along its features before any per-head view (a
  fused ``qkv`` linear followed by ``split``, GPT-2's layout): sharding it on dim 0 would hand each
  rank a slice of q, k and v of the wrong heads, and DTensor would repair it with an all-gather. A
  fused qkv viewed per head before its split (Megatron's layout: rows grouped by head, as the
  built-in GPT lays them out) is column-parallel like q, k and v apart: a slice of rows is whole heads.
- An embedding indexed by a model input (the token ids, maybe reshaped) is **vocab**-split (weight rows across the
  group; each rank looks up the ids it holds, one all-reduce of the output). A linear outside the
  blocks whose weight is such an embedding's (tied) or has its row count is the output head:
  vocab-split too (one all-gather of the logits for the loss). Position embeddings (indexed by an
  ``arange``) and other linears stay replicated.

Figures (per traced batch, like every field of the region table; build_problem divides by the
batch), Note [tensor-parallel traffic]. ``sharded_param_bytes`` on the get_attr node that owns a
parameter (where passes/memory.py counts its bytes) is that parameter's bytes when a sharded
node reads it. ``divisor`` is the count the tensor-parallel degree must divide: heads for a column
linear whose output is viewed per head, else the sharded dimension's size.

Note [tensor-parallel traffic]: the collectives a tensor group's program issues, where
runtime/parallel/tensor_parallel.py settles them (Megatron's f and g operators), one node each, as
benchmarks/tensor_parallel.py counts them (tests/unit/test_tp_traffic.py compares the two):

- forward, per microbatch: the all-reduce of every row linear's and vocab lookup's output
  (``comm_bytes``: the output's bytes) and the all-gather of a vocab-split head's logits
  (``gather_bytes``: the whole logits' bytes);
- backward, per microbatch: the all-reduce of the input gradient of a sublayer's column
  linears and of a vocab-split head (``column_input``: once per distinct input, on the first
  node in graph order that reads it; ``comm_bwd_bytes``: the input's bytes). Nothing for the row
  linears (the gradient of a replicated output is replicated), the vocab lookup (the gradient
  flows into each rank's rows) or the logits (their gradient is sliced);
- per step, after the schedule: a replicated parameter whose gradient arrives split is
  all-gathered once by ``settle_gradients``: the bias of a vocab-split head
  (``step_gather_bytes`` on its get_attr node: the bias's bytes). Norm weights, row-linear
  biases and position embeddings get replicated gradients (measured: no collective).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from passes import ir
from passes.regions import _block_position, _block_prefix

ROLES = ("column", "row", "vocab", "replicated")
_SPLIT_OPS = ("split", "split_with_sizes", "chunk", "unbind", "tensor_split")
_VIEW_OPS = ("view", "reshape", "_unsafe_view")


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _param_arg(gm: fx.GraphModule, node: fx.Node, index: int) -> fx.Node | None:
    if len(node.args) <= index or not isinstance(node.args[index], fx.Node):
        return None
    arg = node.args[index]
    if arg.op != "get_attr":
        return None
    prefix, _, leaf = arg.target.rpartition(".")
    try:
        owner = gm.get_submodule(prefix) if prefix else gm
    except AttributeError:
        return None
    value = owner._parameters.get(leaf)
    return arg if isinstance(value, torch.nn.Parameter) else None


def _is_linear(gm, node) -> bool:
    return node.op == "call_function" and _name(node) == "linear" and _param_arg(gm, node, 1) is not None


def _is_embedding(gm, node) -> bool:
    return node.op == "call_function" and _name(node) == "embedding" and _param_arg(gm, node, 0) is not None


def _reaches(src: fx.Node, dst: fx.Node, within: set[fx.Node]) -> bool:
    """Does ``dst`` depend on ``src`` through nodes of ``within``?"""
    stack, seen = [dst], set()
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a is src:
                return True
            if a in within and a not in seen:
                seen.add(a)
                stack.append(a)
    return False


def _head_count(node: fx.Node) -> int | None:
    """Heads of a column output: the first view that splits its last dimension in two, followed
    through at most one elementwise op; None when a split cuts it first (fused qkv) or no view does."""
    out_features = ir.get(node, ir.SHAPE).shapes[0][-1]
    frontier = [node]
    for _ in range(3):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.op != "call_function":
                    continue
                if _name(u) in _SPLIT_OPS or u.target is operator.getitem:
                    return None
                if _name(u) in _VIEW_OPS:
                    shape = ir.get(u, ir.SHAPE).shapes[0]
                    if len(shape) >= 2 and shape[-2] * shape[-1] == out_features:
                        return int(shape[-2])
                nxt.append(u)
        frontier = nxt
    return None


def _fused(node: fx.Node) -> bool:
    """Is the column output cut along its features (split/chunk) before a per-head view?"""
    last = len(ir.get(node, ir.SHAPE).shapes[0]) - 1
    for u in node.users:
        if u.op == "call_function" and _name(u) in _SPLIT_OPS:
            dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
            if dim in (-1, last):
                return True
    return False


def _from_input(node) -> bool:
    """Is ``node`` a model input, possibly reshaped (GPT-2 views its ids before the lookup)?"""
    while isinstance(node, fx.Node) and node.op == "call_function" and _name(node) in _VIEW_OPS + ("unsqueeze",):
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder"


@ir.graph_pass(reads=(ir.SHAPE,), writes=(ir.TP,))
def annotate_tensor_parallel(gm: fx.GraphModule) -> fx.GraphModule:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    role: dict[fx.Node, str] = {}
    divisor: dict[fx.Node, int] = {}
    prefix = _block_prefix(nodes)
    if prefix is not None:
        by_sublayer: dict[tuple, list[fx.Node]] = {}
        for n in nodes:
            index, child, is_norm = _block_position(n, prefix)
            if index is not None and child is not None and not is_norm:
                by_sublayer.setdefault((index, child), []).append(n)
        for members in by_sublayer.values():
            linears = [n for n in members if _is_linear(gm, n)]
            if len(linears) < 2:
                continue
            within = set(members)
            fed = [n for n in linears if any(_reaches(o, n, within) for o in linears if o is not n)]
            column = [n for n in linears if n not in fed]
            if len(fed) != 1 or fed[0] is not linears[-1] or any(_fused(c) for c in column):
                continue
            for c in column:
                role[c] = "column"
                divisor[c] = _head_count(c) or ir.get(c, ir.SHAPE).shapes[0][-1]
            role[fed[0]] = "row"
            divisor[fed[0]] = int(gm.get_parameter(fed[0].args[1].target).shape[1])
    vocab_weights: dict[str, int] = {}
    for n in nodes:
        if _is_embedding(gm, n) and _from_input(n.args[1]):
            role[n] = "vocab"
            rows = int(gm.get_parameter(n.args[0].target).shape[0])
            divisor[n] = rows
            vocab_weights[n.args[0].target] = rows
    for n in nodes:
        if _is_linear(gm, n) and n not in role and prefix is not None and _block_position(n, prefix)[0] is None:
            target = n.args[1].target
            rows = int(gm.get_parameter(target).shape[0])
            if target in vocab_weights or rows in vocab_weights.values():
                role[n] = "vocab"
                divisor[n] = rows
    sharded_params: set[str] = set()
    for n, r in role.items():
        weight = n.args[0] if r == "vocab" and _name(n) == "embedding" else n.args[1]
        sharded_params.add(weight.target)
        if r == "column" and len(n.args) > 2 and isinstance(n.args[2], fx.Node):
            sharded_params.add(n.args[2].target)
    counted: set[str] = set()
    entered: set[fx.Node] = set()  # inputs whose gradient one column_input all-reduces
    step_gathered = _split_gradient_params(gm, role, sharded_params)
    for n in gm.graph.nodes:
        r = role.get(n)
        out_bytes = ir.get(n, ir.SHAPE).output_bytes
        head = r == "vocab" and _name(n) == "linear"
        comm = out_bytes if r == "row" or (r == "vocab" and not head) else 0
        comm_bwd = 0
        if r == "column" or head:
            x = n.args[0]
            if isinstance(x, fx.Node) and x not in entered:
                entered.add(x)
                comm_bwd = ir.get(x, ir.SHAPE).output_bytes
        param = step = 0
        if n.op == "get_attr" and n.target not in counted:
            if n.target in sharded_params:
                counted.add(n.target)
                param = out_bytes
            elif n.target in step_gathered:
                counted.add(n.target)
                step = out_bytes
        is_layer = _is_linear(gm, n) or _is_embedding(gm, n)
        ir.put(n, ir.TP, ir.TpMeta(role=(r or "replicated") if is_layer else None, comm_bytes=int(comm),
                                   sharded_param_bytes=int(param), divisor=int(divisor.get(n, 0)),
                                   comm_bwd_bytes=int(comm_bwd), gather_bytes=int(out_bytes if head else 0),
                                   step_gather_bytes=int(step),
                                   lookup_bytes=int(comm if r == "vocab" and not head else 0)))
    return gm


def _split_gradient_params(gm: fx.GraphModule, role: dict, sharded_params: set[str]) -> set[str]:
    """Replicated parameters whose gradient arrives split (Note [tensor-parallel traffic]): the
    bias of a vocab-split head."""
    out = set()
    for n, r in role.items():
        if r == "vocab" and _name(n) == "linear" and len(n.args) > 2 and isinstance(n.args[2], fx.Node):
            if n.args[2].op == "get_attr" and n.args[2].target not in sharded_params:
                out.add(n.args[2].target)
    return out


def sharded_parameters(gm: fx.GraphModule) -> dict[str, tuple[str, int]]:
    """Parameter name -> (role, the dimension tensor parallelism splits) for every parameter a
    sharded node reads; the others are replicated. A tied parameter read by two vocab nodes is
    split on its rows for both."""
    out: dict[str, tuple[str, int]] = {}
    for n in gm.graph.nodes:
        if not ir.has(n, ir.TP):
            continue
        r = ir.get(n, ir.TP).role
        if r in (None, "replicated"):
            continue
        if r == "vocab":
            weight = n.args[0] if _name(n) == "embedding" else n.args[1]
            out[weight.target] = ("vocab", 0)
        elif r == "column":
            out[n.args[1].target] = ("column", 0)
            if len(n.args) > 2 and isinstance(n.args[2], fx.Node):
                out[n.args[2].target] = ("column", 0)
        else:
            out[n.args[1].target] = ("row", 1)
    return out


# Note [no fused recurrent ops on a tensor group]: a tensor-parallel stage runs its traced ops on
# DTensors, and aten's fused GRU/LSTM/RNN ops decompose into ops DTensor has no sharding rule for
# (measured on torch 2.13 CPU: batch-first GRU/RNN reach aten.transpose_, LSTM aten.mkldnn_rnn_layer;
# on CUDA the cuDNN kernel): the step would die at its first forward. So a graph holding one runs at
# tp 1 only, refused here, where the degree is checked (compile's search never weighs tp > 1 for it).
_RECURRENT_OPS = tuple(getattr(getattr(torch.ops.aten, name), overload) for name in ("gru", "lstm", "rnn_tanh", "rnn_relu")
                       for overload in ("input", "data"))


def check_degree(gm: fx.GraphModule, tp: int) -> None:
    """Refuse a degree that does not divide what a sharded node splits (heads, features, vocab), and
    any degree > 1 for a graph with a fused recurrent op (Note [no fused recurrent ops on a tensor group])."""
    if tp == 1:
        return
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _RECURRENT_OPS:
            stack = list((n.meta.get("nn_module_stack") or {}).values())
            where = f" in module `{stack[-1][0]}` ({stack[-1][1]})" if stack and stack[-1][0] else ""
            raise ValueError(f"tensor_parallel={tp}: node {n.name!r} calls {n.target}{where}, which a tensor-parallel "
                             "stage cannot run (DTensor has no sharding rule for the ops inside it): use --tp 1")
        meta = ir.get(n, ir.TP)
        if meta.role in ("column", "row", "vocab") and meta.divisor % tp:
            what = "heads" if meta.role == "column" else ("rows (the vocabulary)" if meta.role == "vocab"
                                                           else "input features")
            raise ValueError(f"tensor_parallel={tp} does not divide the {meta.divisor} {what} of {n.name} "
                             f"({meta.role}-parallel): give a degree that divides {meta.divisor} "
                             "(e.g. --tp 2), or --tp 1")
