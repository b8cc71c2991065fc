"""Lowering: a compiled plan → its program folder (docs/design.md §6), one named step after another.

    retrace  = trace and annotate again at the plan's microbatch size (a traced graph's shapes are
               static), random ops keyed before the split so they keep their unpartitioned names
    split    = one GraphModule per stage (partitioner/codegen/split.py), recomputed regions moved under
               activation checkpointing (partitioner/codegen/recompute.py)
    program  = the "program" object of plan.json that the runtime reads, and init recipes for a
               model on the meta device
    emit     = stage files, train.py, weights, plan.json, written atomically (partitioner/codegen/)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from passes import ir
from partitioner.frontend.analysis import annotate, trace_keyed
from partitioner.codegen.split import updating_regions
from partitioner.codegen.tp_collectives import tensor_parallel_calls
from partitioner.codegen import write_program
from partitioner.solver.plan import Plan
from partitioner.codegen.boundary_dtypes import autocast_dtypes
from partitioner.config.settings import program_optimizer
from partitioner.config.device_presets import world_peak_flops_per_s
from partitioner.codegen.recompute import checkpoint_attention_cores, checkpoint_regions
from partitioner.codegen.split import StageGraph, split_graph
from partitioner.codegen.stage_code import custom_ops
from partitioner.frontend.local_modules import check_imports
from partitioner.frontend.user_source import OPTIONAL_ROLES, UserSources, derive_sources, op_sources
from partitioner.frontend.workload import Workload
from runtime.data.synthetic import constant_inputs
from runtime.execute.materialize import fan_in_bound
from runtime.features.registry import program_entries
from runtime.program.spec import Program
from runtime.program.parts import (DataSpec, InitSpec, Precision, RandomnessSpec, RankSpec, StageSpec, TensorSpec,
                                   TieSpec)

if TYPE_CHECKING:  # annotations only: Compiled.save() calls this module
    from partitioner.compiled import Compiled

def program_spec(plan: Plan, stages, workload: Workload, *, keyed_ops=(), init: dict | None = None,
                 sources: UserSources | None = None, constants: list | None = None) -> Program:
    """The program the runtime runs (runtime.program.spec.Program), built and validated once, here, at
    compile time, from its typed parts; plan.json holds its ``to_dict()``, which the ranks read.
    ``keyed_ops``: the random ops keyed by meaning;
    ``init``: the init recipes of a model compiled on the meta device; ``sources``: where the ranks
    find make_batch and loss_fn (default: derived from the workload, Note [user code travels]);
    ``constants``: the inputs the lowered graph was traced with that hold no tensor (default: the
    workload's example's; Note [constant inputs] in runtime/data/synthetic.py)."""
    def values(vs):
        # A tensor whose leading dimension is not the microbatch (rotary tables, masks built from
        # positions) is the same for every sample: it crosses whole, never split by batch.
        return tuple(TensorSpec(name=v.name, shape=tuple(v.shape), dtype=v.dtype,
                                batch_dim=0 if v.shape and v.shape[0] == plan.microbatch_size else None) for v in vs)

    sources = sources or derive_sources(workload)
    keywords = list(workload.keywords)
    constants = workload.constants if constants is None else constants
    if keywords:  # Note [keyword inputs] in runtime/data/synthetic.py: the dict's keys in stage 0's order
        names = [v.name for v in stages[0].inputs]
        if names[len(names) - len(keywords):] != keywords:
            raise AssertionError(f"stage 0's inputs {names} do not end with the keyword inputs {keywords}")
    settings, decisions = plan.training, plan.decisions
    return Program(**{
        "world_size": plan.world_size,
        "num_stages": plan.num_stages,
        "dp": plan.dp,
        "num_microbatches": plan.num_microbatches,
        "global_batch": plan.global_batch,
        "schedule": plan.schedule,
        "device": plan.device_type,
        "backend": "gloo" if plan.device_type == "cpu" else "nccl",
        "ranks": tuple(RankSpec(**r) for r in plan.rank_layout()),
        **({"tensor_parallel": plan.tensor_parallel,
            "tp_sharded": {n: v[1] for s in stages for n, v in s.tp_sharded.items()}}
           if plan.tensor_parallel > 1 else {}),
        "stages": tuple(StageSpec(index=s.index, module=f"stage_{s.index}", class_name=f"Stage{s.index}",
                                  params=tuple(s.params), mutable_buffers=tuple(s.mutable_buffers),
                                  inputs=values(s.inputs), outputs=values(s.outputs)) for s in stages),
        "ties": tuple(TieSpec(param=t.param, stages=tuple(t.stages)) for t in plan.ties
                      if t.placement == "replicated"),
        "data": DataSpec(make_batch=tuple(sources.specs["make_batch"]), loss_fn=tuple(sources.specs["loss_fn"]),
                         keywords=tuple(keywords), constants=tuple(constants or ()),
                         **{role: tuple(sources.specs[role]) for role in OPTIONAL_ROLES if role in sources.specs}),
        # the parts below are typed already: what the user asked and what the compiler decided
        # (Note [settings and decisions] in partitioner/config/settings.py)
        "optimizer": program_optimizer(settings, decisions),
        "seed": settings.seed,
        "collective_timeout_s": settings.collective_timeout_s,
        "checkpoint_every": settings.checkpoint_every,
        "mtbf_s": settings.mtbf_s,  # --mtbf's default
        "sdc_every": decisions.sdc_every,  # Note [replica digests] (runtime/resilience/sdc.py)
        "features": program_entries(decisions.features),  # Note [one feature, one module]
        # Note [mixed precision] (runtime/execute/precision.py), Note [global gradient norm]
        # (runtime/execute/grad_norm.py), Note [sharded optimizer state] (runtime/parallel/zero.py)
        "precision": decisions.precision,
        "clip_grad_norm": settings.clip_grad_norm,
        "shard_optimizer": decisions.shard_optimizer,
        # Note [compiled stages] in runtime/execute/compile_stages.py: off unless asked (not yet measured
        # faster on every device kind)
        "compile_stages": bool(settings.compile_stages),
        # Every run ends by printing what it measured next to this (runtime/execute/train.py, RankTrainer.run).
        "predicted_step_time_s": float(plan.predicted["step_time_s"]),
        "peak_flops_per_s": world_peak_flops_per_s(plan.stages, plan.tensor_parallel,  # for MFU
                                                   Precision.of(decisions.precision).dtype_name),
        "memory_tier": decisions.memory_tier_plan,
        # Note [randomness keyed by meaning] in runtime/execute/randomness.py
        "randomness": RandomnessSpec(keyed_ops=tuple(op.op for op in keyed_ops)) if keyed_ops else None,
        "init": InitSpec.from_dict(init) if init else None,
    })


def init_recipes(model: torch.nn.Module, stages) -> dict:
    """How each rank draws the initial value of a parameter it holds (runtime/execute/materialize.py).

    Linear layers and Embeddings follow torch's defaults; Hugging Face models their
    `initializer_range` normal; norms start at one (weights) and zero (biases)."""
    std = getattr(getattr(model, "config", None), "initializer_range", None)
    recipes = {}
    buffers = {n for n, _ in model.named_buffers()}  # once: per name it walked every module (O(params x modules))
    for stage in stages:
        for name in stage.params + stage.buffers:
            prefix, _, leaf = name.rpartition(".")
            owner = model.get_submodule(prefix) if prefix else model
            value = getattr(owner, leaf)
            base = {"shape": list(value.shape), "dtype": str(value.dtype)}
            kind = type(owner).__name__.lower()
            if name in buffers:
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


def retrace(compiled: "Compiled"):
    """The graph at the plan's microbatch size, annotated and random ops keyed: (traced, gm, keyed ops).

    Note [one trace when the sizes agree]: where the plan's microbatch size is the example batch the
    compile traced at, tracing again gives the same graph, regions and keyed ops (tracing is
    deterministic; what annotate's options change, the memory figures, lowering never reads), and
    costs as much as the whole solve on a small model: the first save takes compile's own trace.
    Only the first: lowering may leave marks on the graph, and a second save must start clean. A
    compile that calibrated ran the graph on real tensors, so it hands over none. Guarded by
    tests/unit/test_one_trace.py (a reused save writes the folder a fresh trace writes, byte for byte)."""
    plan, workload = compiled.plan, compiled.workload
    first = compiled.first_trace
    object.__setattr__(compiled, "first_trace", None)  # frozen: taken once, by hand
    if first is not None and plan.microbatch_size == workload.example_batch_size:
        return first
    traced, keyed_ops = trace_keyed(workload, workload.example_args_at(plan.microbatch_size),
                                    batch_size=plan.microbatch_size,
                                    example_kwargs=workload.example_kwargs_at(plan.microbatch_size))
    return traced, annotate(traced, granularity=compiled.granularity), keyed_ops


def split_stages(plan: Plan, gm: fx.GraphModule) -> list[StageGraph]:
    """One GraphModule per stage, the plan's recomputed regions under activation checkpointing."""
    stage_of_name = {r.name: r.stage for r in plan.regions}
    node_stage = {}
    for node in gm.graph.nodes:
        name = ir.get(node, ir.REGION).name
        if name not in stage_of_name:
            raise AssertionError(f"region {name!r} of the re-trace at microbatch size is not in the plan")
        node_stage[node.name] = stage_of_name[name]
    # Note [boundaries in the autocast dtype] in partitioner/codegen/boundary_dtypes.py
    dtypes = autocast_dtypes(gm, plan.decisions.precision, plan.device_type)
    stages = split_graph(gm, node_stage, plan.num_stages, dtypes)
    if plan.tensor_parallel > 1:  # Note [tensor-parallel roles] in passes/tp_roles.py
        from passes.tp_roles import sharded_parameters

        split = sharded_parameters(gm)
        for stage in stages:
            stage.tp_sharded = {n: (*split[n], tuple(_attr(gm, n).shape)) for n in stage.params if n in split}
            tensor_parallel_calls(stage.gm, stage.tp_sharded, plan.tensor_parallel * plan.decisions.sequence_parallel)
    # The plan's memory assumes its recomputed regions keep only their inputs: run them so.
    recomputed = {r.name for r in plan.regions if r.recompute} - updating_regions(gm)
    for stage in stages:  # selective: the attention cores instead (Note [selective recompute] in solver/recompute_cost.py)
        stage.checkpointed = (checkpoint_attention_cores(stage.gm) if plan.training.recompute == "selective"
                              else checkpoint_regions(stage.gm, recomputed))
    found = sorted(run.region for stage in stages for run in stage.checkpointed)
    if plan.training.recompute == "selective" and found != sorted(  # the cores the plan priced, no other
            name for name, c in plan.solver.get("attention_cores", {}).items() for _ in range(c["cores"])):
        raise AssertionError(f"the re-trace's attention cores {found} are not the plan's: recompile the program")
    return stages


def write_program_folder(compiled: "Compiled", folder) -> Path:
    """retrace → split → program → emit (this module's docstring)."""
    plan, workload = compiled.plan, compiled.workload
    traced, gm, keyed_ops = retrace(compiled)
    stages = split_stages(plan, gm)
    # A workload that names a weights source ("init": runtime/execute/pretrained.py for Hugging Face
    # models) has its ranks make their weights, on meta or not: no weights/ files.
    by_ranks = "init" in workload.source
    on_meta = by_ranks or any(p.device.type == "meta" for p in workload.model.parameters())
    init, lifted_state = None, None
    if by_ranks:
        model = workload.model
        held = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
            n for n, _ in model.named_buffers(remove_duplicate=False)}
        lifted = [n for stage in stages for n in stage.params + stage.buffers if n not in held]
        values = {n: _attr(traced.gm, n) for n in lifted}
        on_meta_now = [n for n, v in values.items() if v.device.type == "meta"]
        if on_meta_now:
            raise ValueError(f"workload {workload.name!r}: the stages read tensors the model holds under no name "
                             f"({on_meta_now[:3]}: constants the trace lifted) whose values a model built on the meta "
                             "device does not have, and the ranks cannot make them: build the model on cpu (for "
                             "hf: drop device=meta), or register them as buffers")
        # Note [constants travel] in runtime/execute/stage.py: shipped in weights/, the rest made by the ranks
        lifted_state = values or None
        init = {"seed": plan.training.seed, "params": {}, "weights": list(workload.source["init"])}
    elif on_meta:
        init = {"seed": plan.training.seed, "params": init_recipes(workload.model, stages)}
    sources = compiled.sources
    if sources is None or any(role not in sources.specs for role in ("make_batch", "loss_fn")):
        sources = derive_sources(workload)  # the error naming what is missing
    # the module each op's stage file imports (Note [custom ops travel]); a file of the user's
    # travels with its local imports (Note [local modules travel] in partitioner/frontend/local_modules.py).
    sources = op_sources(custom_ops(*(graph for s in stages for graph in (s.gm.graph, *(r.graph for r in s.checkpointed)))),
                         sources, workload.name)
    program = program_spec(plan, stages, workload, keyed_ops=keyed_ops, init=init, sources=sources,
                           constants=constant_inputs(traced.example_args, traced.example_kwargs))
    # The traced module holds every tensor a stage reads: parameters, buffers (persistent or
    # not) and constants export lifted, under the names the stage files use.
    state = lifted_state if on_meta else {
        name: _attr(traced.gm, name) for stage in stages for name in stage.params + stage.buffers}
    return write_program(folder, plan=plan, stages=stages, program=program, state=state,
                         problem=compiled.problem, assignment=compiled.assignment, user_files=sources.files,
                         op_imports=sources.op_imports,
                         check_user_files=lambda tmp: check_imports(tmp, sources, final=folder, workload_name=workload.name))
