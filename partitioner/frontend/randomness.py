"""Lower every random op of the whole traced graph to a keyed draw of runtime.execute.randomness.

Note [randomness keyed by meaning] in runtime/execute/randomness.py says why: a random op must draw the
same numbers for the same (seed, step, sample, op) whatever the partition. This pass runs on the
unpartitioned graph, before it is split, so the key's op name is the node's name in that graph
(``dropout_3``), the same for every plan of the model.

    reads:  node.target, node.args/kwargs, node.meta["val"] (the output's shape)
    writes: the target and arguments of each random node, in place (its name and meta stay, so
            regions and stage assignment are untouched); nothing else

Ops that draw nothing (dropout with p = 0 or train = False, attention without dropout, a GRU, LSTM
or RNN without dropout between its layers: Note [recurrent dropout]) are left
as they are. In-place draws (``dropout_``, ``bernoulli_``, ``uniform_``, ``normal_``: timm's
DropPath, torchvision's StochasticDepth, ``nn.Dropout(inplace=True)``) become the out-of-place keyed
draw (Note [in-place random ops] in runtime/execute/randomness.py). A random op this pass does not
know is an error naming its module and a fix, not a silent per-process draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from partitioner.frontend.trace import trace
from runtime.execute import randomness as keyed

aten = torch.ops.aten


@dataclass(frozen=True)
class KeyedOp:
    """One lowered node: the key's op name, its runtime function, and its batch dimension."""

    op: str
    function: str
    batch_dim: int | None


def _normalized(node: fx.Node, gm: fx.GraphModule) -> dict:
    found = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if found is None:
        raise ValueError(f"random node {node.name!r} ({node.target}): its arguments cannot be matched to the "
                         "op's schema, so its randomness cannot be keyed: report the model that produced it")
    return dict(found.kwargs)


def _batch_dim(node: fx.Node, batch_size: int) -> int | None:
    # The convention of program_spec: a leading dimension equal to the microbatch is the batch.
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    return 0 if shape and int(shape[0]) == batch_size else None


def _dropout(kw):
    p, train = float(kw.get("p", 0.5)), kw.get("train", kw.get("training", True))
    if p == 0.0 or train is False:
        return None
    return keyed.dropout, (kw["input"], p, bool(train)), {}


def _native_dropout(kw):
    p, train = float(kw["p"]), kw.get("train", True)
    if p == 0.0 or train is False:
        return None
    return keyed.native_dropout, (kw["input"], p, True), {}


def _attention(kw):
    p = float(kw.get("dropout_p", 0.0))
    if p == 0.0:
        return None
    extra = {k: kw[k] for k in ("scale", "enable_gqa") if kw.get(k) not in (None, False)}
    return keyed.attention, (kw["query"], kw["key"], kw["value"], kw.get("attn_mask"), p,
                             bool(kw.get("is_causal", False))), extra


class _CannotKey(Exception):
    """A random op whose draws this pass cannot key (its message: why, and the fix)."""


def _recurrent(kw):
    # Note [recurrent dropout]: aten's gru/lstm/rnn ops carry the nondeterministic tag for their
    # dropout between stacked layers, which draws only with dropout > 0, train and num_layers > 1
    # (a single layer never drops, as nn.GRU warns). Otherwise the op draws nothing and runs as it
    # is. The draws themselves happen inside one fused op, on torch's global generator, per process:
    # they cannot be keyed, so such an op is refused with the equivalent the program does key.
    if float(kw.get("dropout", 0.0)) == 0.0 or kw.get("train", True) is False or int(kw.get("num_layers", 1)) < 2:
        return None
    raise _CannotKey(
        f"it drops out between its {kw['num_layers']} stacked layers (dropout={kw['dropout']}), drawing inside one "
        "fused op from each process's own generator, which the program cannot key. Fix: set dropout=0, or stack "
        "num_layers=1 modules with an nn.Dropout between them (keyed like every dropout)")


def _bernoulli(kw):
    p = kw.get("p")
    return keyed.bernoulli, (kw["input"],) + (() if p is None else (p if isinstance(p, fx.Node) else float(p),)), {}


def _bernoulli_(kw):
    # Note [in-place random ops] in runtime/execute/randomness.py: x.bernoulli_() with no p draws
    # with p = 0.5, not with x's values as torch.bernoulli(x) does.
    p = kw.get("p", 0.5)
    return keyed.bernoulli, (kw["input"], p if isinstance(p, fx.Node) else float(p)), {}


_DIVISIONS = {aten.div_.Tensor, aten.div_.Scalar, aten.div.Tensor, aten.div.Scalar}


def _drop_mask(node: fx.Node):
    """``x.bernoulli_(keep)`` with a float keep as ``drop_mask``: scaled when every reader divides it by keep."""
    def lower(kw):
        keep = float(kw.get("p", 0.5))
        scaled = bool(node.users) and all(
            user.target in _DIVISIONS and user.args[0] is node and len(user.args) > 1
            and isinstance(user.args[1], (int, float)) and float(user.args[1]) == keep for user in node.users)
        return keyed.drop_mask, (kw["input"], keep, scaled), {}
    return lower


def _uniform_(kw):
    return keyed.uniform, (kw["input"], float(kw.get("from", 0.0)), float(kw.get("to", 1.0))), {}


def _normal_(kw):
    return keyed.normal, (kw["input"], float(kw.get("mean", 0.0)), float(kw.get("std", 1.0))), {}


def _factory(function):
    def lower(kw):
        extra = {"dtype": kw["dtype"]} if kw.get("dtype") is not None else {}
        first = kw["input"] if "input" in kw else list(kw["size"])
        return function, (first,), extra
    return lower


_LOWERINGS = {
    aten.dropout.default: _dropout,
    aten.dropout_.default: _dropout,  # Note [in-place random ops]: nn.Dropout(inplace=True)
    F.dropout: _dropout,
    aten.native_dropout.default: _native_dropout,
    aten.scaled_dot_product_attention.default: _attention,
    F.scaled_dot_product_attention: _attention,
    aten.bernoulli.default: _bernoulli,
    aten.bernoulli.p: _bernoulli,
    torch.bernoulli: _bernoulli,
    aten.bernoulli_.float: _drop_mask,  # timm's DropPath, torchvision's StochasticDepth: takes the node
    aten.bernoulli_.Tensor: _bernoulli_,
    aten.uniform_.default: _uniform_,
    aten.normal_.default: _normal_,
    **{op: _recurrent for name in ("gru", "lstm", "rnn_tanh", "rnn_relu")
       for op in (getattr(aten, name).input, getattr(aten, name).data)},
    aten.rand.default: _factory(keyed.rand),
    aten.randn.default: _factory(keyed.randn),
    aten.rand_like.default: _factory(keyed.rand_like),
    aten.randn_like.default: _factory(keyed.randn_like),
}


def _is_random(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _module_dropout_to_function(gm: fx.GraphModule, node: fx.Node) -> None:
    """symbolic_trace keeps nn.Dropout as a call_module: make it the F.dropout call it stands for."""
    module = gm.get_submodule(node.target)
    node.op, node.target = "call_function", F.dropout
    node.args, node.kwargs = (node.args[0],), {"p": module.p, "training": module.training}


def _module_of(node: fx.Node) -> str:
    """`` in module `encoder.rnn` (torch.nn.modules.rnn.GRU)`` from export's module stack, or ""."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, kind = list(stack.values())[-1]
    return f" in module `{path}` ({kind})" if path else f" ({kind})"


_IN_PLACE = {aten.dropout_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.uniform_.default,
             aten.normal_.default}

_KEYED_NAMES = ("dropout (also in place), native_dropout, scaled_dot_product_attention, bernoulli (also "
                "bernoulli_ with a float or tensor p), uniform_, normal_, rand, randn, rand_like, randn_like")


def _aliases_each_other(node: fx.Node) -> bool:
    """Whether ``node``'s output is a view of, or the same tensor as, its first argument."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not node.args:
        return False
    first = target._schema.arguments[0] if target._schema.arguments else None
    returns = target._schema.returns
    return bool(first is not None and first.alias_info is not None and returns and returns[0].alias_info is not None)


def _alias_read_after(node: fx.Node, written: fx.Node) -> fx.Node | None:
    """A reader, after ``node``, of a tensor that shares ``written``'s memory other than through
    ``node``'s own result: the one case where an in-place draw lowered out of place (Note [in-place
    random ops]) would not be seen."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    base = written
    while isinstance(base, fx.Node) and _aliases_each_other(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    seen, todo = set(), [base]
    while todo:
        alias = todo.pop()
        if alias in seen or alias is node:
            continue
        seen.add(alias)
        for user in alias.users:
            if user is node:
                continue
            if _aliases_each_other(user) and user.args[0] is alias:
                todo.append(user)
            elif order[user] > order[node]:
                return user
    return None


def lower_randomness(gm: fx.GraphModule, *, batch_size: int) -> list[KeyedOp]:
    """Rewrite every random node of ``gm`` (the whole traced graph, traced at ``batch_size``)
    into its keyed twin in runtime.execute.randomness; returns what was rewritten, in graph order."""
    lowered: list[KeyedOp] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.Dropout):
            _module_dropout_to_function(gm, node)
        if node.op != "call_function":
            continue
        lowering = _LOWERINGS.get(node.target)
        if lowering is None:
            if _is_random(node.target):
                raise ValueError(
                    f"node {node.name!r} calls {node.target}{_module_of(node)}, a random op whose draws cannot be "
                    f"keyed, so they would differ with the layout (keyed: {_KEYED_NAMES}). Fix: in "
                    f"that module's forward, draw with one of those instead (a mask: torch.rand_like(x) < p; "
                    f"integers: (torch.rand_like(x) * n).long())")
            continue
        try:
            rewritten = (lowering(node) if lowering is _drop_mask else lowering)(_normalized(node, gm))
        except _CannotKey as refused:
            raise ValueError(f"node {node.name!r} calls {node.target}{_module_of(node)}: {refused}") from None
        if rewritten is None:
            continue
        if node.target in _IN_PLACE:
            reader = _alias_read_after(node, node.args[0])
            if reader is not None:
                raise ValueError(
                    f"node {node.name!r} calls {node.target}{_module_of(node)} on a tensor that node "
                    f"{reader.name!r} reads afterwards through another view of it, so the keyed draw, "
                    f"which replaces the in-place write (Note [in-place random ops] in "
                    f"runtime/execute/randomness.py), would not reach it. Fix: in that module's forward, "
                    f"use the op's result (mask = mask.bernoulli_(p)), or draw out of place "
                    f"(torch.bernoulli, F.dropout with inplace=False)")
        function, args, kwargs = rewritten
        batch_dim = _batch_dim(node, batch_size)
        node.target = function
        node.args = args
        node.kwargs = {**kwargs, "op": node.name, "batch_dim": batch_dim}
        lowered.append(KeyedOp(node.name, function.__name__, batch_dim))
    gm.graph.lint()
    gm.recompile()
    return lowered


def keyed_graph(workload, microbatch_size: int) -> tuple[fx.GraphModule, list[KeyedOp]]:
    """The unpartitioned model as verify's oracle runs it when it has random ops: traced at one
    microbatch (the program's shapes), random ops lowered exactly as in the program's stage files,
    so that it draws the program's masks in one process."""
    traced = trace(workload.model, workload.example_args_at(microbatch_size),
                   workload.example_kwargs_at(microbatch_size))
    lowered = lower_randomness(traced.gm, batch_size=microbatch_size)
    # A plain GraphModule over the same nodes and parameters, taking and returning flat tensors
    # as the stage files do (partitioner/codegen/split.py): export's module refuses .train(), which the
    # oracle calls, and its pytree wrapping warns on every deepcopy.
    graph = traced.gm.graph
    graph._codegen = fx.graph.CodeGen()
    output = next(n for n in graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)) and len(output.args[0]) == 1:
        output.args = (output.args[0][0],)
    return fx.GraphModule(traced.gm, graph, class_name="KeyedGraph"), lowered
