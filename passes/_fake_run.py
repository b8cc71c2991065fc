"""Run every node of a graph once, on fake tensors, one node at a time: the shared engine of the
flops and memory passes.

Note [one op at a time, on fake inputs]: for each call_function node we build fresh fake inputs
from the ``val`` metadata of its arguments (same shapes, strides and dtypes; ``requires_grad`` as
propagated from the parameters), run the op under ``FlopCounterMode`` and
``saved_tensors_hooks``, then run ``torch.autograd.grad`` from its outputs back to its inputs
under the same counter. That gives, per node and without touching real memory:

- forward and backward FLOPs (torch's own formulas, so they add up to what ``FlopCounterMode``
  counts on the real model);
- whether each output requires grad (an op is differentiable iff autograd gave its output a
  grad_fn; integer outputs and comparisons never do);
- which of its outputs alias an input (same storage: views, ``contiguous`` of a contiguous
  tensor, in-place ops), so a chain of views resolves to the node that owns the storage;
- what autograd saves, each saved tensor classified by storage: an input's (attributed to the
  node owning that storage), an output's (this node), or a tensor born inside the op (dropout
  masks, layer-norm statistics, attention log-sum-exp), whose bytes stay with this node.

Inputs are always fake *CPU* tensors, whatever device the model is on (``meta`` included): device
arguments inside the graph are rewritten to CPU. Ops therefore pick the CPU kernels (for SDPA the
CPU flash kernel, which saves q, k, v, the output and the log-sum-exp, like the CUDA flash kernel).
FlopCounterMode counts 0 FLOPs for that kernel; the flops pass replaces SDPA nodes by formula.
Each input takes the strides the simulated producer gave it (not ``val``'s, which on the meta
device come from meta kernels), so whether a reshape copies matches a real CPU run.

What an op does depends only on its target, its non-tensor arguments and its inputs' layouts and
requires-grad flags, so results are cached on exactly that key, relative to the op's input slots:
the 32 identical layers of a 7B Llama are simulated once (~0.5 s instead of ~10 s).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._subclasses import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

_CPU = torch.device("cpu")

# (node, output index): the node whose output owns a storage. None marks module state (parameters,
# buffers, constants), which is never an activation.
RootKey = tuple[fx.Node, int]


@dataclass
class NodeRun:
    fwd_flops: int = 0
    bwd_flops: int = 0
    # Per output position (tuple outputs: one per element; non-tensor elements: False / None).
    requires_grad: tuple[bool, ...] = ()
    roots: tuple[RootKey | None, ...] = ()
    # Storage bytes of the outputs this node owns (keyed by output index).
    storage_bytes: dict[int, int] = field(default_factory=dict)
    # Node outputs autograd keeps because of this node (resolved to their owners), and the bytes
    # of tensors it saves that are no node's output.
    saved_roots: set = field(default_factory=set)
    saved_internal_bytes: int = 0
    # (shape, stride, dtype) of each output as the simulation produced it (None: use ``val``).
    layouts: tuple = ()
    simulated: bool = True


def is_sdpa(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = node.target._schema.name  # e.g. "aten::scaled_dot_product_attention"
    return "scaled_dot_product" in name and "attention" in name and "backward" not in name


def get_module_attr(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def state_requires_grad(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A get_attr node requires grad iff it is a trainable nn.Parameter (buffers never do)."""
    try:
        value = get_module_attr(gm, node.target)
    except AttributeError:
        return False
    return isinstance(value, torch.nn.Parameter) and value.requires_grad


def output_list(value) -> list:
    """A node's value as a list of positions: a tensor is one position, a tuple/list one each."""
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def devices_to(value, device: torch.device):
    """``value`` (an op's arguments) with every torch.device in it replaced by ``device``."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(devices_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: devices_to(v, device) for k, v in value.items()}
    return value


def _to_cpu_device(value):
    return devices_to(value, _CPU)


def _concrete(size) -> tuple[int, ...]:
    return tuple(int(s) for s in size)


def run_nodes_on_fake(gm: fx.GraphModule, *, count_flops: bool = True,
                      record_saved: bool = True) -> dict[fx.Node, NodeRun]:
    """Run every node on fake tensors (Note [one op at a time, on fake inputs]); returns a NodeRun per node."""
    sims: dict[fx.Node, NodeRun] = {}
    failed: list[str] = []
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    counter = FlopCounterMode(display=False)
    grad_enabled = True
    cache: dict = {}  # identical ops are simulated once
    with fake_mode, counter, torch.enable_grad():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                vals = output_list(node.meta.get("val"))
                sims[node] = NodeRun(
                    requires_grad=tuple(False for _ in vals),
                    roots=tuple((node, i) if isinstance(v, torch.Tensor) else None for i, v in enumerate(vals)),
                    storage_bytes={i: v.numel() * v.element_size() for i, v in enumerate(vals)
                                   if isinstance(v, torch.Tensor)},
                )
            elif node.op == "get_attr":
                sims[node] = NodeRun(requires_grad=(state_requires_grad(gm, node),), roots=(None,))
            elif node.op == "output":
                sims[node] = NodeRun()
            elif node.op == "call_function" and node.target is operator.getitem:
                source, index = node.args[0], node.args[1]
                src = sims[source]
                ok = isinstance(index, int) and -len(src.roots) <= index < len(src.roots)
                sims[node] = NodeRun(
                    requires_grad=(src.requires_grad[index] if ok else False,),
                    roots=(src.roots[index] if ok else None,),
                    layouts=(src.layouts[index] if ok and index < len(src.layouts) else None,),
                )
            elif node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                grad_enabled = bool(node.args[0])
                sims[node] = NodeRun()
            elif node.op == "call_function":
                try:
                    with torch.set_grad_enabled(grad_enabled):
                        sims[node] = _run_node_on_fake(gm, node, sims, counter, count_flops, record_saved, cache)
                except Exception as exc:  # noqa: BLE001 - an op fake tensors cannot run costs nothing
                    failed.append(f"{node.name} ({node.target}): {type(exc).__name__}: {str(exc)[:120]}")
                    sims[node] = _fallback(node, sims)
            else:  # call_module / call_method (symbolic_trace graphs): not simulated
                failed.append(f"{node.name} ({node.op} {node.target})")
                sims[node] = _fallback(node, sims)
    if failed:
        warnings.warn(
            f"{len(failed)} node(s) could not run on fake tensors and are costed as 0 FLOPs / 0 saved "
            f"bytes: {failed[:3]}", stacklevel=3)
    return sims


def _fallback(node: fx.Node, sims: dict[fx.Node, NodeRun]) -> NodeRun:
    any_rg = any(any(sims[m].requires_grad) for m in node.all_input_nodes if m in sims)
    vals = output_list(node.meta.get("val"))
    return NodeRun(
        requires_grad=tuple(any_rg and isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals),
        roots=tuple((node, i) if isinstance(v, torch.Tensor) else None for i, v in enumerate(vals)),
        storage_bytes={i: v.numel() * v.element_size() for i, v in enumerate(vals) if isinstance(v, torch.Tensor)},
        simulated=False,
    )


@dataclass(frozen=True)
class _OpResult:
    """What one op did, relative to its input slots, so identical ops (the same layer repeated)
    are simulated once (Note [one op at a time, on fake inputs]).

    Aliases and saved tensors are ("in", slot), ("out", output index) or, for outputs with a new
    storage, ("new", storage bytes)."""

    fwd_flops: int
    bwd_flops: int
    requires_grad: tuple[bool, ...]
    aliases: tuple
    layouts: tuple
    saved: frozenset
    saved_internal_bytes: int


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _run_node_on_fake(gm, node, sims, counter, count_flops, record_saved, cache) -> NodeRun:
    slots: dict[tuple[fx.Node, int], int] = {}  # (source node, output index) -> input slot

    def val_of(source: fx.Node):
        val = source.meta.get("val")
        if val is None and source.op == "get_attr":
            val = get_module_attr(gm, source.target)
        return val

    def layout_of(source: fx.Node, index: int, val: torch.Tensor):
        src = sims[source]
        # Strides as the simulated producer made them (CPU kernels), not as ``val`` says: on the
        # meta device ``val`` has the meta kernels' strides, and whether a later reshape copies
        # (and what autograd saves) depends on them.
        layout = src.layouts[index] if index < len(src.layouts) else None
        shape, stride = layout[:2] if layout is not None else (_concrete(val.shape), _concrete(val.stride()))
        requires_grad = bool(index < len(src.requires_grad) and src.requires_grad[index]
                             and (val.dtype.is_floating_point or val.dtype.is_complex))
        return shape, stride, val.dtype, requires_grad

    def describe(source: fx.Node):
        val = val_of(source)

        def one(index, v):
            if not isinstance(v, torch.Tensor):
                return ("value", v if not isinstance(v, torch.nn.Module) else id(v))
            slot = slots.setdefault((source, index), len(slots))
            return ("tensor", slot) + layout_of(source, index, v)

        if isinstance(val, (list, tuple)):
            return ("seq", type(val).__name__, tuple(one(i, v) for i, v in enumerate(val)))
        return one(0, val)

    key = (node.target, _freeze(fx.node.map_arg(node.args, describe)),
           _freeze(fx.node.map_arg(node.kwargs, describe)), torch.is_grad_enabled(), count_flops, record_saved)
    try:
        result = cache.get(key)
    except TypeError:  # an unhashable argument: simulate without the cache
        key, result = None, None
    if result is None:
        result = _run_op(gm, node, slots, layout_of, val_of, counter, count_flops, record_saved)
        if key is not None:
            cache[key] = result

    slot_roots = {k: (sims[src].roots[i] if i < len(sims[src].roots) else None) for (src, i), k in slots.items()}
    sim = NodeRun(fwd_flops=result.fwd_flops, bwd_flops=result.bwd_flops,
                  requires_grad=result.requires_grad, layouts=result.layouts,
                  saved_internal_bytes=result.saved_internal_bytes)
    roots: list[RootKey | None] = []
    for j, alias in enumerate(result.aliases):
        if alias is None:
            roots.append(None)
        elif alias[0] == "in":
            roots.append(slot_roots[alias[1]])
        elif alias[0] == "out":
            roots.append(roots[alias[1]])
        else:
            roots.append((node, j))
            sim.storage_bytes[j] = alias[1]
    sim.roots = tuple(roots)
    for kind, where in result.saved:
        owner = slot_roots[where] if kind == "in" else roots[where]
        if owner is not None:  # None: module state, not an activation
            sim.saved_roots.add(owner)
    return sim


def _run_op(gm, node, slots, layout_of, val_of, counter, count_flops, record_saved) -> _OpResult:
    leaves: list[torch.Tensor] = []  # inputs that require grad, for autograd.grad
    by_storage: dict[int, tuple] = {}  # storage of each fresh input -> ("in", slot)
    made: dict[fx.Node, object] = {}

    def fake_input(source: fx.Node, index: int, val):
        if not isinstance(val, torch.Tensor):
            return _to_cpu_device(val)
        shape, stride, dtype, requires_grad = layout_of(source, index, val)
        t = torch.empty_strided(shape, stride, dtype=dtype, device=_CPU)
        if requires_grad:
            t.requires_grad_(True)
            leaves.append(t)
            t = t.clone()  # a non-leaf, so in-place ops are legal on it, as in the real graph
        by_storage[_storage_id(t)] = ("in", slots[(source, index)])
        return t

    def load(source: fx.Node):
        if source not in made:
            val = val_of(source)
            if isinstance(val, (list, tuple)):
                made[source] = type(val)(fake_input(source, i, v) for i, v in enumerate(val))
            else:
                made[source] = fake_input(source, 0, val)
        return made[source]

    args = _to_cpu_device(fx.node.map_arg(node.args, load))
    kwargs = _to_cpu_device(fx.node.map_arg(node.kwargs, load))

    saved: list[torch.Tensor] = []

    def pack(t):
        if record_saved:
            saved.append(t)
        return t

    before = counter.get_total_flops() if count_flops else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = node.target(*args, **kwargs)
    fwd = counter.get_total_flops() - before if count_flops else 0

    outs = output_list(out)
    requires_grad, aliases, layouts = [], [], []
    out_storage: dict[int, tuple] = {}
    for j, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            requires_grad.append(False)
            aliases.append(None)
            layouts.append(None)
            continue
        requires_grad.append(bool(o.requires_grad))
        layouts.append((tuple(o.shape), tuple(o.stride()), o.dtype))
        sid = _storage_id(o)
        if sid in by_storage:
            aliases.append(by_storage[sid])  # a view of (or the same tensor as) an input
        elif sid in out_storage:
            aliases.append(out_storage[sid])  # two outputs sharing one new storage
        else:
            aliases.append(("new", o.untyped_storage().nbytes()))
            out_storage[sid] = ("out", j)

    saved_refs: set = set()
    internal: set[int] = set()
    internal_bytes = 0
    for t in saved:
        sid = _storage_id(t)
        ref = by_storage.get(sid) or out_storage.get(sid)
        if ref is not None:
            saved_refs.add(ref)
        elif sid not in internal:
            internal.add(sid)
            internal_bytes += t.untyped_storage().nbytes()

    bwd = 0
    if count_flops and leaves:
        grad_outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if grad_outs:
            before = counter.get_total_flops()
            torch.autograd.grad(grad_outs, leaves, [torch.empty_like(o) for o in grad_outs], allow_unused=True)
            bwd = counter.get_total_flops() - before
    return _OpResult(fwd_flops=fwd, bwd_flops=bwd, requires_grad=tuple(requires_grad), aliases=tuple(aliases),
                     layouts=tuple(layouts), saved=frozenset(saved_refs), saved_internal_bytes=internal_bytes)
