"""stage_<k>.py: a stage's forward as Python a person reads.

Note [stage code]: a small emitter over the stage's graph (_Emitter) writes the file, not torch.fx's
``python_code`` (a debugging dump: alias lines, ``;  x = None``, absolute paths; patterns over it
break with torch's format). One statement per node, in graph order: state read where it is used
(``self.blocks[0].ln_1.weight``: runtime/execute/stage.py's containers index); a tuple unpacked in
one statement; calls as a person writes them where that is the same call (Note [exact spellings]
in partitioner/codegen/spelling.py), else as the aten op; keyed random ops as ``randomness.*``,
recomputed regions as ``checkpointed(self.recompute_<region>, ...)``. Each run of statements from
one source line gets one comment: the innermost module and ``file:line: code``, the file named by
its import path (_SourcePaths), so the bytes do not depend on where the checkout lives. Inputs
and outputs carry shapes and where they come from (Note [boundary names] in partitioner/codegen/split.py).
A ``del`` after a region's last statement frees what no later statement reads: a gpt:layers=8 stage
peaked at 4.31 MB with FX's per-value deletions, 4.34 MB so, 4.60 MB with none, gradients identical.
"""

from __future__ import annotations

import builtins
import functools
import json
import math
import operator
import os
import re
import sys
import textwrap
from pathlib import Path

import torch
import torch.fx as fx
from torch._library.custom_ops import OPDEFS
from torch.fx.graph import dtype_abbrs, magic_methods
from torch.fx.node import _get_qualified_name

from passes import ir
from partitioner.codegen.recompute import MethodRef, selective_paragraph
from partitioner.codegen.spelling import FUNCTIONAL, attribute as _attribute, dropped_input, is_tensor, spelled
from partitioner.codegen.split import StageGraph, is_stage_device
from partitioner.frontend.autograd_functions import FunctionApply
from partitioner.inspect.units import human_bytes
from partitioner.solver.plan import Plan
from runtime.execute.recompute import checkpointed


# Op namespaces torch itself registers: a stage calling them needs only `import torch`.
_TORCH_NAMESPACES = {"aten", "prims", "prim", "quantized", "_quantized", "c10d", "c10d_functional",
                     "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "higher_order",
                     "profiler", "rngprims", "inductor", "debugprims", "mkldnn", "mkl", "onednn"}


def custom_ops(*graphs: fx.Graph) -> dict[str, tuple]:
    """{"ns::op": (namespace, the first node calling it, the function its torch.library.custom_op
    definition wraps, or None)} for every op ``graphs`` call outside torch's own namespaces.

    Note [custom ops travel]: an op such as ``torch.ops.transformers.grouped_mm_fallback`` (the
    MoE kernel of Hugging Face transformers) exists only once the module that defines it has run,
    and a torchrun worker imports nothing but the stage file. The stage file therefore imports,
    for each such op, the module its ``torch.library.custom_op`` definition lives in: an installed
    module by its name; a file of the user's (the model file itself, a sibling it imports) travels
    into DIR/user/ and is imported from there by its module name, so the op is registered on every
    rank (``op_sources`` in partitioner/frontend/user_source.py, Note [one user root] in
    runtime/program/user_code.py); else the package named like the namespace. An op with none is refused
    at compile time. Lowering decides each import (``UserSources.op_imports``) before any file is
    written; ``op_modules`` reads them per stage."""
    ops: dict[str, tuple] = {}
    for node in (n for graph in graphs for n in graph.nodes):
        target = node.target
        if isinstance(target, FunctionApply):  # its module, imported the same way
            ops.setdefault(target.key, (None, node.name, target.function))
        namespace = getattr(target, "namespace", None)
        if node.op != "call_function" or namespace is None or namespace in _TORCH_NAMESPACES:
            continue
        qualname = target.name().split(".")[0]  # "ns::op" (the overload is not part of the key)
        if qualname not in ops:
            ops[qualname] = (namespace, node.name, getattr(OPDEFS.get(qualname), "_init_fn", None))
    return ops


def op_modules(*graphs: fx.Graph, imports: dict[str, str]) -> list[str]:
    """The modules a stage file imports so that every custom op ``graphs`` call is registered
    (Note [custom ops travel]); ``imports``: lowering's "ns::op" -> module."""
    return sorted({imports[qualname] for qualname in custom_ops(*graphs)})


def stage_source(stage: StageGraph, plan_hash: str, plan: Plan, op_imports: dict[str, str] | None = None) -> str:
    """stage_<k>.py: the stage's forward as Python a person reads (Note [stage code]);
    ``op_imports``: the module to import per custom op or autograd Function (Note [custom ops travel])."""
    custom_op_imports = [f"import {m}  # its torch.ops or autograd Functions (Note [custom ops travel])"
                         for m in op_modules(stage.gm.graph, *(run.graph for run in stage.checkpointed),
                                             imports=op_imports or {})]
    emitter = _Emitter(_SourcePaths(), op_imports or {})
    last = stage.index == plan.num_stages - 1
    came_from = "the model's input" if stage.index == 0 else f"from stage {stage.index - 1}"
    goes_to = "to the loss" if last else f"to stage {stage.index + 1}"
    body = emitter.function(
        stage.gm.graph, "forward",
        inputs={v.name: f"{_shape(v.dtype, v.shape)}, {came_from}" for v in stage.inputs},
        outputs=[f"{v.name}: {_shape(v.dtype, v.shape)}, {goes_to}" for v in stage.outputs], free=True)
    for run in stage.checkpointed:
        body += [""] + emitter.function(
            run.graph, run.name,
            doc=[f'"""{run.what} (through runtime.execute.recompute.checkpointed): its activations are dropped',
                 'after the forward and recomputed in backward."""'])
    names = plan.stages[stage.index].region_names
    lines = [
        f'"""Stage {stage.index} of {plan.num_stages}: {", ".join(names)}.',
        "",
        f"Generated by partitioner from plan {plan_hash} for {plan.workload}.",
        "The forward below is the traced model's code for this stage, one statement per op; comments",
        "point at the model's source lines. Do not edit: the runtime checks every file against the",
        "sha256 listed in plan.json.",
        *_recompute_paragraph(stage, plan),
        '"""',
        *emitter.import_lines(custom_op_imports),
        "",
        f"PARAMETERS = {json.dumps(stage.params, indent=4)}",
        f"BUFFERS = {json.dumps(stage.buffers, indent=4)}  # held, never trained",
        "# Updated in place by forward (running statistics): checkpointed, and kept equal across",
        "# data-parallel replicas (Note [mutable buffers] in partitioner/codegen/split.py).",
        f"MUTABLE_BUFFERS = {json.dumps(stage.mutable_buffers, indent=4)}",
        *_tensor_parallel_table(stage, plan),
        f"INPUTS = {json.dumps([v.name for v in stage.inputs])}",
        f"OUTPUTS = {json.dumps([v.name for v in stage.outputs])}",
        "",
        "",
        f"class Stage{stage.index}(torch.nn.Module):",
        '    """Holds no parameters of its own: runtime.execute.stage registers PARAMETERS under their original names."""',
        "",
        *[("    " + line) if line else "" for line in body],
        "",
    ]
    return "\n".join(line.rstrip() for line in lines)


def _tensor_parallel_table(stage: StageGraph, plan: Plan) -> list[str]:
    """TENSOR_PARALLEL: which parameters the tensor group splits and on which dimension, with a
    readable table; nothing at tp 1 (Note [tensor-parallel stages] in runtime/parallel/tensor_parallel.py)."""
    tp = plan.tensor_parallel
    if tp == 1:
        return []
    lines = [f"# Tensor parallelism: this stage runs on a tensor group of {tp} ranks (Note [tensor-parallel",
             "# stages] in runtime/parallel/tensor_parallel.py). Each parameter listed is a DTensor split on that",
             f"# dimension (each rank holds 1/{tp}: Note [tensor-parallel roles] in passes/tp_roles.py);",
             "# every other parameter is whole on every rank. The forward below keeps the global shapes;",
             "# DTensor runs it on the shards and adds the all-reduces / all-gathers.",
             "#   parameter | role | split dim | global shape -> per rank"]
    entries = []
    for name in stage.params:
        if name not in stage.tp_sharded:
            continue
        role, dim, shape = stage.tp_sharded[name]
        shape = list(shape)
        local = list(shape)
        if local:
            local[dim] //= tp
        lines.append(f"#   {name} | {role}-parallel | {dim} | {shape} -> {local}")
        entries.append(f'    "{name}": {dim},')
    return lines + (["TENSOR_PARALLEL = {", *entries, "}"] if entries else ["TENSOR_PARALLEL = {}"])


def _recompute_paragraph(stage: StageGraph, plan: Plan) -> list[str]:
    """Which regions this stage recomputes and why, with the plan's figures
    (Note [recompute keeps a region's inputs] in partitioner/codegen/recompute.py)."""
    if not stage.checkpointed or plan.training.recompute == "selective":  # recompute.selective_paragraph
        return selective_paragraph(stage.checkpointed)

    sp = plan.stages[stage.index]
    regions = list(dict.fromkeys(run.region for run in stage.checkpointed))
    saved_per_sample = sum(r.activation_bytes for r in plan.regions if r.name in regions)
    kept = sum(run.kept_bytes for run in stage.checkpointed)
    in_flight = plan.pipeline_schedule.in_flight(stage.index, plan.num_stages, plan.num_microbatches)
    extra = max(0, in_flight * (plan.microbatch_size * saved_per_sample - kept))
    # Note [recompute a user pins] in partitioner/solver/recompute_cost.py: the reason is the flag then
    why = ("The compile pinned it (--recompute full: every region whose recompute saves memory)"
           if plan.training.recompute == "full" else "The plan chose it because memory binds on this stage's device")
    return [""] + textwrap.wrap(
        f"Recomputed in backward (activation checkpointing through runtime.execute.recompute.checkpointed, one "
        f"checkpoint per region): {', '.join(regions)}. {why} ({sp.device}): predicted peak {human_bytes(sp.peak_memory_bytes)} with recompute, "
        f"capacity {human_bytes(sp.memory_capacity_bytes)}; keeping these regions' activations "
        f"({human_bytes(saved_per_sample)} per sample) instead of their inputs ({human_bytes(kept)} per "
        f"microbatch) for the {in_flight} microbatch(es) in flight would need about "
        f"{human_bytes(sp.peak_memory_bytes + extra)}.", width=96, break_on_hyphens=False)


def _shape(dtype, shape) -> str:
    dtype = getattr(torch, str(dtype).removeprefix("torch."), dtype) if isinstance(dtype, str) else dtype
    return f"{dtype_abbrs.get(dtype, str(dtype))}[{', '.join(str(int(s)) for s in shape)}]"


class _SourcePaths:
    """Where a source line lives, said the same way in every checkout (Note [stage code]).

    A file that is an imported module is named by its import path (``partitioner/models/builtin.py``,
    ``transformers/models/gpt2/modeling_gpt2.py``): independent of where the checkout or the
    environment lives, and what a reader finds the file by. A file inside site-packages that no
    module names is its path below site-packages; any other file is its bare name."""

    def __init__(self):
        self._by_file: dict[str, str] = {}
        # A file imported under two names (`models` and `partitioner.models.builtin`) takes the fuller one.
        for name, module in sorted(list(sys.modules.items()), key=lambda item: (-item[0].count("."), item[0])):
            file = getattr(module, "__file__", None)
            if not file or name == "__main__" or not file.endswith(".py"):
                continue
            package = os.path.basename(file) == "__init__.py"
            path = name.replace(".", "/") + ("/__init__.py" if package else ".py")
            if os.path.basename(path) == os.path.basename(file):
                self._by_file.setdefault(_realpath(file), path)

    def __call__(self, file: str) -> str:
        found = self._by_file.get(os.path.realpath(file))
        if found is not None:
            return found
        parts = Path(file).parts
        for i in range(len(parts) - 1, -1, -1):
            if parts[i] in ("site-packages", "dist-packages"):
                return "/".join(parts[i + 1:])
        return Path(file).name


@functools.lru_cache(maxsize=None)
def _realpath(file: str) -> str:
    """os.path.realpath, once per module file a process has: every stage of a 32-stage program
    maps the same ~2,700 modules (a symlink walk each, 5 s of a 16,384-device compile)."""
    return os.path.realpath(file)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n\s*(?P<code>[^\n]*)')


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _cls in stack.values() if path]
    return paths[-1] if paths else ""


def _common_module(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _is_send_copy(node: fx.Node) -> bool:
    # split_graph makes every sent tensor dense right before the output (a send needs it).
    return node.op == "call_method" and node.target == "contiguous" and all(u.op == "output" for u in node.users)


def _unpacked(node: fx.Node) -> list[fx.Node] | None:
    """The getitem readers of a tuple ``node``, by index, when they can be one unpacking
    statement (``q, k, v = torch.ops.aten.split.Tensor(...)``); None otherwise."""
    val = node.meta.get("val")
    if not node.users or not isinstance(val, (tuple, list)):
        return None
    items: dict[int, fx.Node] = {}
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
                and 0 <= user.args[1] < len(val) and user.args[1] not in items):
            return None
        items[user.args[1]] = user
    return [items.get(i) for i in range(len(val))]


def _readers(node: fx.Node, aliases: dict) -> list[fx.Node]:
    """Who reads ``node``, looking through the nodes written as another's name (``aliases``)."""
    return [r for u in node.users for r in (_readers(u, aliases) if u in aliases else [u])]


def _frees_at_region_ends(statements: list[fx.Node], unpacked_by: dict, aliases: dict) -> dict[fx.Node, list[str]]:
    """Statement that ends a region -> the names bound so far that no later statement reads
    (Note [stage code]: what a stage's forward frees)."""
    items_of: dict[fx.Node, list[fx.Node]] = {}
    for item, producer in unpacked_by.items():
        items_of.setdefault(producer, []).append(item)
    # A tuple unpacked in its statement is never bound itself: its items are.
    bound = [item for node in statements for item in (items_of[node] if node in items_of else [node])
             if not is_stage_device(item)]  # a torch.device, read to the end: no tensor to free
    position = {node: i for i, node in enumerate(statements)}
    position.update({item: position[p] for item, p in unpacked_by.items()})
    last_read = {}
    for node in bound:
        readers = [position.get(u, len(statements)) for u in _readers(node, aliases)]
        last_read[node] = max(readers, default=position[node])
    frees: dict[fx.Node, list[str]] = {}
    freed: set[fx.Node] = set()
    for i, node in enumerate(statements[:-1]):
        region = _region_name(node)
        if region is None or _region_name(statements[i + 1]) in (None, region):
            continue
        dead = [b for b in bound if position[b] <= i and last_read[b] <= i and b not in freed]
        freed.update(dead)
        if dead:
            frees[node] = [b.name for b in dead]
    return frees


def _chunks(names: list[str], *, width: int) -> list[list[str]]:
    out: list[list[str]] = []
    for name in names:
        if out and len(", ".join(out[-1] + [name])) <= width:
            out[-1].append(name)
        else:
            out.append([name])
    return out


def _region_name(node: fx.Node) -> str | None:
    region = node.meta.get(ir.REGION)
    return region.name if region is not None else None


class _Emitter:
    """One stage graph (or a recomputed region's) as a Python function: one statement per node,
    parameters read where they are used, source lines as comments (Note [stage code])."""

    def __init__(self, paths: _SourcePaths, op_imports: dict[str, str]):
        self.paths, self.op_imports = paths, op_imports
        self.imports: set[str] = {"import torch"}

    def function(self, graph: fx.Graph, name: str, *, doc: list[str] = (), inputs: dict[str, str] | None = None,
                 outputs: list[str] = (), free: bool = False) -> list[str]:
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        expr: dict[fx.Node, str] = {}
        for node in nodes:
            if node.op == "placeholder":
                expr[node] = node.name
            elif node.op == "get_attr":
                expr[node] = _attribute("self", node.target)
            elif node.op != "output":  # FX calls the device node device_1 (its own code's global is `device`)
                expr[node] = "device" if is_stage_device(node) else node.name
        lines = [f"def {name}(self{''.join(', ' + n.name for n in placeholders)}):"]
        lines += ["    " + line for line in doc]
        for node in placeholders:
            if inputs and inputs.get(node.name):
                lines.append(f"    # {node.name}: {inputs[node.name]}")
        unpacked_by, aliases = {}, {}
        statements = []
        for node in nodes:
            if node.op in ("placeholder", "get_attr", "output") or node in unpacked_by:
                continue
            if _is_send_copy(node):
                expr[node] = f"{self._arg(node.args[0], expr)}.contiguous()"
                continue
            same = dropped_input(node.target, node.args, node.kwargs) if node.op == "call_function" else None
            if same is not None:  # a dropout that draws nothing (Note [exact spellings] in its module)
                expr[node], aliases[node] = self._arg(same, expr), same
                continue
            items = _unpacked(node)
            for item in items or ():
                if item is not None:
                    unpacked_by[item] = node
            statements.append((node, items))
        # Consecutive statements from one source line share one comment, which names the
        # innermost module they all run in (`linear` of `self.qkv(x).split(...)` is in
        # blocks.0.attn.qkv, the split in blocks.0.attn: the line is blocks.0.attn's).
        groups: list[list] = []
        for statement in statements:
            location = self._location(statement[0])
            key = (location, None if location else _module_path(statement[0]))
            if not groups or key != groups[-1][0]:
                groups.append([key, []])
            groups[-1][1].append(statement)
        output = next(n for n in nodes if n.op == "output")
        frees = _frees_at_region_ends([node for node, _ in statements], unpacked_by, aliases) if free else {}
        for key, members in groups:
            if len(lines) > 1:
                lines.append("")
            comment = self._comment(key[0], [node for node, _ in members])
            if comment:
                lines.append(f"    # {comment}")
            for node, items in members:
                lines.append(self._statement(node, items, expr))
                for names in _chunks(frees.get(node, []), width=92):
                    lines.append(f"    del {', '.join(names)}")
        lines.append("")
        lines += [f"    # {line}" for line in outputs]
        if any(_is_send_copy(n) for n in output.all_input_nodes):
            lines.append("    # .contiguous(): a send needs a dense tensor (free when it already is)")
        result = output.args[0]
        line = f"    return {self._arg(result, expr)}"
        if len(line) > 100 and isinstance(result, (tuple, list)) and len(result) > 1:
            lines += ["    return (", *(f"        {self._arg(r, expr)}," for r in result), "    )"]
        else:
            lines.append(line)
        return lines

    def import_lines(self, custom_op_imports: list[str]) -> list[str]:
        """Standard library, torch, the modules registering custom ops, runtime: in that order."""
        stdlib = sorted(line for line in self.imports if line.split()[1] in ("math", "operator"))
        runtime = sorted(line for line in self.imports if line.split()[1].startswith("runtime"))
        return stdlib + ["import torch", *sorted(self.imports & {FUNCTIONAL})] + custom_op_imports + runtime

    def _statement(self, node: fx.Node, items, expr) -> str:
        if items is not None:
            target = ", ".join(item.name if item is not None else "_" for item in items)
            target += "," if len(items) == 1 else ""
        else:
            target = expr[node]
        return f"    {target} = {self._call(node, expr)}"

    def _location(self, node: fx.Node) -> tuple[str, str] | None:
        """(file:line, code) of the model's source line ``node`` comes from."""
        frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
        if not frames:
            return None
        frame = frames[-1]
        return f"{self.paths(frame['file'])}:{frame['line']}", frame["code"].strip()

    def _comment(self, location, nodes: list[fx.Node]) -> str:
        first = nodes[0]
        if first.op == "call_function" and first.target is checkpointed:
            run = first.args[0]
            return f"region {ir.get(first, ir.REGION).name}: recomputed in backward; its forward is {run.name} below"
        if is_stage_device(first):
            return "the tensors made below go where this stage runs (Note [tensors a stage makes] in partitioner/codegen/split.py)"
        module = _common_module([_module_path(n) for n in nodes])
        if location is None:
            return module
        where, code = location
        return f"{module} ({where}): {code}" if module else f"{where}: {code}"

    def _call(self, node: fx.Node, expr) -> str:
        args = [self._arg(a, expr) for a in node.args]
        args += [f"{k}={self._arg(v, expr)}" for k, v in node.kwargs.items()]
        if node.op == "call_method":
            return f"{args[0]}.{node.target}({', '.join(args[1:])})"
        if node.op == "call_module":
            return f"{_attribute('self', node.target)}({', '.join(args)})"
        target = node.target
        if target is builtins.getattr and len(args) == 2 and str(node.args[1]).isidentifier():
            return f"{args[0]}.{node.args[1]}"
        if getattr(target, "__module__", None) == "_operator" and target.__name__ in magic_methods and not node.kwargs:
            return magic_methods[target.__name__].format(*args)
        found = spelled(target, node.args, node.kwargs, lambda a: self._arg(a, expr), is_tensor)
        if found is not None:  # Note [exact spellings] in partitioner/codegen/spelling.py
            self.imports.update([FUNCTIONAL] if found[1] else [])
            return found[0]
        return f"{self._callee(target)}({', '.join(args)})"

    def _callee(self, target) -> str:
        if target is checkpointed:
            self.imports.add("from runtime.execute.recompute import checkpointed")
            return "checkpointed"
        if getattr(target, "__module__", None) == "runtime.execute.randomness":
            # Keyed random ops (Note [randomness keyed by meaning] in runtime/execute/randomness.py).
            self.imports.add("from runtime.execute import randomness")
            return f"randomness.{target.__name__}"
        if getattr(target, "__module__", None) == "runtime.parallel.tensor_parallel":
            # Note [tensor-parallel stages] in runtime/parallel/tensor_parallel.py
            self.imports.add("from runtime.parallel import tensor_parallel")
            return f"tensor_parallel.{target.__name__}"
        if isinstance(target, FunctionApply):  # Note [autograd Functions run as themselves] in its module
            return f"{self.op_imports[target.key]}.{target.function.__qualname__}.apply"
        qualified = _get_qualified_name(target)
        if qualified.startswith("torch.") or qualified in dir(builtins):
            return qualified
        if qualified.startswith(("_operator.", "math.")):
            module, _, leaf = qualified.lstrip("_").partition(".")
            self.imports.add(f"import {module}")
            return f"{module}.{leaf}"
        raise ValueError(f"a stage calls {qualified}, which a generated file cannot import")

    def _arg(self, arg, expr) -> str:
        if isinstance(arg, fx.Node):
            return expr[arg]
        if isinstance(arg, tuple):
            inner = [self._arg(a, expr) for a in arg]
            return f"({inner[0]},)" if len(inner) == 1 else f"({', '.join(inner)})"
        if isinstance(arg, list):
            return f"[{', '.join(self._arg(a, expr) for a in arg)}]"
        if isinstance(arg, dict):
            return "{" + ", ".join(f"{self._arg(k, expr)}: {self._arg(v, expr)}" for k, v in arg.items()) + "}"
        if isinstance(arg, slice):
            return f"slice({self._arg(arg.start, expr)}, {self._arg(arg.stop, expr)}, {self._arg(arg.step, expr)})"
        if isinstance(arg, float) and not math.isfinite(arg):
            return f'float("{arg}")'
        if isinstance(arg, (torch.dtype, torch.memory_format, torch.layout)):
            return str(arg)
        if isinstance(arg, torch.device):
            return f"torch.device({str(arg)!r})"
        if isinstance(arg, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return _get_qualified_name(arg)
        if isinstance(arg, MethodRef):
            return repr(arg)
        if arg is None or isinstance(arg, (bool, int, float, complex, str)) or arg is Ellipsis:
            return repr(arg)
        raise ValueError(f"a stage passes {arg!r} ({type(arg).__name__}), which a generated file cannot write")
