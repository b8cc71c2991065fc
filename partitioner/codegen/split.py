"""Split a traced graph into one GraphModule per pipeline stage.

Note [stages talk only to their neighbours]: torch.distributed.pipelining sends activations from
stage k to stage k + 1 only. A tensor made on stage j and read on stage k > j + 1 (a skip
connection) is therefore an output of every stage from j to k − 1 and an input of every stage from
j + 1 to k: it is forwarded stage by stage, and the solver pays its bytes at every boundary it
crosses (docs/design.md §5). Parameters are never sent: each stage reads the parameters it uses
itself, by their original names, and a parameter used on two stages (a tied embedding) is held by
both, its gradients summed by the runtime. A buffer read on two stages is likewise held by both; it
is not a tie (nothing to sum), see Note [mutable buffers].

Note [mutable buffers]: torch.export (non-strict, training mode) keeps a buffer update as an
in-place op on the buffer's get_attr node: ``aten.add_(bn.num_batches_tracked, 1)``, and
``aten.batch_norm(x, w, b, bn.running_mean, bn.running_var, True, ...)``, which updates the running
statistics inside the kernel although its schema does not say so (``mutated_buffers`` knows these
ops by name). The stage holding the buffer runs that node on its own registered buffer, so the
update happens where the buffer lives, once per microbatch in microbatch order, as in the
unpartitioned model. A read after the update uses the update's result (export threads it through
the in-place node), an activation that crosses stages like any other; but every direct reader of
the buffer must be on the updating stage: a copy on another stage would never see the update, so
``check_mutable_buffers`` refuses such a plan. The stage file
lists these buffers in MUTABLE_BUFFERS; the runtime checkpoints them (runtime/resilience/checkpoint.py) and
keeps them equal across data-parallel replicas (Note [buffers across replicas] in runtime/execute/train.py).
A region recomputed in backward would run its updates a second time: recompute must leave such
regions out, or put the buffers back after the second forward.

Note [boundary names]: a tensor that leaves its stage (to the next stage, or to the loss) is named
for where it comes from, not for its op: ``blocks_1_out`` is what module ``blocks.1`` returns,
``blocks_1_attn_out`` what its attention returns. The module is the outermost one of the
producer's ``nn_module_stack`` that the value leaves (one of its readers is outside it). A value
that leaves no module (a cut inside one) is named for its module and the variable its source line
assigns (``blocks_1_attn_y`` for ``y = F.scaled_dot_product_attention(...)``, ``model_causal_mask``),
else its op (``blocks_1_attn_transpose``); outside every submodule, for the variable alone, else it
keeps its graph name, as the model's inputs do. Names follow the graph alone, in graph order, so
they are the same for every plan of the model and in every program folder; a second value with the
same name gets FX's suffix (``_1``). The stage files (INPUTS, OUTPUTS, the code), plan.json's
program and the plan's cut edges say the same name; node names inside a stage stay the trace's.

Note [tensors a stage makes]: the trace ran on the CPU or the meta device, so every device its
graph names (``arange(16, device=cpu)``, hf-llama's ``aten.to.device(inv_freq, cpu)``) is the
trace's, not the rank's. A stage makes its tensors where its own state lives: its graph opens with
``device = self.<first parameter>.device`` (else its first buffer, else its first input), and every
torch.device argument, and the missing device of a factory or a keyed ``randomness.rand``, becomes
that node. Reading the device from the state rather than running under ``with torch.device(...)``
costs one attribute read per forward instead of a TorchFunctionMode on every op (a GPU's eager step
is launch-bound), holds for any device the module is moved to, and on a tensor-parallel stage gives
DTensor's implicit replication device tensors (Note [tensor-parallel stages] in
runtime/parallel/tensor_parallel.py). tests/unit/test_gpu_stage_code.py runs GPU-kind stages on
``meta`` and fails on any tensor made elsewhere.
"""

from __future__ import annotations

import builtins
import inspect
import keyword
import operator
import os
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from passes import ir

# Export's asserts check one example's metadata (device included); they do nothing for training.
DROPPED_TARGETS = {torch.ops.aten._assert_tensor_metadata.default}


@dataclass(frozen=True)
class Value:
    """A tensor crossing a stage boundary, with its shape for one microbatch."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class StageGraph:
    index: int
    gm: fx.GraphModule
    inputs: list[Value]
    outputs: list[Value]
    params: list[str]  # trained parameters: original dotted names, in first-use order
    buffers: list[str]  # state read but not trained (buffers, lifted constants, frozen parameters)
    mutable_buffers: list[str] = field(default_factory=list)  # the buffers forward updates
    # Regions the plan recomputes, moved out of gm by partitioner.codegen.recompute.checkpoint_regions.
    checkpointed: list = field(default_factory=list)
    # Tensor parallelism: parameter -> (role, dim it is split on, global shape), for the ones split (tp > 1 only)
    tp_sharded: dict = field(default_factory=dict)


def _value(node: fx.Node, name: str | None = None, dtypes: dict[str, str] | None = None) -> Value:
    """``dtypes``: node name -> its dtype under the program's autocast (Note [boundaries in the
    autocast dtype] in partitioner/codegen/boundary_dtypes.py); the traced dtype otherwise."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(
            f"node {node.name!r} crosses a stage boundary but is not a tensor ({type(val).__name__}): "
            "keep it on one stage (merge its producer and consumers into one region)"
        )
    dtype = (dtypes or {}).get(node.name) or str(val.dtype)
    return Value(name or node.name, tuple(int(s) for s in val.shape), dtype)


def _is_trained(gm: fx.GraphModule, target: str) -> bool:
    prefix, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(prefix) if prefix else gm
    value = owner._parameters.get(leaf)
    return isinstance(value, torch.nn.Parameter) and value.requires_grad


# Ops that update running statistics (args 3 and 4) when their training flag (arg 5) is set,
# although their schemas do not mark the arguments as written (Note [mutable buffers]).
_RUNNING_STATS_OPS = {torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
                      torch.ops.aten.instance_norm.default, torch.ops.aten.cudnn_batch_norm.default,
                      torch.ops.aten.miopen_batch_norm.default}


def _written_args(node: fx.Node) -> list:
    """The arguments ``node`` writes in place."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    if target in _RUNNING_STATS_OPS:
        args = list(node.args) + [None] * 6
        return [args[3], args[4]] if args[5] else []
    written = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            written.append(value)
    return written


def _base_attr(value) -> fx.Node | None:
    """The get_attr node ``value`` is, or is a view of (through ops whose first argument aliases
    their output: view, reshape, select, slicing)."""
    while isinstance(value, fx.Node):
        if value.op == "get_attr":
            return value
        target = value.target
        if value.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return None
        first = target._schema.arguments[0] if target._schema.arguments else None
        returns = target._schema.returns
        if first is None or first.alias_info is None or not returns or returns[0].alias_info is None:
            return None
        value = value.args[0]
    return None


def mutated_buffers(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Buffer target -> the nodes that update it in place, in graph order (Note [mutable buffers])."""
    out: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        for value in _written_args(node):
            attr = _base_attr(value)
            if attr is not None:
                out.setdefault(attr.target, []).append(node.name)
    return out


def updating_regions(gm: fx.GraphModule) -> set[str]:
    """Names of the regions holding a node that updates a buffer in place (BatchNorm's running
    statistics).

    Note [recompute never updates twice]: recomputing such a region in backward would run its
    update a second time (running statistics counted twice per microbatch). The problem prices
    its recompute as saving nothing, so the solver, which pays the extra forward, never picks it,
    and lowering (partitioner/codegen/lower.py) does not checkpoint it even if a hand-made plan asks to."""
    updaters = {name for names in mutated_buffers(gm).values() for name in names}
    return {ir.get(n, ir.REGION).name for n in gm.graph.nodes if n.name in updaters}


def check_mutable_buffers(gm: fx.GraphModule, node_stage: dict[str, int]) -> None:
    """Every direct reader of a buffer the forward updates is on one stage (Note [mutable
    buffers]); raises ValueError naming the buffer, its stages and the fix."""
    node_stage = normalize_stages(gm, node_stage)
    mutated = mutated_buffers(gm)
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in mutated:
            continue
        readers = {u.name: node_stage[u.name] for u in node.users if u.name in node_stage}
        stages = sorted(set(readers.values()))
        if len(stages) > 1:
            where = ", ".join(f"{name} on stage {readers[name]}" for name in sorted(readers, key=readers.get))
            raise ValueError(
                f"buffer {node.target!r} is updated in place by {mutated[node.target]} and read on stages "
                f"{stages} ({where}): a copy on another stage would never see the update. Keep its "
                "readers in one region (compile with a coarser --granularity, e.g. block), or make the "
                "model read it in one module, or only after updating it (the updated value then "
                "travels to later stages as an activation)")


def _user_frames(stack_trace: str | None) -> str | None:
    """Keep the frames of the user's model: the generated comment then points at their source line."""
    if not stack_trace:
        return stack_trace
    lines = stack_trace.strip().split("\n")
    frames = [lines[i:i + 2] for i in range(0, len(lines) - 1, 2) if lines[i].lstrip().startswith("File ")]
    torch_dir = os.path.dirname(torch.__file__)
    outside_torch = [f for f in frames if torch_dir not in f[0]]
    user = [f for f in outside_torch if "site-packages" not in f[0]]
    # A model installed as a package (transformers) has no frame of the user's: its own frames,
    # not torch.nn's `return F.linear(...)`, say where the op comes from.
    return "\n".join(line for frame in (user or outside_torch or frames) for line in frame)


def _module_paths(node: fx.Node) -> list[str]:
    """The submodules ``node`` runs inside, outermost first (the root module left out)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _cls in stack.values() if path]


# Names a boundary value cannot have: Python's own, and the globals of a generated stage file.
_RESERVED = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {
    "self", "torch", "F", "operator", "math", "randomness", "checkpointed", "inf", "nan", "device", "NoneType"}
_ASSIGNMENT = re.compile(r"^\s*([A-Za-z_][A-Za-z_0-9]*)\s*(?::[^=]+)?=(?!=)")


def _source_line(node: fx.Node) -> tuple[str, str]:
    """(frame, code) of the model's source line ``node`` comes from, ("", "") if none."""
    lines = (_user_frames(node.meta.get("stack_trace")) or "").split("\n")
    return (lines[-2].strip(), lines[-1]) if len(lines) >= 2 else ("", "")


def _assigned_name(node: fx.Node) -> str | None:
    """The variable the model's source line assigns ``node`` to (``causal_mask = ...``): if the
    line assigns one name and ``node`` is what it assigns, the value read by other lines (the
    line's other ops only feed it)."""
    frame, code = _source_line(node)
    found = _ASSIGNMENT.match(code) if frame else None
    if found is None or all(_source_line(u)[0] == frame for u in node.users):
        return None
    return found.group(1)


def boundary_names(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> the name the value has when it crosses a stage boundary (Note [boundary
    names]), for every node of ``gm`` that produces a value; placeholders keep theirs."""
    taken = {n.name for n in gm.graph.nodes}
    used = set(_RESERVED)
    names: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        paths = _module_paths(node)
        readers = [set(_module_paths(u)) for u in node.users]
        left = next((p for p in paths if any(p not in r for r in readers)), None)
        if left is not None:
            base = f"{left}_out"
        elif paths:
            base = f"{paths[-1]}_{_assigned_name(node) or re.sub(r'_[0-9]+$', '', node.name)}"
        else:
            base = _assigned_name(node) or node.name
        base = re.sub(r"[^0-9a-zA-Z_]", "_", base)
        name, k = base, 0
        while name in used or (name in taken and name != node.name):
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        names[node.name] = name
    return names


def is_stage_device(node: fx.Node) -> bool:
    """Whether ``node`` is a stage's ``device = <its state>.device`` (Note [tensors a stage makes])."""
    return (node.op == "call_function" and node.target is builtins.getattr and len(node.args) == 2
            and node.args[1] == "device")


def _makes_tensor_from_nothing(node: fx.Node) -> bool:
    """A call that takes a ``device`` and reads no tensor (``arange``, ``zeros``, ``full``,
    ``scalar_tensor``, keyed ``randomness.rand``): without a device it would make its tensor on
    torch's default device."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        names = [a.name for a in target._schema.arguments]
    else:
        try:
            names = list(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            return False
    if "device" not in names:
        return False
    return not any(a.op == "get_attr" or isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def _has_device(value) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_device(v) for v in value)
    if isinstance(value, dict):
        return any(_has_device(v) for v in value.values())
    return False


def _needs_device(node: fx.Node) -> bool:
    return _has_device((node.args, node.kwargs)) or _makes_tensor_from_nothing(node)


def _replace_devices(value, device):
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_devices(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _replace_devices(v, device) for k, v in value.items()}
    return value


def on_device(node: fx.Node, args: tuple, kwargs: dict, device) -> tuple[tuple, dict]:
    """``node``'s arguments with every torch.device ``device`` (the stage's device node; the fake
    device of partitioner/codegen/boundary_dtypes.py), and ``device`` given to a factory that names
    none (Note [tensors a stage makes])."""
    args, kwargs = _replace_devices(args, device), _replace_devices(kwargs, device)
    if _makes_tensor_from_nothing(node):
        target = node.target
        names = ([a.name for a in target._schema.arguments] if isinstance(target, torch._ops.OpOverload)
                 else list(inspect.signature(target).parameters))
        if names.index("device") >= len(args) and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": device}
    return args, kwargs


def _device_node(graph: fx.Graph, env: dict[str, fx.Node], state: list[str], inputs: list[fx.Node],
                 nodes: list[fx.Node]) -> fx.Node | None:
    """The stage's ``device`` node, read from its first parameter or buffer, else its first input;
    None when no node of the stage makes a tensor or names a device (Note [tensors a stage makes])."""
    if not any(_needs_device(n) for n in nodes):
        return None
    attrs = {n.target: n for n in env.values() if n.op == "get_attr"}
    source = attrs[state[0]] if state else env[inputs[0].name] if inputs else None
    if source is None:
        raise ValueError(f"a stage makes tensors ({next(n.name for n in nodes if _needs_device(n))}) but holds no "
                         "state and takes no input to read its device from: merge it with a neighbouring stage")
    device = graph.create_node("call_function", builtins.getattr, (source, "device"), name="device")
    device.meta = {}
    return device


def normalize_stages(gm: fx.GraphModule, node_stage: dict[str, int]) -> dict[str, int]:
    """Put a tuple's ``getitem`` with its producer and parameters with their first reader.

    A tuple cannot cross a boundary, and a ``getitem`` costs nothing, so moving it next to its
    producer keeps every crossing value a tensor without changing what the solver priced.
    """
    stage = dict(node_stage)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            stage[node.name] = stage[node.args[0].name]
    return stage


def split_graph(gm: fx.GraphModule, node_stage: dict[str, int], num_stages: int,
                dtypes: dict[str, str] | None = None) -> list[StageGraph]:
    """One GraphModule per stage; ``dtypes``: the boundary values' dtypes when they are not the
    traced ones (``_value``)."""
    check_mutable_buffers(gm, node_stage)
    mutated = mutated_buffers(gm)
    node_stage = normalize_stages(gm, node_stage)
    nodes = [n for n in gm.graph.nodes if not (n.op == "call_function" and n.target in DROPPED_TARGETS)]
    compute = [n for n in nodes if n.op in ("placeholder", "call_function", "call_method", "call_module")]
    output_node = next(n for n in nodes if n.op == "output")

    def stage_of(node: fx.Node) -> int:
        if node.op == "placeholder":
            return 0
        if node.op == "output":
            return num_stages - 1
        return node_stage[node.name]

    # For each activation: the stage that makes it and the last stage that reads it.
    made_on = {n.name: stage_of(n) for n in compute}
    last_read = dict(made_on)
    for node in nodes:
        if node.op == "get_attr":
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" or arg.name not in made_on:
                continue
            reader = stage_of(node)
            if reader < made_on[arg.name]:
                raise ValueError(
                    f"node {node.name!r} on stage {reader} reads {arg.name!r} from the later stage "
                    f"{made_on[arg.name]}: the stage assignment must follow the graph's dependencies"
                )
            last_read[arg.name] = max(last_read[arg.name], reader)

    # Values that leave their stage are named for their producer (Note [boundary names]).
    leaving = ({n.name for n in compute if last_read[n.name] > made_on[n.name]}
               | {n.name for n in output_node.all_input_nodes})
    readable = boundary_names(gm)

    def name_of(node: fx.Node) -> str:
        return readable.get(node.name, node.name) if node.name in leaving else node.name

    stages: list[StageGraph] = []
    for index in range(num_stages):
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        inputs = ([n for n in compute if n.op == "placeholder"] if index == 0 else
                  [n for n in compute if made_on[n.name] < index <= last_read[n.name]])
        for node in inputs:
            env[node.name] = graph.placeholder(name_of(node))
            env[node.name].meta = dict(node.meta)
            assert env[node.name].name == name_of(node), (env[node.name].name, name_of(node))
        mine = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")
                and made_on.get(n.name) == index]
        # Parameters first, in first-use order: the stage file opens with the weights it holds.
        params: list[str] = []
        buffers: list[str] = []
        for node in mine:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr" and arg.name not in env:
                    env[arg.name] = graph.get_attr(arg.target)
                    env[arg.name].meta = dict(arg.meta)
                    (params if _is_trained(gm, arg.target) else buffers).append(arg.target)
        device = _device_node(graph, env, params + buffers, inputs, mine)
        for node in mine:
            new = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, lambda n: env[n.name]),
                                    fx.node.map_arg(node.kwargs, lambda n: env[n.name]), name_of(node), node.type)
            assert new.name == name_of(node), (new.name, name_of(node))
            new.meta = dict(node.meta)
            new.meta["stack_trace"] = _user_frames(node.meta.get("stack_trace"))
            if device is not None:  # Note [tensors a stage makes]
                new.args, new.kwargs = on_device(node, new.args, new.kwargs, device)
            env[node.name] = new
        if index == num_stages - 1:
            result = fx.node.map_arg(output_node.args[0], lambda n: env[n.name])
            if isinstance(result, (tuple, list)) and len(result) == 1:
                result = result[0]  # a single output goes to the loss as a tensor, not a 1-tuple
            outputs = [_value(n, name_of(n), dtypes) for n in output_node.all_input_nodes]
            graph.output(result)
        else:
            crossing = [n for n in compute if made_on[n.name] <= index < last_read[n.name]]
            outputs = [_value(n, name_of(n), dtypes) for n in crossing]
            # Sends need dense tensors (an expanded mask is a view); contiguous() is free when
            # the tensor already is.
            sent = []
            for n in crossing:
                dense = graph.call_method("contiguous", (env[n.name],))
                dense.meta = dict(env[n.name].meta)
                sent.append(dense)
            graph.output(tuple(sent) if len(sent) > 1 else sent[0] if sent else ())
        stage_gm = fx.GraphModule(gm, graph, class_name=f"Stage{index}")
        stages.append(StageGraph(index, stage_gm, [_value(n, name_of(n), dtypes) for n in inputs], outputs, params, buffers,
                                 [name for name in buffers if name in mutated]))
    return stages
