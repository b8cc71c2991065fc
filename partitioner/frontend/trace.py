"""The only file that calls torch.export or torch.fx.symbolic_trace.

Note [why export first]: ``torch.export.export(strict=False)`` traces Hugging Face transformers
5.x models (symbolic_trace does not), works on meta and fake tensors, and stamps every
call_function node with ``nn_module_stack``, which the regions pass groups by. symbolic_trace is
the fallback for models export rejects but plain FX can follow.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import os
import traceback
from dataclasses import dataclass

import torch
import torch.fx as fx

from partitioner.errors import TraceError
from partitioner.frontend.autograd_functions import applied, as_applies
from runtime.data.synthetic import holds_tensor


@dataclass
class Traced:
    """A traced model: parameters are ``get_attr`` nodes named by their original parameter names."""

    gm: fx.GraphModule
    tracer: str  # "export" or "symbolic_trace"
    example_args: tuple
    example_kwargs: dict


def check_signature(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Fail early, in the user's terms, when the example inputs do not fit ``model.forward``."""
    signature = inspect.signature(model.forward)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ValueError(
            f"example inputs do not fit {type(model).__name__}.forward{signature}: {exc} "
            f"(got {len(args)} positional and {sorted(kwargs) or 'no'} keyword inputs); "
            f"pass Workload(example_args=...) matching that signature"
        ) from None


def _user_frame(exc: BaseException) -> str:
    """The deepest frame outside torch and site-packages: where the untraceable construct is."""
    torch_dir = os.path.dirname(torch.__file__)
    found = ""
    while exc is not None:
        for frame in traceback.extract_tb(exc.__traceback__):
            if frame.filename.startswith(torch_dir) or "site-packages" in frame.filename:
                continue
            if frame.filename.endswith(("partitioner/frontend/trace.py",)):
                continue
            line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            found = f"{frame.filename}:{frame.lineno} `{line}`"
        exc = exc.__cause__ or exc.__context__
    return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _clean(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop export's input-guard call: it checks shapes of one example, not of every microbatch;
    and the inputs that hold no tensor, whose values export baked into the graph and only that
    guard read (Note [constant inputs] in runtime/data/synthetic.py: the program checks them per batch)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.eliminate_dead_code()
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and not node.users and not holds_tensor(node.meta.get("val")):
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


class _DropTorchRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "torch" or record.name.startswith("torch."))


@contextlib.contextmanager
def _torch_quiet():
    """Silence torch while tracing: a failed export logs warnings and prints its partial graph to
    stderr before raising, ahead of our one-line TraceError (which says what matters). Torch's log
    records are dropped at every handler they could reach, and sys.stderr is captured; both are
    restored afterwards."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [logger for name, logger in list(manager.loggerDict.items())
                                       if isinstance(logger, logging.Logger)
                                       and (name == "torch" or name.startswith("torch."))]
    handlers = {id(h): h for logger in loggers for h in logger.handlers}.values()
    drop = _DropTorchRecords()
    for handler in handlers:
        handler.addFilter(drop)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop)


# Note [custom autograd Functions]: a torch.autograd.Function runs as itself, one graph node calling
# its apply (Note [autograd Functions run as themselves] in partitioner/frontend/autograd_functions.py).
# Two of torch's own are refused instead, their arguments being a callable and hooks no stage file
# can write: torch.utils.checkpoint's reentrant CheckpointFunction (the trace runs its forward under
# no_grad: the parameters inside would get no gradient) and a module's backward hook; and so is
# every Function of a model only symbolic_trace follows (its Proxy arguments reach no kernel).


def _refuse_autograd_functions(model: torch.nn.Module, seen: dict) -> None:
    name, where = next(iter(seen.items()))
    others = f" (and {len(seen) - 1} more: {', '.join(list(seen)[1:4])})" if len(seen) > 1 else ""
    if name == "torch.utils.checkpoint.CheckpointFunction":
        fix = ("call torch.utils.checkpoint with use_reentrant=False, or drop it: the plan recomputes "
               "regions itself where memory needs it")
    elif name == "torch.nn.modules._functions.BackwardHookFunction":
        fix = ("remove the module's backward hook (register_full_backward_hook / register_full_backward_pre_hook): "
               "the program runs the traced graph, which calls no hooks")
    else:
        fix = ("rewrite it as a torch.library.custom_op with register_autograd, in the model file or a module "
               "(the files travel with the program: Note [custom ops travel]), or remove it")
    raise TraceError(
        f"{type(model).__name__} uses the custom autograd Function {name}"
        + (f" at {where}" if where else "") + others
        + ": the traced graph keeps its forward and drops its backward, so the program would train a "
        f"different model. Fix: {fix}")


def trace(model: torch.nn.Module, example_args: tuple, example_kwargs: dict | None = None) -> Traced:
    example_kwargs = dict(example_kwargs or {})
    check_signature(model, example_args, example_kwargs)
    with _torch_quiet(), applied() as record:
        try:
            traced = _trace(model, example_args, example_kwargs)
        except TraceError:
            if record.refusal is None:
                raise
            traced = None
    if record.refusal is not None:  # raised inside export, which buried it under its own error
        raise record.refusal
    if record.refused:
        _refuse_autograd_functions(model, record.refused)
    if traced.tracer == "export":
        as_applies(traced.gm, record)
    return traced


def _trace(model: torch.nn.Module, example_args: tuple, example_kwargs: dict) -> Traced:
    try:
        exported = torch.export.export(model, example_args, example_kwargs, strict=False)
        return Traced(_clean(exported.module()), "export", example_args, example_kwargs)
    except Exception as export_exc:  # noqa: BLE001 - every failure goes into the TraceError below
        export_error = export_exc
    try:
        if example_kwargs:
            raise TypeError("symbolic_trace takes no keyword example inputs")
        gm = fx.symbolic_trace(model)
        return Traced(gm, "symbolic_trace", example_args, example_kwargs)
    except Exception as fx_exc:  # noqa: BLE001
        fx_error = fx_exc
    where = _user_frame(export_error) or _user_frame(fx_error)
    raise TraceError(
        f"cannot trace {type(model).__name__}"
        + (f": the construct at {where} " if where else " ")
        + "depends on tensor values (data-dependent Python control flow) or is otherwise untraceable. "
        f"torch.export said: {_first_line(export_error)} | symbolic_trace said: {_first_line(fx_error)}. "
        "Fix: replace value-dependent `if`/loops with torch.where or torch.cond, or move them out of forward."
    )
