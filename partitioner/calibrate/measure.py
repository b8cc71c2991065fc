"""Run every region, and every distinct op alone, on this machine and time it (Note [measuring a
region] in partitioner/calibrate/__init__.py)."""

from __future__ import annotations

import dataclasses
import operator
import statistics
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from passes import ir
from partitioner.calibrate.features import VIEW_OPS, op_name, requires_grad_nodes, group_features
from partitioner.calibrate.recompute_cost import time_checkpointed
from runtime.data.synthetic import batch_inputs
from runtime.observe.clock import sync_now
from runtime.observe.memory import LiveBytes
from runtime.execute.precision import Precision, autocast


# ---- measuring ------------------------------------------------------------------------------------

def _detached(value, requires_grad: bool):
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        if requires_grad and out.dtype.is_floating_point:
            out.requires_grad_(True)
        return out
    return value


@dataclass
class GroupRun:
    """A node group as a runnable sub-module, with its real inputs."""

    name: str
    module: fx.GraphModule
    inputs: list
    input_needs_grad: list[bool]


def _build_group(gm: fx.GraphModule, nodes: list[fx.Node], values: dict, needs: set[str], name: str) -> GroupRun:
    inside = {n.name for n in nodes}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs, input_needs = [], []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name in env or arg.name in inside:
                continue
            if arg.op == "get_attr":
                env[arg.name] = graph.get_attr(arg.target)
            else:
                env[arg.name] = graph.placeholder(arg.name)
                inputs.append(values[arg.name])
                input_needs.append(arg.name in needs)
            env[arg.name].meta = dict(arg.meta)
        if node.op == "get_attr":
            env[node.name] = graph.get_attr(node.target)
        else:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    outputs = [env[n.name] for n in nodes
               if n.op != "get_attr" and any(u.name not in inside for u in n.users)]
    graph.output(tuple(outputs))
    return GroupRun(name, fx.GraphModule(gm, graph), inputs, input_needs)


def _time_group(run: GroupRun, *, warmup: int, repeats: int, params, precision: Precision = Precision.FP32,
                device: str = "cpu") -> tuple[float, float, int]:
    """(median forward s, median backward s, peak live bytes of one forward + backward)."""
    generator = torch.Generator().manual_seed(0)
    grads_out = None
    fwd_times, bwd_times, peak = [], [], 0
    for i in range(warmup + repeats + 1):
        inputs = [_detached(v, need) for v, need in zip(run.inputs, run.input_needs_grad)]
        measure_memory = i == warmup + repeats
        mode = LiveBytes() if measure_memory else None
        if mode is not None:
            mode.__enter__()
        try:
            # each read waits for the device first: on a GPU the clock would time launches
            # (Note [timing on a device] in runtime/observe/clock.py)
            start = sync_now(device)
            with autocast(precision, device):
                outs = run.module(*inputs)
            middle = sync_now(device)
            flat = [o for o in tree_flatten(outs)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if grads_out is None:
                grads_out = [torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device) for o in flat]
            before_bwd = sync_now(device)
            if flat:
                torch.autograd.backward(flat, grads_out)
            end = sync_now(device)
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
        if measure_memory:
            peak = mode.peak
        elif i >= warmup:
            fwd_times.append(middle - start)
            bwd_times.append(end - before_bwd)
        del outs, flat, inputs
        for p in params:
            p.grad = None
    return statistics.median(fwd_times), statistics.median(bwd_times), peak


def local_device_kind() -> str:
    """The preset kind of this machine's device: a GPU by its name, else cpu."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        for key, kind in (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb")):
            if key in name:
                return kind
        return name.replace(" ", "-")
    return "cpu"


def measure(workload, gm: fx.GraphModule, *, warmup: int = 3, repeats: int = 10, single_ops: bool = True,
            threads: int | None = 1, device: str | None = None,
            progress: Callable[[str], None] | None = None, precision: Precision = Precision.FP32,
            compiled: bool = False) -> list[dict]:
    """Measure every region of the annotated ``gm`` (and every distinct op alone) on this machine.

    Returns one dict per measured group: name, kind ("region" or "op"), fwd_s, bwd_s,
    peak_live_bytes and the (forward, backward) features (Note [measuring a region]).
    ``precision``: forwards run under that policy's autocast, as the program runs them (Note
    [mixed precision] in runtime/execute/precision.py), so the fit is the policy's.
    ``compiled``: each region runs through torch.compile, as a compiled stage runs it (Note
    [compiled regions priced])."""
    if any(p.device.type == "meta" for p in gm.parameters()):
        raise ValueError(f"--calibrate runs the model, but {workload.name} lives on the meta device: calibrate "
                         "on a smaller configuration of the same model (same kinds of ops) and pass the "
                         "profile with --profile")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    old_threads = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    try:
        return _measure(workload, gm, warmup=warmup, repeats=repeats, single_ops=single_ops and not compiled,
                        device=device, progress=progress, precision=precision, compiled=compiled)
    finally:
        torch.set_num_threads(old_threads)


def _example_inputs(workload) -> tuple:
    """The graph's inputs, by position: keyword inputs in the trace's order, constant inputs
    (baked into the graph) dropped (Notes [keyword inputs], [constant inputs] in runtime/data/synthetic.py)."""
    args = workload.example_kwargs or workload.example_args
    if workload.make_batch is not None:
        try:
            args, _ = workload.make_batch(0, workload.example_batch_size)
        except Exception:  # noqa: BLE001 - the example inputs are a fine fallback
            args = workload.example_kwargs or workload.example_args
    return batch_inputs(args, workload.keywords, workload.constants)


# Note [compiled regions priced]: a program with compiled stages (Note [compiled stages] in
# runtime/execute/compile_stages.py) runs fused kernels, so `--calibrate` with `--compile-stages`
# measures each region through torch.compile (dynamic=False, as the stages; at least one warm-up
# call, which compiles and is never timed) and fits the time model to those seconds. Single ops are
# not measured then: each would be a compile of its own (seconds to a minute here), and an op
# alone compiles to nothing like its place in a fused region; the fit is of the regions alone.
# The profile's meta says "compiled", and compile refuses a profile measured the other way
# (an eager fit prices a compiled plan's per-op overhead that fusion removed, and vice versa).
# A compiled tensor-parallel stage pays no DTensor dispatch per op (dynamo traced through it once:
# the graph holds the local ops and the collectives), so compile prices ``dtensor_op_s`` at 0 for
# every kind when the stages are compiled, whatever a profile measured eager; the collectives'
# fixed cost and the members' skew stay (benchmarks/compiled_stages.py's tp 2 rows measure it).
def _measure(workload, gm, *, warmup, repeats, single_ops, device, progress, precision=Precision.FP32,
             compiled: bool = False) -> list[dict]:
    gm = gm.to(device)
    params = list(gm.parameters())
    needs = requires_grad_nodes(gm)
    values: dict = {}

    class Keep(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            values[n.name] = result.detach() if isinstance(result, torch.Tensor) else result
            return result

    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in _example_inputs(workload)]
    with torch.no_grad():
        Keep(gm).run(*args)

    members: dict[int, list[fx.Node]] = {}
    names: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        meta = ir.get(node, ir.REGION)
        members.setdefault(meta.region_id, []).append(node)
        names[meta.region_id] = meta.name
    groups: list[tuple[str, str, list[fx.Node]]] = [("region", names[r], members[r]) for r in sorted(members)]
    if single_ops:
        seen = set()
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem or op_name(node) in VIEW_OPS:
                continue
            shapes = tuple(tuple(getattr(values.get(a.name), "shape", ())) for a in node.all_input_nodes)
            key = (str(node.target), shapes, node.name in needs, str(node.args[1:]) if len(node.args) > 1 else "")
            if key in seen:
                continue
            seen.add(key)
            getitems = [u for u in node.users if u.target is operator.getitem]
            groups.append(("op", node.name, [a for a in node.all_input_nodes if a.op == "get_attr"] + [node] + getitems))
    results = []
    for kind, name, nodes in groups:
        run = _build_group(gm, nodes, values, needs, name)
        timed = dataclasses.replace(run, module=torch.compile(run.module, dynamic=False)) if compiled else run
        fwd_s, bwd_s, peak = _time_group(timed, warmup=max(warmup, 1) if compiled else warmup, repeats=repeats,
                                         params=params, precision=precision, device=device)
        fwd_f, bwd_f = group_features(nodes, needs)
        results.append({"kind": kind, "name": name, "fwd_s": fwd_s, "bwd_s": bwd_s, "peak_live_bytes": peak,
                        "fwd_features": asdict(fwd_f), "bwd_features": asdict(bwd_f)})
        if kind == "region":  # the recompute fixed cost (partitioner/calibrate/recompute_cost.py)
            def fresh(run=run):
                return [_detached(v, need) for v, need in zip(run.inputs, run.input_needs_grad)]

            results[-1].update(time_checkpointed(run.module, fresh, warmup=warmup, repeats=repeats, params=params,
                                                 precision=precision, device=device))
    if progress:
        progress(f"calibrate: measured {sum(r['kind'] == 'region' for r in results)} regions"
                 f"{' compiled' if compiled else ''} and "
                 f"{sum(r['kind'] == 'op' for r in results)} distinct ops, {repeats} repeats each")
    return results
