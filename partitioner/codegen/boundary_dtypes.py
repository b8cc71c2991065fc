"""The dtype each value has under the program's autocast, so a stage boundary carries what the
unpartitioned model would have computed with.

Note [boundaries in the autocast dtype]: under bf16-/fp16-mixed a value's dtype is autocast's
choice, not the trace's. A boundary sent in the traced fp32 is an upcast the unpartitioned model
never does, and the next stage's numerics then depend on where the solver cut (``verify`` failed on a
2-stage cut of a 4-block MLP). So boundary dtypes are found by running the graph once on fake tensors
under the program's device autocast (CPU's and CUDA's op lists differ), entering CUDA autocast by its
thread state so no GPU is needed (``~t`` runs as ``bitwise_not``: ``__invert__`` opens a device guard).
The fake run skips ``_assert_tensor_metadata`` nodes as the stages do: they check the trace's fp32
example. Sends, receive buffers and gradients then move the autocast dtype, as the cost model counts.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from passes._fake_run import devices_to, get_module_attr
from partitioner.codegen.split import DROPPED_TARGETS, on_device
from runtime.execute import randomness
from runtime.program.parts import Precision


def _fake_like(value, device: torch.device):
    if not isinstance(value, torch.Tensor):
        return value
    shape = tuple(int(s) for s in value.shape)
    return torch.empty(shape, dtype=value.dtype, device=device)


def _dtype_name(value) -> str | None:
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None


class _AutocastState:
    """Autocast on for ``device_type`` in this thread, entered without torch.autocast's check that
    the device is present (Note [boundaries in the autocast dtype])."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type, self.dtype = device_type, dtype

    def __enter__(self):
        self.saved = (torch.is_autocast_enabled(self.device_type), torch.get_autocast_dtype(self.device_type))
        torch.set_autocast_enabled(self.device_type, True)
        torch.set_autocast_dtype(self.device_type, self.dtype)
        torch.autocast_increment_nesting()

    def __exit__(self, *exc):
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(self.device_type, self.saved[0])
        torch.set_autocast_dtype(self.device_type, self.saved[1])


# Ops CUDA autocast leaves alone (in none of its lists: they run in their input's dtype, cuDNN's
# batch norm on a bf16 input writes bf16) whose decompositions a torch without CUDA cannot run on
# fake CUDA tensors (a Python scalar times a tensor opens a CUDA device guard): run on fake CPU
# tensors outside autocast, which gives the same dtypes.
_IN_INPUT_DTYPE_ON_CUDA = {torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
                           torch.ops.aten._native_batch_norm_legit.default,
                           torch.ops.aten._native_batch_norm_legit_functional.default,
                           torch.ops.aten._native_batch_norm_legit_no_training.default}


def _on_cpu(target, args, kwargs, device: torch.device):
    """``target`` run on fake CPU copies of its tensors, its outputs back on ``device``."""
    cpu = torch.device("cpu")
    args, kwargs = tree_map(lambda v: _fake_like(v, cpu), devices_to((args, kwargs), cpu))
    return tree_map(lambda v: _fake_like(v, device), target(*args, **kwargs))


class _InvertWithoutDeviceGuard(TorchFunctionMode):
    """``~t`` as ``torch.bitwise_not(t)`` (Note [boundaries in the autocast dtype])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__invert__:
            return torch.bitwise_not(*args)
        return func(*args, **(kwargs or {}))


def autocast_dtypes(gm: fx.GraphModule, precision: Precision | str, device_type: str) -> dict[str, str]:
    """Node name -> the dtype of its tensor output under ``precision``'s autocast on
    ``device_type`` ("cpu" or "cuda"); empty under fp32 (every value keeps its traced dtype).
    A node the fake run cannot execute is refused with its name: sending it in a guessed dtype
    would train differently from the unpartitioned model."""
    precision = Precision.of(precision)
    compute = precision.autocast_dtype
    if compute is None:
        return {}
    # the device fake tensors are made on: "cuda" is cuda:0 (a device named in the graph must match it)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    env: dict[str, object] = {}
    out: dict[str, str] = {}
    # keyed random ops draw from a context (runtime/execute/randomness.py); any one does for a dtype
    context = randomness.Context(seed=0, step=0, first_sample=0, microbatch=0)
    with FakeTensorMode(allow_non_fake_inputs=True), _AutocastState(device_type, compute), torch.no_grad(), \
            randomness.restored(context), _InvertWithoutDeviceGuard():
        for node in gm.graph.nodes:
            if node.op == "output" or (node.op == "call_function" and node.target in DROPPED_TARGETS):
                continue
            if node.op == "placeholder":
                value = _fake_like(node.meta.get("val"), device)
            elif node.op == "get_attr":
                attr = get_module_attr(gm, node.target)
                value = _fake_like(attr, device) if isinstance(attr, torch.Tensor) else attr
            elif node.op == "call_function":
                # where the stage makes its tensors (Note [tensors a stage makes] in partitioner/codegen/split.py)
                args, kwargs = on_device(node, fx.node.map_arg(node.args, lambda n: env[n.name]),
                                         fx.node.map_arg(node.kwargs, lambda n: env[n.name]), device)
                try:
                    if device.type == "cuda" and node.target in _IN_INPUT_DTYPE_ON_CUDA:
                        value = _on_cpu(node.target, args, kwargs, device)
                    else:
                        value = node.target(*args, **kwargs)
                except Exception as error:
                    raise ValueError(
                        f"node {node.name!r} ({getattr(node.target, '__name__', node.target)}) could not be run "
                        f"under {precision} autocast on {device_type} to find the dtype it sends across a stage "
                        f"boundary ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}): "
                        "compile with --precision fp32") from None
            else:
                raise ValueError(f"node {node.name!r} is a {node.op} node, which an exported graph does not hold")
            env[node.name] = value
            name = _dtype_name(value)
            if name is not None:
                out[node.name] = name
    return out
