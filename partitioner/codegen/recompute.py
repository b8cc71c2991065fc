"""Run the regions a plan recomputes under activation checkpointing.

``checkpoint_regions(gm, recomputed)`` (and ``checkpoint_attention_cores(gm)``, selective
recompute's finer unit) is a pass over one stage's GraphModule (partitioner/codegen/split.py).
Reads ``partitioner.region`` (ir.REGION) of every node (and ``partitioner.attention_core``);
writes no metadata. It rewrites the graph: every maximal run of consecutive nodes of one
recomputed region (or one attention core) moves into a graph of its own (a ``CheckpointedRun``),
and the stage's graph calls it through ``runtime.execute.recompute.checkpointed``. Codegen emits
each run as a method of the Stage class, named after its region (``recompute_block_0``), which
reads its parameters from ``self`` like the forward does.

Note [recompute keeps a region's inputs]: the cost model (partitioner/solver/evaluate.py, Note [cost
model]) charges a recomputed region its inputs instead of its saved activations, and its forward
once more in backward. One checkpoint per region keeps exactly that: a run saves only the tensors
it reads from outside (parameters are held anyway), and its backward recomputes one region at a
time, so the transient during a recompute is one region's activations, never a whole stage's. Two
consecutive recomputed regions therefore become two checkpoints, not one: merged, the first's
inputs would be all they keep, but the backward would rematerialize both at once.
Parameters stay registered under their original names on the stage module (runtime/execute/stage.py):
the run's method reads them through ``self``; they are not arguments of the checkpoint.
"""

from __future__ import annotations

import operator
import textwrap
from dataclasses import dataclass

import torch
import torch.fx as fx

from passes import ir
from partitioner.codegen.split import is_stage_device
from partitioner.inspect.units import human_bytes
from runtime.execute.recompute import checkpointed


@dataclass(frozen=True)
class MethodRef:
    """A method of the Stage class as an FX argument: FX codegen writes ``repr`` verbatim."""

    name: str

    def __repr__(self) -> str:
        return f"self.{self.name}"


@dataclass
class CheckpointedRun:
    """Consecutive nodes of one recomputed region, emitted as the Stage method ``name``."""

    name: str
    region: str
    graph: fx.Graph  # placeholders = inputs, get_attr = parameters, output = values read after the run
    inputs: list[str]
    outputs: list[str]
    kept_bytes: int  # bytes of its tensor inputs for one microbatch: what the checkpoint saves
    what: str = ""  # how the stage's docstrings name it: "Region block.0", "The attention core of region block.0"


def _is_send_copy(node: fx.Node) -> bool:
    # split_graph makes every sent tensor dense right before the output: not part of a region's work.
    return node.op == "call_method" and node.target == "contiguous" and all(u.op == "output" for u in node.users)


def _own_device(node: fx.Node) -> bool:
    """The stage's ``device`` node when it reads a parameter or buffer, which a region's method reads
    itself (else it is an input of the method, as any value from outside)."""
    return is_stage_device(node) and node.args[0].op == "get_attr"


def _region_of(node: fx.Node) -> str | None:
    if node.op not in ("call_function", "call_method", "call_module") or _is_send_copy(node) or is_stage_device(node):
        return None
    return ir.get(node, ir.REGION).name


def _runs(gm: fx.GraphModule, recomputed: set[str]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive compute nodes of one recomputed region; parameters (get_attr)
    sit at the top of a stage graph and never break a run."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" or is_stage_device(node):
            continue
        region = _region_of(node)
        if current and region != _region_of(current[0]):
            runs.append(current)
            current = []
        if region in recomputed:
            current.append(node)
    if current:
        runs.append(current)
    return runs


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _method_name(prefix: str, region: str, taken: set[str]) -> str:
    base = prefix + "".join(c if c.isalnum() else "_" for c in region)
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def checkpoint_regions(gm: fx.GraphModule, recomputed: set[str]) -> list[CheckpointedRun]:
    """Move each run of a region in ``recomputed`` (region names) into a CheckpointedRun and call
    it through runtime.execute.recompute.checkpointed. Returns the runs in graph order; the stage's graph
    is rebuilt in place (node names kept, so the emitted forward reads as before)."""
    return _checkpoint(gm, _runs(gm, recomputed), "recompute_", "Region {}")


def checkpoint_attention_cores(gm: fx.GraphModule) -> list[CheckpointedRun]:
    """Selective recompute: each attention core of the stage (Note [the attention core] in
    passes/attention_core.py, one contiguous run) as a CheckpointedRun, as ``checkpoint_regions``
    does a region; the rest of its region keeps its activations (Note [selective recompute] in
    partitioner/solver/recompute_cost.py)."""
    cores: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:  # nodes split made (the device, send copies) carry no tag
        core = ir.get(node, ir.ATTENTION).core_id if ir.has(node, ir.ATTENTION) else None
        if core is not None and _region_of(node) is not None:
            cores.setdefault(core, []).append(node)
    return _checkpoint(gm, list(cores.values()), "recompute_attention_", "The attention core of region {}")


def selective_paragraph(runs: list[CheckpointedRun]) -> list[str]:
    """The stage file's paragraph on selective recompute (Note [selective recompute] in
    partitioner/solver/recompute_cost.py); none without a run."""
    if not runs:
        return []
    return [""] + textwrap.wrap(
        f"Recomputed in backward (activation checkpointing through runtime.execute.recompute.checkpointed): "
        f"the attention core of {', '.join(run.region for run in runs)}, one checkpoint each. The compile "
        f"pinned it (--recompute selective): each core keeps its inputs ({human_bytes(sum(r.kept_bytes for r in runs))} "
        "per microbatch in all) instead of its scores, probabilities and dropout mask; the rest of "
        "every region keeps its activations.", width=96, break_on_hyphens=False)


def _checkpoint(gm: fx.GraphModule, runs: list[list[fx.Node]], prefix: str, what: str) -> list[CheckpointedRun]:
    runs = [run for run in runs if run and any(u not in run for n in run for u in n.users)]
    if not runs:
        return []
    in_run = {node: run for run in runs for node in run}
    taken: set[str] = set()
    result: list[CheckpointedRun] = []

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        run = in_run.get(node)
        if run is None:
            new = graph.node_copy(node, lambda n: env[n])
            new.meta = dict(node.meta)
            env[node] = new
            continue
        if node is not run[0]:
            continue  # emitted with the first node of its run
        members = set(run)
        inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes
                                    if a not in members and a.op != "get_attr" and not _own_device(a)))
        outputs = [n for n in run if any(u not in members for u in n.users)]
        region = _region_of(run[0])
        name = _method_name(prefix, region, taken)
        body = _run_graph(run, inputs, outputs)
        # One output keeps its name; several come back as a tuple named after the method.
        call = graph.create_node("call_function", checkpointed, (MethodRef(name), *[env[a] for a in inputs]),
                                 name=outputs[0].name if len(outputs) == 1 else name)
        call.meta = dict(outputs[0].meta) if len(outputs) == 1 else {
            "val": tuple(o.meta.get("val") for o in outputs), ir.REGION: run[0].meta[ir.REGION]}
        call.meta["stack_trace"] = None  # codegen writes the comment this call gets
        if len(outputs) == 1:
            env[outputs[0]] = call
        else:
            for i, out in enumerate(outputs):
                item = graph.create_node("call_function", operator.getitem, (call, i), name=out.name)
                item.meta = dict(out.meta)
                env[out] = item
        result.append(CheckpointedRun(name, region, body, [a.name for a in inputs], [o.name for o in outputs],
                                      sum(_nbytes(a) for a in inputs), what.format(region)))
    # Parameters (and the device) now read only inside a run's method are no longer the forward's business.
    for node in reversed(list(graph.nodes)):
        if (node.op == "get_attr" or is_stage_device(node)) and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.graph = graph
    gm.recompile()
    return result


def _run_graph(run: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in run:
        for arg in node.all_input_nodes:
            for state in [arg.args[0], arg] if _own_device(arg) else [arg]:
                if state.op == "get_attr" and state not in env:
                    env[state] = graph.get_attr(state.target)
                    env[state].meta = dict(state.meta)
    for node in run:  # the method reads the device itself (Note [tensors a stage makes] in partitioner/codegen/split.py)
        for arg in node.all_input_nodes:
            if _own_device(arg) and arg not in env:
                env[arg] = graph.node_copy(arg, lambda n: env[n])
                env[arg].meta = {}
    for node in run:
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta = dict(node.meta)
    result = [env[o] for o in outputs]
    graph.output(tuple(result) if len(result) > 1 else result[0])
    return graph
