"""compile(): the pipeline from a Workload to a Plan, one named step after another.

(Named compiler.py, not compile.py: a submodule called `compile` would shadow the package's
`partitioner.compile` function as soon as anything imported it.)

    traced   = trace the model (torch.export, symbolic_trace fallback)
    annotate = shapes → flops → memory → regions, each checked for what it declares
    profile  = (optional) measure regions here and fit the time model (partitioner/calibrate.py)
    problem  = the region graph as plain numbers, per sample, priced by the fitted profiles if any
    solution = the ILP over stages × data-parallel degree × microbatches, checked independently
    plan     = the frozen Plan, with the baselines beside it

save_program (Plan.save) re-traces at the microbatch size, annotates, keys every random op
(partitioner/randomness.py, before the split, so ops keep their unpartitioned names), splits the
graph into stages and writes the folder (partitioner/codegen.py).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

from partitioner import ir
from partitioner.cluster import ClusterSpec
from partitioner.plan import CutEdge, MemoryBreakdown, Plan, Region, StagePlan, Tie
from partitioner.solver import problem as sp
from partitioner.trace import Traced, trace
from partitioner.workload import Workload
from runtime import randomness

DEFAULT_TRAINING = {
    "optimizer": {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                  "warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 1000},
    "seed": 0,
    "collective_timeout_s": 60,
    "checkpoint_every": 0,
}


def _progress(report: Callable[[str], None] | None, message: str) -> None:
    if report is not None:
        report(message)


# Costing runs keyed random ops on fake (or, calibrating, real) tensors: they need a context,
# and no draw's value reaches a cost.
_COSTING_RANDOMNESS = randomness.Context(seed=0, step=0, first_sample=0, microbatch=0)


def trace_keyed(workload: Workload, example_args: tuple, *, batch_size: int):
    """trace, then key every random op (partitioner/randomness.py): the graph the cost passes
    price is the graph the stages run (keyed attention with dropout is explicit attention, which
    keeps more than the fused kernel). Returns (Traced, the keyed ops)."""
    from partitioner.randomness import lower_randomness

    traced = trace(workload.model, example_args, workload.example_kwargs)
    return traced, lower_randomness(traced.gm, batch_size=batch_size)


def annotate(traced: Traced, *, granularity: str = "block", optimizer: str = "adamw",
             loss_outside_graph: bool = False) -> fx.GraphModule:
    from passes import annotate_flops, annotate_memory, annotate_regions, annotate_shapes

    gm = traced.gm
    with randomness.restored(_COSTING_RANDOMNESS):
        annotate_shapes(gm)
        annotate_flops(gm)
        annotate_memory(gm, optimizer=optimizer, loss_outside_graph=loss_outside_graph)
        annotate_regions(gm, granularity=granularity)
    return gm


def analyze(workload: Workload, *, granularity: str = "block"):
    """Trace and annotate: the graph and its per-region cost table."""
    from passes.regions import region_table

    traced, _keyed = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity=granularity, loss_outside_graph=workload.loss_fn is not None)
    return gm, region_table(gm)


def build_problem(gm: fx.GraphModule, batch_size: int, *, profiles=(), target_bytes: int = 0) -> sp.PartitionProblem:
    """The region graph as plain numbers per sample (costs are linear in the microbatch size).

    ``target_bytes``: the loss target of one example batch (``target_bytes_of``).

    ``profiles`` (calibrate.DeviceProfile, one per device kind) price every region by the fitted
    time model on their kind (Note [the fitted time model] in partitioner/calibrate.py)."""
    from partitioner.calibrate import apply_profiles

    from passes.regions import region_cut_edges, region_edges, region_table, region_ties

    table = region_table(gm)
    edges = region_edges(gm)
    incoming = {r.region_id: 0 for r in table}
    for src, dst, num_bytes in edges:
        incoming[dst] += num_bytes
    updating = updating_regions(gm)
    regions = tuple(
        sp.Region(
            name=r.name,
            fwd_flops_per_sample=r.fwd_flops / batch_size,
            bwd_flops_per_sample=r.bwd_flops / batch_size,
            param_bytes=int(r.param_bytes),
            grad_bytes=int(r.grad_bytes),
            optimizer_bytes=int(r.optimizer_bytes),
            activation_bytes_per_sample=-(-(r.saved_activation_bytes + r.held_bytes) // batch_size),
            # A recomputed region keeps only its inputs (and what the runtime holds outside
            # autograd, the loss) and runs its forward again in backward; one that updates a buffer
            # saves nothing by it (Note [recompute never updates twice]).
            recompute_activation_bytes_per_sample=-(-(max(incoming[r.region_id], r.saved_activation_bytes
                                                          if r.name in updating else 0) + r.held_bytes)
                                                    // batch_size),
            layer=r.layer,
            # max over nodes of each part: at least the max of their sums, at any microbatch size
            transient_bytes_per_sample=-(-r.bwd_transient_bytes // batch_size),
            transient_fixed_bytes=r.bwd_param_grad_bytes,
        )
        for r in table
    )
    problem_edges = tuple(sp.Edge(src, dst, int(round(b / batch_size))) for src, dst, b in region_cut_edges(gm))
    # A buffer read by regions on several stages costs each holder its bytes and nothing else:
    # no gradient, no optimizer state, no sum (Note [stages talk only to their neighbours]).
    ties = tuple(sp.Tie(regions=tuple(sorted(set(t.regions))), param_bytes=int(t.bytes),
                        **({} if t.trainable else {"grad_bytes": 0, "optimizer_bytes": 0}))
                 for t in region_ties(gm) if len(set(t.regions)) > 1)
    inputs = sum(ir.get(n, ir.SHAPE).output_bytes for n in gm.graph.nodes if n.op == "placeholder")
    # The all-reduce's flat bucket (runtime/train.py _allreduce_flat_): 2**25 elements, or one
    # larger gradient alone; 4-byte elements, the largest there are (Note [memory model]).
    largest_grad = max((ir.get(n, ir.MEMORY).grad_bytes for n in gm.graph.nodes), default=0)
    problem = sp.PartitionProblem(regions=regions, edges=problem_edges, ties=ties,
                                  input_bytes_per_sample=-(-inputs // batch_size),
                                  target_bytes_per_sample=-(-target_bytes // batch_size),
                                  allreduce_bucket_bytes=max(4 * sp.ALLREDUCE_BUCKET_ELEMS, largest_grad))
    return apply_profiles(problem, gm, batch_size, profiles)


def updating_regions(gm: fx.GraphModule) -> set[str]:
    """Names of the regions holding a node that updates a buffer in place (BatchNorm's running
    statistics).

    Note [recompute never updates twice]: recomputing such a region in backward would run its
    update a second time (running statistics counted twice per microbatch). The problem prices
    its recompute as saving nothing, so the solver, which pays the extra forward, never picks it,
    and save_program does not checkpoint it even if a hand-made plan asks to."""
    from partitioner.split import mutated_buffers

    updaters = {name for names in mutated_buffers(gm).values() for name in names}
    return {ir.get(n, ir.REGION).name for n in gm.graph.nodes if n.name in updaters}


def target_bytes_of(workload: Workload) -> int:
    """Bytes of the loss target of one example batch (every rank builds the global batch's)."""
    from torch.utils._pytree import tree_flatten

    if workload.loss_fn is None or workload.make_batch is None:
        return 0
    _args, target = workload.make_batch(0, workload.example_batch_size)
    return sum(t.numel() * t.element_size() for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor))


def model_fingerprint(model: torch.nn.Module) -> str:
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters(remove_duplicate=False))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Artifacts:
    """What Plan.save needs besides the plan: the workload to re-trace at the microbatch size, and
    the solver's problem and assignment, which plan.json keeps for `inspect --node`."""

    workload: Workload
    granularity: str
    region_names: list[str] = field(default_factory=list)
    problem: sp.PartitionProblem | None = None
    assignment: sp.Assignment | None = None


def compile_workload(
    workload: Workload,
    *,
    cluster: ClusterSpec,
    global_batch: int,
    num_stages: int | None = None,
    dp: int | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    granularity: str = "block",
    optimizer: str = "adamw",
    training: dict | None = None,
    solver_config=None,
    profiles=(),
    calibrate=None,
    progress: Callable[[object], None] | None = None,
) -> Plan:
    """``progress``: called with a str as each step starts ("trace", "passes: ...", "calibrate:
    ...", "solve: ..."; the first word names the step) and, during the solve, with
    solver.solve.SolveProgress updates (str() of one is a status line)."""
    from partitioner.solver.solve import solve

    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be a positive int (samples per training step)")
    _progress(progress, "trace")
    traced, _keyed = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    _progress(progress, f"passes: shapes, flops, memory, regions ({granularity})")
    gm = annotate(traced, granularity=granularity, optimizer=optimizer,
                  loss_outside_graph=workload.loss_fn is not None)
    profiles = list(profiles)
    if calibrate is not None:  # calibrate = partitioner.calibrate.CalibrationConfig
        _progress(progress, f"calibrate: measure every region here ({calibrate.repeats} repeats), fit the time model")
        with randomness.restored(_COSTING_RANDOMNESS):
            measured = calibrate.run(workload, gm, progress=progress)
        profiles = [p for p in profiles if p.kind != measured.kind] + [measured]
    problem = build_problem(gm, workload.example_batch_size, profiles=profiles,
                            target_bytes=target_bytes_of(workload))
    _progress(progress, f"solve: {problem.num_regions} regions on {cluster.num_devices} devices")
    solution = solve(problem, cluster, global_batch, num_stages=num_stages, dp=dp, microbatches=microbatches,
                     schedule=schedule, config=solver_config, progress=progress)
    plan = make_plan(workload, gm, problem, cluster, solution, global_batch,
                     training={**DEFAULT_TRAINING, **(training or {})})
    object.__setattr__(plan, "_artifacts", Artifacts(workload, granularity, [r.name for r in problem.regions],
                                                     problem, solution.assignment))
    return plan


def make_plan(workload, gm, problem, cluster, solution, global_batch, *, training) -> Plan:
    from passes.regions import region_table
    from partitioner.solver.check import evaluate
    from partitioner.split import check_mutable_buffers

    assignment = solution.assignment
    cost = evaluate(problem, cluster, assignment)
    table = region_table(gm)
    b = assignment.microbatch_size
    stage_of = assignment.stage_of_region
    # Refused here, not when the folder is written: a plan the program cannot keep is no plan.
    check_mutable_buffers(gm, {n.name: stage_of[ir.get(n, ir.REGION).region_id] for n in gm.graph.nodes})
    stages = []
    for s, sc in enumerate(cost.stages):
        regs = tuple(r for r in range(problem.num_regions) if stage_of[r] == s)
        device_index = assignment.device_of_stage_replica[s][0]
        params = sum(table[r].param_bytes for r in regs)
        elem = max(1, _param_elem_bytes(workload.model))
        stages.append(StagePlan(
            index=s,
            ranks=tuple(assignment.rank_of(s, rep) for rep in range(assignment.dp)),
            device=cluster.devices[device_index].kind,
            regions=regs,
            region_names=tuple(problem.regions[r].name for r in regs),
            params=int(params // elem),
            flops_fwd=float(sum(problem.regions[r].fwd_flops_per_sample for r in regs) * b),
            flops_bwd=float(sum(problem.regions[r].bwd_flops_per_sample for r in regs) * b),
            compute_time_s=sc.compute_s,
            comm_time_s=sc.comm_s,
            predicted_time_s=sc.time_s,
            memory=MemoryBreakdown(int(sc.params_bytes), int(sc.grads_bytes), int(sc.optimizer_bytes),
                                   int(sc.activations_bytes), int(sc.buffers_bytes), int(sc.transient_bytes),
                                   int(sc.step_buffers_bytes)),
            peak_memory_bytes=int(sc.memory_bytes),
            memory_capacity_bytes=int(sc.capacity_bytes),
            send_bytes=int(sc.send_bytes),
        ))
    regions = tuple(
        Region(id=r, name=problem.regions[r].name, stage=stage_of[r], recompute=assignment.recompute[r],
               nodes=tuple(table[r].node_names), layer=problem.regions[r].layer,
               flops_fwd=problem.regions[r].fwd_flops_per_sample,
               flops_bwd=problem.regions[r].bwd_flops_per_sample,
               param_bytes=problem.regions[r].param_bytes,
               activation_bytes=problem.regions[r].activation_bytes_per_sample,
               transient_bytes=problem.regions[r].transient_bytes_per_sample)
        for r in range(problem.num_regions)
    )
    cut_edges = tuple(_cut_edges(gm, stage_of, b, workload.example_batch_size))
    ties = tuple(
        Tie(param=name, stages=tuple(sorted({stage_of[r] for r in regs})),
            placement="colocated" if len({stage_of[r] for r in regs}) == 1 else "replicated",
            cost_s=next((t.cost_s for t in cost.ties if set(t.regions) == set(regs)), 0.0))
        for name, _nbytes, regs in _ties(gm)
    )
    if training.get("memory_tier") is not None:
        training = {**training, "memory_tier": memory_tier_choice(training["memory_tier"], stages, cluster,
                                                                  assignment)}
    step = cost.step_time_s
    return Plan(
        workload=workload.name,
        model_fingerprint=model_fingerprint(workload.model),
        num_stages=assignment.num_stages,
        dp=assignment.dp,
        num_microbatches=assignment.num_microbatches,
        microbatch_size=b,
        global_batch=global_batch,
        schedule=assignment.schedule,
        world_size=assignment.num_stages * assignment.dp,
        device_type="cpu" if cluster.devices[0].kind == "cpu" else "cuda",
        stages=tuple(stages),
        regions=regions,
        cut_edges=cut_edges,
        ties=ties,
        predicted={"step_time_s": step, "bubble_fraction": cost.bubble_fraction,
                   "lower_bound_step_time_s": cost.lower_bound_step_time_s,
                   "samples_per_s": global_batch / step if step > 0 else 0.0},
        solver=solution_summary(solution),
        baselines={name: {"step_time_s": value} for name, value in sorted(solution_baselines(solution).items())},
        cluster=cluster.to_dict(),
        training=training,
    )


def memory_tier_choice(request, stages, cluster, assignment) -> dict:
    """The memory tier's redundancy for this layout (runtime/memtier.py, Note [redundancy]): ranks
    grouped one per node, the i-th rank of each node by (stages, replica) so that group members hold
    the same stage; mode "auto" is none on one node, copy on two, parity on more. Says what it
    costs in host memory: shard = parameters + optimizer state of the rank's stages, two slots."""
    from runtime.memtier import memory_cost, plan_redundancy

    request = {"mode": request} if isinstance(request, str) else dict(request)
    world = assignment.num_stages * assignment.dp
    hosts, keys, shard = [0] * world, [((), 0)] * world, [0] * world
    for s, stage in enumerate(stages):
        for rep in range(assignment.dp):
            rank = assignment.rank_of(s, rep)
            hosts[rank] = cluster.devices[assignment.device_of_stage_replica[s][rep]].node
            keys[rank] = (keys[rank][0] + (s,), rep)
            shard[rank] += stage.memory.params_bytes + stage.memory.optimizer_bytes
    red = plan_redundancy(hosts, keys, mode=request.get("mode", "auto"), group_size=request.get("group_size"))
    cost = memory_cost(red, shard)
    return {"mode": red.mode, "requested": request.get("mode", "auto"), "every": int(request.get("every", 1)),
            "group_size": red.to_dict()["group_size"], "hosts": hosts, "groups": [list(g) for g in red.groups],
            "shard_bytes": shard, "own_bytes": cost["own_bytes"], "redundancy_bytes": cost["redundancy_bytes"],
            "per_host_bytes": cost["per_host_bytes"]}


def _param_elem_bytes(model: torch.nn.Module) -> int:
    for p in model.parameters():
        return p.element_size()
    return 4


def _ties(gm):
    from passes.regions import region_ties

    # Only trained parameters are ties: their copies' gradients are summed. A buffer read on two
    # stages is simply held by both (Note [stages talk only to their neighbours] in split.py).
    return [(t.name, t.bytes, tuple(sorted(set(t.regions)))) for t in region_ties(gm)
            if len(set(t.regions)) > 1 and t.trainable]


def _cut_edges(gm: fx.GraphModule, stage_of_region, microbatch_size: int, example_batch: int):
    """Every tensor that crosses a stage boundary, with the boundaries it crosses.

    The graph was traced at the example batch; shapes and bytes are restated per microbatch
    (a leading dimension equal to the example batch is the batch dimension)."""
    from partitioner.split import boundary_names

    region_of = {n.name: ir.get(n, ir.REGION).region_id for n in gm.graph.nodes}
    readable = boundary_names(gm)  # the names the stage files give them (Note [boundary names])
    grouped: dict[tuple[int, int], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        src = region_of[node.name]
        last = max((stage_of_region[region_of[u.name]] for u in node.users if u.op != "output"),
                   default=stage_of_region[src])
        if last > stage_of_region[src]:
            dst = max((region_of[u.name] for u in node.users if u.op != "output"),
                      key=lambda r: stage_of_region[r])
            grouped.setdefault((src, dst), []).append(node)
    for (src, dst), nodes in sorted(grouped.items()):
        shapes, total = [], 0
        for n in nodes:
            meta = ir.get(n, ir.SHAPE)
            shape = tuple(meta.shape or ())
            if shape and shape[0] == example_batch:
                shapes.append((microbatch_size,) + shape[1:])
                total += meta.output_bytes * microbatch_size // example_batch
            else:
                shapes.append(shape)
                total += meta.output_bytes
        yield CutEdge(src_region=src, dst_region=dst, tensors=tuple(readable.get(n.name, n.name) for n in nodes), shapes=tuple(shapes),
                      bytes_per_microbatch=int(total), boundaries=tuple(range(stage_of_region[src], stage_of_region[dst])))


def solution_summary(solution) -> dict:
    return {
        "status": solution.status,
        "objective": float(solution.objective),
        "bound": float(solution.bound),
        "gap": float(abs(solution.objective - solution.bound) / solution.objective) if solution.objective else 0.0,
        "solve_time_s": float(solution.solve_time_s),
    }


def solution_baselines(solution) -> dict:
    return dict(getattr(solution, "baselines", {}) or {})


def program_spec(plan: Plan, stages, workload: Workload) -> dict:
    """The "program" object of plan.json: everything the runtime reads (runtime/__init__.py)."""
    def values(vs):
        # A tensor whose leading dimension is not the microbatch (rotary tables, masks built from
        # positions) is the same for every sample: it crosses whole, never split by batch.
        return [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype,
                 "batch_dim": 0 if v.shape and v.shape[0] == plan.microbatch_size else None} for v in vs]

    missing = [k for k in ("make_batch", "loss_fn") if k not in workload.source]
    if missing:
        raise ValueError(
            f"workload {workload.name!r} does not say where generated programs find {missing}: set "
            "Workload(source={'make_batch': ('module:function', kwargs), 'loss_fn': (...)})"
        )
    return {
        "world_size": plan.world_size,
        "num_stages": plan.num_stages,
        "dp": plan.dp,
        "num_microbatches": plan.num_microbatches,
        "global_batch": plan.global_batch,
        "schedule": plan.schedule,
        "device": plan.device_type,
        "backend": "gloo" if plan.device_type == "cpu" else "nccl",
        "ranks": plan.rank_layout(),
        "stages": [{"index": s.index, "module": f"stage_{s.index}", "class": f"Stage{s.index}",
                    "params": list(s.params), "mutable_buffers": list(s.mutable_buffers),
                    "inputs": values(s.inputs), "outputs": values(s.outputs)}
                   for s in stages],
        "ties": [{"param": t.param, "stages": list(t.stages)} for t in plan.ties if t.placement == "replicated"],
        "data": {"make_batch": list(workload.source["make_batch"]), "loss_fn": list(workload.source["loss_fn"])},
        "optimizer": plan.training["optimizer"],
        "seed": plan.training["seed"],
        "collective_timeout_s": plan.training["collective_timeout_s"],
        "checkpoint_every": plan.training.get("checkpoint_every", 0),
        **({"memory_tier": {k: plan.training["memory_tier"][k] for k in ("mode", "every", "group_size")}}
           if plan.training.get("memory_tier") else {}),
    }


def init_recipes(model: torch.nn.Module, stages) -> dict:
    """How each rank draws the initial value of a parameter it holds (runtime/materialize.py).

    Linear layers and Embeddings follow torch's defaults; Hugging Face models their
    `initializer_range` normal; norms start at one (weights) and zero (biases)."""
    from runtime.materialize import fan_in_bound

    std = getattr(getattr(model, "config", None), "initializer_range", None)
    recipes = {}
    for stage in stages:
        for name in stage.params + stage.buffers:
            prefix, _, leaf = name.rpartition(".")
            owner = model.get_submodule(prefix) if prefix else model
            value = getattr(owner, leaf)
            base = {"shape": list(value.shape), "dtype": str(value.dtype)}
            kind = type(owner).__name__.lower()
            if name in dict(model.named_buffers()):
                raise ValueError(
                    f"buffer {name!r} of a meta-device model cannot be materialized by the ranks: "
                    "build the model on cpu, or register it as a constant the forward computes")
            if "norm" in kind:
                recipes[name] = {**base, "init": "ones" if leaf == "weight" else "zeros"}
            elif leaf == "bias":
                recipes[name] = ({**base, "init": "zeros"} if std is not None else
                                 {**base, "init": "uniform", "bound": fan_in_bound(getattr(owner, "in_features", 1))})
            elif std is not None:
                recipes[name] = {**base, "init": "normal", "std": std}
            elif isinstance(owner, torch.nn.Linear):
                recipes[name] = {**base, "init": "uniform", "bound": fan_in_bound(owner.in_features)}
            elif isinstance(owner, torch.nn.Embedding):
                recipes[name] = {**base, "init": "normal", "std": 1.0}
            else:
                recipes[name] = {**base, "init": "normal", "std": 0.02}
    return recipes


def _attr(gm: fx.GraphModule, dotted: str) -> torch.Tensor:
    value = gm
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def save_program(plan: Plan, folder) -> Path:
    from partitioner.codegen import write_program
    from partitioner.recompute import checkpoint_regions
    from partitioner.split import split_graph

    artifacts: Artifacts = plan._artifacts  # type: ignore[attr-defined]
    workload = artifacts.workload
    traced, keyed_ops = trace_keyed(workload, workload.example_args_at(plan.microbatch_size),
                                    batch_size=plan.microbatch_size)
    gm = annotate(traced, granularity=artifacts.granularity)
    stage_of_name = {r.name: r.stage for r in plan.regions}
    node_stage = {}
    for node in gm.graph.nodes:
        name = ir.get(node, ir.REGION).name
        if name not in stage_of_name:
            raise AssertionError(f"region {name!r} of the re-trace at microbatch size is not in the plan")
        node_stage[node.name] = stage_of_name[name]
    stages = split_graph(gm, node_stage, plan.num_stages)
    # The plan's memory assumes its recomputed regions keep only their inputs: run them so.
    recomputed = {r.name for r in plan.regions if r.recompute} - updating_regions(gm)
    for stage in stages:
        stage.checkpointed = checkpoint_regions(stage.gm, recomputed)
    on_meta = any(p.device.type == "meta" for p in workload.model.parameters())
    program = program_spec(plan, stages, workload)
    if keyed_ops:  # Note [randomness keyed by meaning] in runtime/randomness.py
        program["randomness"] = {"keyed_ops": [op.op for op in keyed_ops]}
    if on_meta:
        program["init"] = {"seed": plan.training["seed"], "params": init_recipes(workload.model, stages)}
    # The traced module holds every tensor a stage reads: parameters, buffers (persistent or
    # not) and constants export lifted, under the names the stage files use.
    state = None if on_meta else {
        name: _attr(traced.gm, name) for stage in stages for name in stage.params + stage.buffers}
    return write_program(folder, plan=plan, stages=stages, program=program, state=state)
