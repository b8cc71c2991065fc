"""A custom torch.autograd.Function as one graph node that calls the user's ``Function.apply``.

Note [autograd Functions run as themselves]: a non-strict trace runs a Function's forward op by op
and drops the Function (a straight-through estimator becomes plain ``aten.round``): the program
would train with autograd's gradient of those ops, not the user's backward. So, while the model
is traced, torch's apply (where every ``MyFn.apply(...)`` ends, an alias bound before the trace
included) calls the custom op ``partitioner::autograd_function_apply`` instead, which the trace
keeps as one node (its fake kernel runs the Function's forward and checks what could not be
exact); after the trace each such node calls ``FunctionApply(cls)``, and a stage file says
``module.MyFn.apply(...)`` (Note [custom ops travel] in partitioner/codegen/stage_code.py), so the
program trains with the Function's own forward and backward. Refused, in one line naming the
class: a Function no stage file can import (a closure, a file-less module, not under its own
name); a forward that draws random numbers (its draws are not keyed: Note [randomness keyed by
meaning] in runtime/execute/randomness.py); one that writes an input in place (the graph would
not see it); an argument or output that is not tensors (a stage boundary carries tensors only).
The Functions torch makes for a custom op or higher-order op are left alone.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import sys
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from partitioner.errors import TraceError

# Functions torch itself makes for one graph node: left to run as torch traces them.
EXEMPT_MODULES = ("torch._library.autograd.", "torch._higher_order_ops.")
# Functions whose arguments no stage file can write: refused by name in trace.py.
REFUSED = ("torch.utils.checkpoint.CheckpointFunction", "torch.nn.modules._functions.BackwardHookFunction")
_WRITABLE = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


@dataclass(frozen=True)
class FunctionApply:
    """A graph node's target: ``FunctionApply(MyFn)(*args)`` is ``MyFn.apply(*args)``
    (Note [autograd Functions run as themselves])."""

    function: type

    def __post_init__(self):
        # torch.fx names a call_function target by these (the traced module's code)
        object.__setattr__(self, "__module__", self.function.__module__)
        object.__setattr__(self, "__name__", f"{self.function.__qualname__}.apply")

    def __call__(self, *args, **kwargs):
        return self.function.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.key}.apply"

    @property
    def key(self) -> str:
        """Where the stage file finds the Function, before lowering knows the import name."""
        return f"{self.function.__module__}.{self.function.__qualname__}"


def full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class _Call:
    """One ``MyFn.apply(...)`` the trace met: what the stage's call will pass besides the tensors."""

    cls: type
    spec: object  # the pytree spec of (args, kwargs)
    leaves: list  # the flattened (args, kwargs), None where a tensor goes
    tensor_slots: list  # which leaves are tensors
    where: str  # the user's line that applied it
    single: bool = True  # the forward returned one tensor, not a tuple

    def arguments(self, tensors) -> tuple[tuple, dict]:
        it = iter(tensors)
        leaves = [next(it) if slot else leaf for leaf, slot in zip(self.leaves, self.tensor_slots)]
        args, kwargs = tree_unflatten(leaves, self.spec)
        return tuple(args), dict(kwargs)


@dataclass
class Applied:
    """What one trace recorded: the applications it made one node each (by the op's ``call``
    index), the Functions left for trace.py to refuse ({name: where}), and a refusal raised inside
    the trace (export would otherwise bury it under its own error)."""

    calls: list = field(default_factory=list)
    refused: dict = field(default_factory=dict)
    refusal: TraceError | None = None


_ACTIVE: list[Applied] = []
_INSIDE: list[bool] = []  # in a Function's forward: a Function it applies runs as itself there
# Every Function.apply ends in `super().apply(*args)`, torch's C++ apply, looked up past this class
# at each call: replaced there, a Function applied through an alias bound before the trace
# (`round_ste = RoundSTE.apply`) is seen as well.
_LEVEL = torch.autograd.function._SingleLevelFunction




def _original(cls, *args, **kwargs):
    return super(_LEVEL, cls).apply(*args, **kwargs)


_HERE = (__file__, __file__.replace("autograd_functions.py", "trace.py"))


def caller_line() -> str:
    """``file:line `code``` of the innermost frame outside torch and the trace: where a Function's
    ``apply`` was called from."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename.startswith((torch_dir, "<")) or frame.filename in _HERE:
            continue  # torch, the trace, and generated code (`<string>`, `<eval_with_key>`)
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        return f"{frame.filename}:{frame.lineno} `{line}`"
    return ""


def _refuse(entry: _Call, why: str) -> None:
    error = TraceError(f"the custom autograd Function {full_name(entry.cls)}"
                       + (f" at {entry.where}" if entry.where else "") + f" cannot run as itself: {why}")
    if _ACTIVE and _ACTIVE[-1].refusal is None:
        _ACTIVE[-1].refusal = error
    raise error


def _check_importable(entry: _Call) -> None:
    cls = entry.cls
    if "<locals>" in cls.__qualname__:
        _refuse(entry, "it is defined inside a function, and a stage file imports it by name. Fix: define "
                       "the class at the top level of your model file or of a module it imports")
    module = sys.modules.get(cls.__module__)
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    if not path or not os.path.isfile(path):
        _refuse(entry, "it is defined in no file (an interactive session or a notebook?), and a stage file "
                       "imports it from its file. Fix: define the class in a .py file")
    found = module
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not cls:
        _refuse(entry, f"{cls.__module__} has no {cls.__qualname__} that is this class, and a stage file "
                       "finds it by that name. Fix: define the class under its own name at the top level of "
                       "its module")


def _apply(cls, *args, **kwargs):
    """``Function.apply`` while a trace is active (Note [autograd Functions run as themselves])."""
    record = _ACTIVE[-1] if _ACTIVE else None
    name = full_name(cls)
    if record is None or _INSIDE or name.startswith(EXEMPT_MODULES):
        return _original(cls, *args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    if name in REFUSED or any(isinstance(leaf, fx.Proxy) for leaf in leaves):
        record.refused.setdefault(name, caller_line())  # symbolic_trace's: refused as before
        return _original(cls, *args, **kwargs)
    slots = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    entry = _Call(cls, spec, [None if slot else leaf for leaf, slot in zip(leaves, slots)], slots, caller_line())
    _check_importable(entry)
    bad = next((leaf for leaf in leaves if not isinstance(leaf, (torch.Tensor, *_WRITABLE))), None)
    if bad is not None:
        _refuse(entry, f"it is passed a {type(bad).__name__}, which a stage file cannot write. Fix: pass "
                       "tensors and plain values (numbers, strings, None); keep other objects in the model")
    record.calls.append(entry)
    outputs = torch.ops.partitioner.autograd_function_apply(
        [leaf for leaf, slot in zip(leaves, slots) if slot], len(record.calls) - 1)
    return outputs[0] if entry.single else tuple(outputs)


class _Watch(TorchDispatchMode):
    """The random ops a Function's forward calls."""

    def __init__(self):
        super().__init__()
        self.random: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random.append(str(func))
        return func(*args, **(kwargs or {}))


@torch.library.custom_op("partitioner::autograd_function_apply", mutates_args=(),
                         schema="(Tensor[] tensors, int call) -> Tensor[]")
def _apply_op(tensors, call):
    """The Function's own forward on the (fake) tensors, checked where a partition could not be
    exact; its outputs, copied (an op's outputs alias no input)."""
    entry = _ACTIVE[-1].calls[call]
    args, kwargs = entry.arguments(tensors)
    versions = [t._version for t in tensors]
    watch = _Watch()
    _INSIDE.append(True)
    try:
        with torch.no_grad(), watch:
            out = entry.cls.apply(*args, **kwargs)
    finally:
        _INSIDE.pop()
    if watch.random:
        _refuse(entry, f"its forward draws random numbers ({watch.random[0]}), which a partition cannot draw as "
                       "the unpartitioned model does. Fix: draw outside the Function and pass the random tensor in")
    if any(t._version != v for t, v in zip(tensors, versions)):
        _refuse(entry, "its forward writes an input in place, which the traced graph would not see. Fix: "
                       "return a new tensor instead")
    entry.single = not isinstance(out, tuple)
    outputs = (out,) if entry.single else out
    bad = next((o for o in outputs if not isinstance(o, torch.Tensor)), None)
    if bad is not None or not outputs:
        _refuse(entry, f"its forward returns {'a ' + type(bad).__name__ + ' value' if outputs else 'an empty tuple'}, and a "
                       "graph node carries tensors only. Fix: return tensors (keep other values on ctx or the model)")
    return [o.clone() for o in outputs]


_apply_op.register_fake(_apply_op._init_fn)


@contextlib.contextmanager
def applied():
    """While active, every ``MyFn.apply`` is one custom op node; yields the Applied record.
    torch's apply is restored afterwards."""
    record = Applied()
    _ACTIVE.append(record)
    before = _LEVEL.__dict__.get("apply")
    _LEVEL.apply = classmethod(_apply)
    try:
        yield record
    finally:
        if before is None:
            del _LEVEL.apply
        else:
            _LEVEL.apply = before
        _ACTIVE.pop()


def as_applies(gm: fx.GraphModule, record: Applied) -> None:
    """Each custom op node the trace made becomes ``FunctionApply(MyFn)(*args, **kwargs)`` with the
    call's own arguments (Note [autograd Functions run as themselves])."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.partitioner.autograd_function_apply.default:
            continue
        tensors, index = node.args
        entry = record.calls[index]
        node.target = FunctionApply(entry.cls)
        node.args, node.kwargs = entry.arguments(tensors)
        if entry.single:  # the trace's `outputs[0]`: the Function's own result is the tensor
            node.meta["val"] = node.meta["val"][0]
            for user in list(node.users):
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
    gm.recompile()
