"""How a stage file spells a call of an aten op: as a person writes it, where that is the same call.

Note [exact spellings]: a stage file runs the traced graph, so a spelling other than
``torch.ops.aten.<op>.<overload>(...)`` is allowed only where it reaches the same aten overload
with the same arguments: torch's own binding (``torch.addmm``), ``torch.nn.functional``
(``F.linear``), a tensor method (``x.view``) or an operator (``a + b``). Each row of SPELLINGS is
checked by tests/unit/test_stage_spelling.py, which runs both spellings under a dispatch log and
compares what reaches the kernels, the outputs and the gradients bit for bit (the device's kernels
and autocast are picked below the aten op, so the CPU's log holds for CUDA); an op not in the
table, or a call whose arguments a row does not take (an ``alpha``, a keyword given positionally),
stays aten. Arguments equal to the schema's default are left out (the binding fills in the same
value). Dropout with p = 0 or train False returns its input (aten's ``_dropout_impl``): the stage
reads the input instead. It draws nothing and is never keyed: keyed draws are named by their node
in the whole graph, not counted (Note [randomness keyed by meaning] in runtime/execute/randomness.py),
so leaving one out moves no other draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten

FUNCTIONAL = "import torch.nn.functional as F"


@dataclass(frozen=True)
class Spelling:
    """``form``: "function" (``name(args)``), "method" (``args[0].name(rest)``), "attribute"
    (``args[0].name``) or "operator" (``name`` formats the positional arguments)."""

    form: str
    name: str
    # Positional argument i given as this keyword instead (F.softmax's third parameter is not dtype).
    keywords: dict[int, str] = field(default_factory=dict)
    # Arguments the spelling does not take; the kernel never reads them (layer_norm's cudnn_enable).
    unread: tuple[str, ...] = ()
    # Arguments the spelling's binding passes itself with this value (a factory's pin_memory=False).
    fills: dict[str, object] = field(default_factory=dict)
    # Positional order of the spelling, as indices into the schema's (F.embedding takes indices first).
    order: tuple[int, ...] | None = None
    max_args: int | None = None  # more (non-default) arguments than this: the row does not apply
    takes: Callable[[list], bool] | None = None  # whether the row takes these positional arguments
    spread: bool = False  # a method's one list argument written as its items (``x.view(2, 16, 32)``)


def _fn(name, **kw):
    return Spelling("function", name, **kw)


def _method(name, **kw):
    return Spelling("method", name, **kw)


def _op(text):
    return Spelling("operator", text, max_args=text.count("{"))


_FACTORY = dict(fills={"pin_memory": False})

SPELLINGS: dict[torch._ops.OpOverload, Spelling] = {
    # operators (Tensor.__add__ and friends: the same overload, a Python number wrapped the same way)
    aten.add.Tensor: _op("{0} + {1}"), aten.sub.Tensor: _op("{0} - {1}"), aten.mul.Tensor: _op("{0} * {1}"),
    aten.div.Tensor: _op("{0} / {1}"), aten.matmul.default: _op("{0} @ {1}"),
    aten.pow.Tensor_Scalar: _op("{0} ** {1}"), aten.neg.default: _op("-{0}"),
    aten.eq.Tensor: _op("{0} == {1}"), aten.eq.Scalar: _op("{0} == {1}"), aten.ne.Tensor: _op("{0} != {1}"),
    aten.ne.Scalar: _op("{0} != {1}"), aten.lt.Tensor: _op("{0} < {1}"), aten.lt.Scalar: _op("{0} < {1}"),
    aten.le.Tensor: _op("{0} <= {1}"), aten.le.Scalar: _op("{0} <= {1}"), aten.gt.Tensor: _op("{0} > {1}"),
    aten.gt.Scalar: _op("{0} > {1}"), aten.ge.Tensor: _op("{0} >= {1}"), aten.ge.Scalar: _op("{0} >= {1}"),
    aten.__and__.Tensor: _op("{0} & {1}"), aten.__or__.Tensor: _op("{0} | {1}"),
    aten.bitwise_not.default: _op("~{0}"),
    # torch.nn.functional
    aten.linear.default: _fn("F.linear"),
    # F.embedding reads a negative padding_idx from the end; aten's -1 (no padding) is its default
    aten.embedding.default: _fn("F.embedding", order=(1, 0), max_args=3, takes=lambda a: len(a) < 3 or a[2] >= 0),
    aten.layer_norm.default: _fn("F.layer_norm", unread=("cudnn_enable",)),
    aten.gelu.default: _fn("F.gelu"), aten.silu.default: _fn("F.silu"), aten.relu.default: _fn("F.relu"),
    aten.softmax.int: _fn("F.softmax", keywords={2: "dtype"}),
    aten.scaled_dot_product_attention.default: _fn("F.scaled_dot_product_attention"),
    aten.conv2d.default: _fn("F.conv2d"), aten.max_pool2d.default: _fn("F.max_pool2d"),
    aten.adaptive_avg_pool2d.default: _fn("F.adaptive_avg_pool2d"), aten.pad.default: _fn("F.pad"),
    aten.cross_entropy_loss.default: _fn("F.cross_entropy", max_args=2),
    # torch's own bindings
    aten.addmm.default: _fn("torch.addmm"), aten.cat.default: _fn("torch.cat"),
    aten.where.self: _fn("torch.where"), aten.where.ScalarOther: _fn("torch.where"),
    aten.rsqrt.default: _fn("torch.rsqrt"), aten.sqrt.default: _fn("torch.sqrt"), aten.exp.default: _fn("torch.exp"),
    aten.log.default: _fn("torch.log"), aten.cos.default: _fn("torch.cos"), aten.sin.default: _fn("torch.sin"),
    aten.tanh.default: _fn("torch.tanh"), aten.sigmoid.default: _fn("torch.sigmoid"), aten.abs.default: _fn("torch.abs"),
    aten.gather.default: _fn("torch.gather"), aten.diff.default: _fn("torch.diff"),
    aten.min.other: _fn("torch.min"), aten.max.other: _fn("torch.max"),
    aten.batch_norm.default: _fn("torch.batch_norm"),  # cudnn_enabled is read: not F.batch_norm
    aten.arange.default: _fn("torch.arange", **_FACTORY), aten.arange.start: _fn("torch.arange", **_FACTORY),
    aten.zeros.default: _fn("torch.zeros", **_FACTORY), aten.ones.default: _fn("torch.ones", **_FACTORY),
    aten.full.default: _fn("torch.full", **_FACTORY), aten.zeros_like.default: _fn("torch.zeros_like", **_FACTORY),
    aten.ones_like.default: _fn("torch.ones_like", **_FACTORY),
    aten.empty_like.default: _fn("torch.empty_like", **_FACTORY),
    aten.full_like.default: _fn("torch.full_like", **_FACTORY),
    # tensor methods
    aten.view.default: _method("view", spread=True), aten.reshape.default: _method("reshape", spread=True),
    aten.t.default: _method("t"), aten.transpose.int: _method("transpose"),
    aten.permute.default: _method("permute", spread=True),
    aten.unsqueeze.default: _method("unsqueeze"), aten.squeeze.dim: _method("squeeze"),
    aten.expand.default: _method("expand", spread=True), aten.contiguous.default: _method("contiguous"),
    aten.flatten.using_ints: _method("flatten"), aten.split.Tensor: _method("split"), aten.chunk.default: _method("chunk"),
    aten.select.int: _method("select"), aten.mean.dim: _method("mean"), aten.sum.dim_IntList: _method("sum"),
    aten.cumsum.default: _method("cumsum"), aten.topk.default: _method("topk"),
    aten.to.dtype: _method("to"), aten.to.device: _method("to"),
    aten.type_as.default: _method("type_as"), aten.new_ones.default: _method("new_ones", **_FACTORY),
    aten.add_.Tensor: _method("add_"), aten.mul_.Tensor: _method("mul_"), aten.div_.Tensor: _method("div_"),
    aten.index_put_.default: _method("index_put_"), aten.masked_fill.Scalar: _method("masked_fill"),
    aten.numpy_T.default: Spelling("attribute", "T"),
}

# Ops that return their input when p == 0 or train is False (Note [exact spellings]).
IDENTITY_DROPOUTS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
                     aten.feature_alpha_dropout.default}


def dropped_input(target, args: tuple, kwargs: dict):
    """The input a dropout that draws nothing returns (Note [exact spellings]); None otherwise."""
    if target not in IDENTITY_DROPOUTS or kwargs or len(args) != 3:
        return None
    x, p, train = args
    return x if (isinstance(p, (int, float)) and p == 0) or train is False else None


def _is_default(argument, value) -> bool:
    if not argument.has_default_value():
        return False
    default = argument.default_value
    if default is None or value is None:
        return default is None and value is None
    return type(default) is type(value) and default == value


def spelled(target, args: tuple, kwargs: dict, render: Callable[[object], str],
            is_tensor: Callable[[object], bool]) -> tuple[str, bool] | None:
    """``target(*args, **kwargs)`` as a person writes it, and whether it reads ``F``; None where
    SPELLINGS has no exact spelling for this call (Note [exact spellings])."""
    spelling = SPELLINGS.get(target) if isinstance(target, torch._ops.OpOverload) else None
    if spelling is None:
        return None
    schema = target._schema.arguments
    positional = [a for a in schema if not a.kwarg_only]
    if len(args) > len(positional) or any(a.name in kwargs for a in positional):
        return None
    # After an argument left out, the next ones go by their schema names.
    given, named, gap = [], {}, False
    for i, (argument, value) in enumerate(zip(positional, args)):
        if argument.name in spelling.unread or _is_default(argument, value):
            gap = True
        elif gap or i in spelling.keywords:
            named[spelling.keywords.get(i, argument.name)] = value
        else:
            given.append(value)
    for name, value in kwargs.items():
        argument = next(a for a in schema if a.name == name)
        if name in spelling.unread:
            return None
        if not (_is_default(argument, value) or spelling.fills.get(name, ...) == value):
            named[name] = value
    if spelling.max_args is not None and (len(given) + len(named) > spelling.max_args):
        return None
    if spelling.form != "function" and not (given and is_tensor(given[0])):
        return None
    if spelling.takes is not None and not spelling.takes(given):
        return None
    if spelling.order is not None:
        if named or len(given) < len(spelling.order):
            return None
        given = [given[i] for i in spelling.order] + given[len(spelling.order):]
    if spelling.form == "operator":
        return (spelling.name.format(*map(render, given)), False) if len(given) == spelling.max_args and not named else None
    if spelling.form == "attribute":
        return (f"{render(given[0])}.{spelling.name}", False) if len(given) == 1 and not named else None
    if spelling.spread and len(given) == 2 and isinstance(given[1], (list, tuple)) and given[1] and not named:
        given = [given[0], *given[1]]
    words = [render(a) for a in given] + [f"{k}={render(v)}" for k, v in named.items()]
    if spelling.form == "method":
        return f"{words[0]}.{spelling.name}({', '.join(words[1:])})", False
    return f"{spelling.name}({', '.join(words)})", spelling.name.startswith("F.")


def is_tensor(arg) -> bool:
    """Whether a graph argument is a tensor (a method or an operator needs one on its left)."""
    return isinstance(arg, fx.Node) and (arg.op == "get_attr" or isinstance(arg.meta.get("val"), torch.Tensor))


def attribute(base: str, dotted: str) -> str:
    """``blocks.0.ln_1.weight`` read from ``base``: ``self.blocks[0].ln_1.weight`` (runtime/execute/stage.py's
    containers index their children); a numbered child of ``base`` itself through getattr."""
    out = base
    for part in dotted.split("."):
        if part.isidentifier():
            out = f"{out}.{part}"
        elif out == base:
            out = f'getattr({out}, "{part}")'
        else:
            out = f"{out}[{part if part.isdigit() and str(int(part)) == part else repr(part)}]"
    return out
