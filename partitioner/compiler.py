"""compile(): the pipeline from a Workload to a plan, one named step after another.

(Named compiler.py, not compile.py: a submodule called `compile` would shadow the package's
`partitioner.compile` function as soon as anything imported it.) Data flows one way:

    traced   = trace the model, random ops keyed          partitioner/frontend/analysis.py
    annotate = shapes → flops → memory → regions          partitioner/frontend/analysis.py, passes/
    machine  = this machine's cpu profile, cached (measured the first time): partitioner/calibrate/machine.py
    profile  = (optional) measure regions here and fit the time model (partitioner/calibrate/)
    problem  = the region graph as plain numbers          partitioner/frontend/analysis.py
    solution = the ILP over stages × data-parallel degree × microbatches, checked independently
    plan     = the frozen Plan, with the baselines beside it (this module)
    compiled = Compiled(plan, workload, problem, ...)     partitioner/compiled.py

and Compiled.save lowers it to the program folder (partitioner/codegen/lower.py: retrace at the
microbatch size → split → program → emit).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import torch
import torch.fx as fx

from passes import ir
from partitioner.frontend.analysis import COSTING_RANDOMNESS, annotate, target_bytes_of, trace_keyed, unpriced_field
from partitioner.calibrate.priced_problem import build_problem
from partitioner.calibrate import machine
from partitioner.calibrate.machine import fill_fixed_costs, with_compiled_fit
from partitioner.calibrate.profiles import compiled_profile_refusal
from partitioner.config.cluster import ClusterSpec
from partitioner.codegen.split import boundary_names, check_mutable_buffers
from partitioner.compiled import Compiled
from partitioner.config.job import training_settings
from partitioner.solver.plan import CutEdge, MemoryBreakdown, Plan, PlanRegion, PlanTie, StagePlan
from partitioner.config.settings import Decisions, Request, TrainingSettings
from partitioner.solver.candidates import validate_options
from partitioner.solver.evaluate import evaluate
from partitioner.solver.grad_norm_cost import computes_global_norm
from partitioner.solver.model import SolverConfig
from partitioner.solver.precision_cost import cluster_for_precision, precision_problem
from partitioner.solver.recompute_cost import cores_record, selective_problem
from partitioner.solver.solution import baseline_figures, solution_summary
from partitioner.solver.solve import solve_with_sharding
from partitioner.solver.sequence_parallel import choose as choose_sequence_parallel
from partitioner.solver.space import StepTerms
from partitioner.solver.tensor_groups import degrees_to_search
from partitioner.solver.zero_choice import allgather_s
from partitioner.frontend.corpus_data import with_corpus
from partitioner.frontend.tp_support import check_tensor_parallel, grouped
from partitioner.frontend.workload import Workload
from passes.region_graph import region_table
from passes.tp_activations import any_row_scatters
from runtime.execute import randomness
from runtime.execute.grad_norm import no_decay_names
from partitioner.compile_features import feature_decisions, feature_prices, feature_sharding
from runtime.resilience.memtier import memory_cost, plan_redundancy
from runtime.program.parts import MemoryTierPlan, Precision
from runtime.program.schedules import compiled_stages_refusal


def _progress(report: Callable[[str], None] | None, message: str) -> None:
    if report is not None:
        report(message)


def model_fingerprint(model: torch.nn.Module) -> str:
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters(remove_duplicate=False))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    training: dict | TrainingSettings | None = None,
    solver_config=None,
    profiles=(),
    calibrate=None,
    progress: Callable[[object], None] | None = None,
    precision: Precision | str | None = None,
    clip_grad_norm: float | None = None,
    shard_optimizer: str | bool = "auto",
    tensor_parallel: int | None = None,
    machine_profile="auto",
    sequence_parallel: str = "auto",
) -> Compiled:
    """``progress``: called with a str as each step starts ("trace", "passes: ...", "calibrate:
    ...", "solve: ..."; the first word names the step) and, during the solve, with
    solver.solve.SolveProgress updates (str() of one is a status line).
    ``training``: the training settings (a dict merged over the defaults and checked, Note
    [training settings merge], or a TrainingSettings; its "recompute" pins recompute: Note [recompute
    a user pins] in partitioner/solver/recompute_cost.py); ``precision`` and ``clip_grad_norm``, when
    given, override its keys (Note [mixed precision] in runtime/execute/precision.py; precision None:
    bf16-mixed on GPU kinds, fp32 on cpu; clipping None: off). ``num_stages``, ``dp``,
    ``tensor_parallel``, ``microbatches``, ``schedule``, ``shard_optimizer`` and ``granularity`` are
    the Request (partitioner/config/settings.py): None leaves the choice to the solver (Note [one
    enumeration] in partitioner/solver/space.py; shard_optimizer "auto": Note [sharding as a
    candidate] in solver/zero_choice.py; Note [tensor groups] in partitioner/solver/tensor_groups.py).
    ``machine_profile``: how cpu devices are priced (Note [the API measures too] in
    partitioner/calibrate/machine.py): "auto" (this machine's cached profile, measured once;
    the preset under PARTITIONER_NO_CALIBRATE=1), "preset", or a calibrate.machine.MachineProfile."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be a positive int (samples per training step)")
    settings = compile_settings(training, precision=precision, clip_grad_norm=clip_grad_norm)
    request = Request(num_stages=num_stages, dp=dp, tensor_parallel=tensor_parallel, microbatches=microbatches,
                      schedule=schedule, shard_optimizer=shard_optimizer, granularity=granularity,
                      sequence_parallel=sequence_parallel)  # Note [sequence parallelism as a decision]
    return compile_request(workload, settings, request, cluster=cluster, global_batch=global_batch,
                           optimizer=optimizer, solver_config=solver_config, profiles=profiles, calibrate=calibrate,
                           progress=progress, machine_profile=machine_profile)


def compile_settings(training: dict | TrainingSettings | None = None, *, precision=None,
                     clip_grad_norm=None) -> TrainingSettings:
    """The user's settings, checked once (Note [training settings merge]): compile's keyword
    settings over ``training``."""
    settings = training if isinstance(training, TrainingSettings) else training_settings(training)
    if precision is not None:
        settings = settings.replace(precision=Precision.of(precision))
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) or not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} must be a positive number (the largest global "
                             "gradient norm), or None for no clipping")
        settings = settings.replace(clip_grad_norm=float(clip_grad_norm))
    return settings


def compile_request(workload: Workload, settings: TrainingSettings, request: Request, *, cluster: ClusterSpec,
                    global_batch: int, optimizer: str = "adamw", solver_config=None, profiles=(), calibrate=None,
                    progress=None, machine_profile="auto") -> Compiled:
    """The compile of ``workload`` as ``settings`` and ``request`` ask (Note [settings and
    decisions] in partitioner/config/settings.py): reads both, decides the rest."""

    tp = check_tensor_parallel(request.tensor_parallel, cluster, settings)
    validate_options(grouped(cluster, tp), global_batch, request.num_stages, request.dp, request.microbatches,
                     request.schedule)  # before the trace
    if settings.compile_stages and (why := compiled_stages_refusal(request.schedule)):
        raise ValueError(why)  # not after the solve: the Compiled would be refused by its own save
    from partitioner.frontend.user_source import derive_sources

    if settings.data is not None:  # Note [a corpus replaces make_batch]
        workload = with_corpus(workload, settings.data, seed=settings.seed, global_batch=global_batch)
    sources = derive_sources(workload, require=False)  # Note [user code travels]: refused before the trace, not after
    precision = settings.precision or Precision.default_for(cluster.devices[0].kind)
    shard = request.shard_optimizer
    if (settings.sdc_every or 0) > 0:  # Note [no replica check on sharded state] in runtime/resilience/sdc.py
        if shard == "on":
            raise ValueError(f"sdc_every={settings.sdc_every} with shard_optimizer on: the replica check cannot "
                             "see corruption when the optimizer state is sharded (each piece is updated by its "
                             "owner and gathered into every replica); drop --sdc-every, or --shard-optimizer off")
        shard = "off"  # the check was asked for: only replicated state lets it see anything
    shard = feature_sharding(settings, shard)  # Note [one feature, one module] in runtime/features/__init__.py
    no_decay = tuple(no_decay_names(workload.model, settings.no_weight_decay))
    machine = _machine_step(machine_profile, cluster, progress)  # Note [machine profile]
    if machine is not None:
        cluster = machine.profile.cluster_for(cluster)  # Note [what the machine profile replaces]
    _progress(progress, "trace")
    traced, _keyed = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    _progress(progress, f"passes: shapes, flops, memory, regions ({request.granularity})")
    gm = annotate(traced, granularity=request.granularity, optimizer=optimizer,
                  loss_outside_graph=workload.loss_fn is not None)
    profiles = list(profiles)
    for p in profiles:  # a fit is of one precision policy (calibrate's meta "precision")
        fitted = Precision.of(p.meta.get("precision", Precision.FP32))
        if fitted is not precision:
            raise ValueError(f"the {p.kind} profile was fitted under precision {fitted}, but this plan trains in "
                             f"{precision}: recalibrate with --calibrate --precision {precision}, "
                             f"or compile with --precision {fitted}")
        refused = compiled_profile_refusal(p, bool(settings.compile_stages))
        if refused:
            raise ValueError(refused)

    def tp_runs(t: int) -> bool:
        return _tp_runs(gm, t, cluster, settings)

    if calibrate is not None:  # calibrate = partitioner.calibrate.CalibrationConfig
        _progress(progress, f"calibrate: measure every region here ({calibrate.repeats} repeats), fit the time model")

        weighs_tp = tp > 1 or (request.tensor_parallel is None and any(
            t > 1 and (request.num_stages is None or request.num_stages * t <= cluster.num_devices)
            for t in degrees_to_search(cluster, tp_runs)))
        with randomness.restored(COSTING_RANDOMNESS):  # Note [tensor-parallel overheads]: measured if weighed
            measured = calibrate.run(workload, gm, progress=progress, precision=precision, tensor_parallel=weighs_tp,
                                     compiled=bool(settings.compile_stages))
        profiles = [p for p in profiles if p.kind != measured.kind] + [measured]
    # (Note [machine profile]) its reference fit prices cpu regions under fp32 unless this model's
    # own profile does; its fixed costs fill in whatever no profile measured
    machine_regions = (machine is not None and not precision.is_mixed
                       and not any(p.kind == machine.profile.device_profile().kind for p in profiles))
    if machine_regions and settings.compile_stages:  # Note [compiled machine fit]
        machine = with_compiled_fit(machine, progress)
    machine_compiled = bool(machine_regions and settings.compile_stages and machine.profile.compiled)
    if machine_regions:
        profiles.append(machine.profile.device_profile(compiled=machine_compiled))
    # a GPU kind nothing was measured on is priced from published rates (Note [accelerator roofline])
    from partitioner.calibrate.datasheet import datasheet_profiles

    profiles += datasheet_profiles(cluster, precision, measured_kinds={p.kind for p in profiles})
    problem = build_problem(gm, workload.example_batch_size, profiles=profiles,
                            target_bytes=target_bytes_of(workload))
    if machine is not None:
        problem = fill_fixed_costs(problem, machine.profile)
    # Note [selective recompute] in partitioner/solver/recompute_cost.py
    problem, cores = selective_problem(problem, gm, settings.recompute, workload.example_batch_size)
    if settings.compile_stages:  # Note [compiled regions priced]: no DTensor dispatch inside a compiled graph
        problem = dataclasses.replace(problem, dtensor_op_s_by_kind={d.kind: 0.0 for d in cluster.devices})
    # Note [precision in the cost model] (partitioner/solver/precision_cost.py)
    problem = precision_problem(problem, precision, _param_elem_bytes(workload.model))
    cluster = cluster_for_precision(cluster, precision)
    tp_degrees = (tp,)
    if request.tensor_parallel is None:  # Note [one enumeration] in solver/space.py: each runnable degree weighed
        tp_degrees = degrees_to_search(cluster, tp_runs)
    elif tp > 1:  # Note [tensor groups]: plan tensor groups as devices
        from passes.tp_roles import check_degree

        check_degree(gm, tp)

    solver_config = _with_recompute(solver_config, settings.recompute)
    # the norm and the replica check weigh in the choice between candidates (Note [terms outside the ILP])
    global_norm = computes_global_norm(settings.clip_grad_norm, precision)
    step_terms = StepTerms(global_norm=global_norm, sdc_every=settings.sdc_every)

    def solve_over(degrees):
        _progress(progress, f"solve: {problem.num_regions} regions on {cluster.num_devices} devices"
                  + (f", tensor-parallel degrees {', '.join(map(str, degrees))}" if degrees != (1,) else ""))
        return solve_with_sharding(
            problem, cluster, global_batch, shard=shard, dp=request.dp, num_stages=request.num_stages,
            microbatches=request.microbatches, schedule=request.schedule, config=solver_config, progress=progress,
            tp_degrees=degrees,
            tp_dp=True, tp_shard=True,  # the runtime runs tp x dp with ZeRO-1 (partitioner/frontend/tp_support.py)
            step_terms=step_terms)

    # with DTensor's dispatch and gloo's per-collective cost priced (Note [tensor-parallel
    # overheads]), cpu compiles weigh every runnable degree like accelerators do
    solution, problem, cluster, sharded = solve_over(tp_degrees)
    tp = solution.tensor_parallel
    sharded = bool(sharded and solution.assignment.dp > 1)
    sdc_every = settings.sdc_every
    if sharded:  # Note [no replica check on sharded state] in runtime/resilience/sdc.py
        sdc_every = 0
    if sdc_every is None:  # Note [replica digests]: a plan setting, priced by evaluate
        from partitioner.solver.sdc_cost import default_every

        sdc_every = default_every(solution.assignment.dp)
    sp, problem = choose_sequence_parallel(request.sequence_parallel, lambda t: any_row_scatters(gm, t), problem,
                                           cluster, solution, compile_stages=bool(settings.compile_stages))
    decisions = Decisions(precision=precision, shard_optimizer=sharded, sdc_every=sdc_every, no_decay=no_decay,
                          sequence_parallel=sp, features=feature_decisions(settings, solution.assignment, tp, sharded))
    plan = make_plan(workload, gm, problem, cluster, solution, global_batch, settings=settings, decisions=decisions,
                     tp=tp)
    if settings.recompute == "selective":  # what inspect says was recomputed (partitioner/inspect/table.py)
        plan.solver["attention_cores"] = cores_record(problem, cores, workload.example_batch_size)
    if solution.optimal_over:
        plan.solver["optimal_over"] = f"regions at {request.granularity} granularity; {solution.optimal_over}"
    if machine is not None:  # what priced it: `calibrate --from-run` refits from it (Note [refit from a run])
        plan.predicted["cpu_time_model"] = machine.profile.plan_record(regions=machine_regions, path=machine.path,
                                                                         compiled=machine_compiled)
    compiled = Compiled(plan, workload, request.granularity, problem, solution.assignment, sources,
                        solution.fewer_devices_line(cluster.num_devices))
    if calibrate is None:  # a calibration ran the graph on real tensors (Note [one trace when the sizes agree])
        object.__setattr__(compiled, "first_trace", (traced, gm, _keyed))
    return compiled


def _with_recompute(config, recompute: str):
    """The solver's settings with the user's recompute (Note [recompute a user pins] in
    partitioner/solver/recompute_cost.py); a SolverConfig pinning the other way is refused."""
    config = config if config is not None else SolverConfig()
    if recompute == "auto" or config.recompute == recompute:
        return config
    if config.recompute != "auto":
        raise ValueError(f"recompute {recompute!r} (--recompute) and SolverConfig(recompute={config.recompute!r}) "
                         "disagree: give it once")
    return dataclasses.replace(config, recompute=recompute)


def _machine_step(option, cluster, progress):
    """The machine profile this compile prices cpu devices with, or None (Note [the API measures too])."""
    if isinstance(option, str) and option == "auto" and any(d.kind == machine.KIND for d in cluster.devices) \
            and not machine.calibration_disabled():
        _progress(progress, "machine: this machine's cpu profile")
    resolved = machine.resolve(option, cluster, progress)
    if resolved is not None:
        _progress(progress, f"machine: {resolved.how} {resolved.path} ({resolved.profile.describe()})")
    return resolved


def make_plan(workload, gm, problem, cluster, solution, global_batch, *, settings: TrainingSettings,
              decisions: Decisions, tp: int = 1) -> Plan:

    assignment = solution.assignment

    cost = evaluate(problem, cluster, assignment, sdc_every=decisions.sdc_every,  # Note [global gradient norm]
                    global_norm=computes_global_norm(settings.clip_grad_norm, decisions.precision))
    # gloo's extra all-gather of sharded state, in the promise too (Note [sharding as a candidate])
    extra_s = allgather_s(problem, cluster, assignment) if decisions.shard_optimizer else 0.0
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
            ranks=tuple(assignment.rank_of(s, rep) * tp for rep in range(assignment.dp)),  # tensor groups' first
            device=cluster.devices[device_index].kind,
            regions=regs,
            region_names=tuple(problem.regions[r].name for r in regs),
            params=int(params // elem),
            fwd_flops=float(sum(problem.regions[r].fwd_flops_per_sample for r in regs) * b),
            bwd_flops=float(sum(problem.regions[r].bwd_flops_per_sample for r in regs) * b),
            compute_time_s=sc.compute_s,
            comm_time_s=sc.comm_s,
            predicted_time_s=sc.time_s,
            # per rank: a tensor group's figures are tp x one member's (Note [tensor groups])
            memory=MemoryBreakdown(*(int(x / tp) for x in (
                sc.params_bytes, sc.grads_bytes, sc.optimizer_bytes, sc.activations_bytes, sc.buffers_bytes,
                sc.transient_bytes, sc.step_buffers_bytes))),
            peak_memory_bytes=int(sc.memory_bytes / tp),
            memory_capacity_bytes=int(sc.capacity_bytes / tp),
            send_bytes=int(sc.send_bytes),
            nodes=tuple(cluster.devices[i].node for i in assignment.device_of_stage_replica[s]),
            bwd_weight_flops=float(sum(problem.regions[r].bwd_weight_flops_per_sample for r in regs) * b),
        ))
    regions = tuple(
        PlanRegion(id=r, name=problem.regions[r].name, stage=stage_of[r], recompute=assignment.recompute[r],
               nodes=tuple(table[r].node_names), layer=problem.regions[r].layer,
               fwd_flops=problem.regions[r].fwd_flops_per_sample,
               bwd_flops=problem.regions[r].bwd_flops_per_sample,
               param_bytes=problem.regions[r].param_bytes,
               activation_bytes=problem.regions[r].activation_bytes_per_sample,
               transient_bytes=problem.regions[r].transient_bytes_per_sample,
               bwd_weight_flops=problem.regions[r].bwd_weight_flops_per_sample)
        for r in range(problem.num_regions)
    )
    cut_edges = tuple(_cut_edges(gm, stage_of, b, workload.example_batch_size))
    ties = tuple(
        PlanTie(param=name, stages=tuple(sorted({stage_of[r] for r in regs})),
            placement="colocated" if len({stage_of[r] for r in regs}) == 1 else "replicated",
            cost_s=next((t.cost_s for t in cost.ties if set(t.regions) == set(regs)), 0.0))
        for name, _nbytes, regs in _ties(gm)
    )
    if settings.memory_tier is not None:
        decisions = dataclasses.replace(decisions, memory_tier=memory_tier_choice(
            settings.memory_tier, stages, cluster, assignment))
    features_s, feature_predicted = feature_prices(stages, cluster, assignment, tp, decisions)
    step = cost.step_time_s + extra_s + features_s
    return Plan(
        workload=workload.name,
        model_fingerprint=model_fingerprint(workload.model),
        num_stages=assignment.num_stages,
        dp=assignment.dp,
        num_microbatches=assignment.num_microbatches,
        microbatch_size=b,
        global_batch=global_batch,
        schedule=assignment.schedule,
        world_size=assignment.pipeline_ranks * assignment.dp * tp,
        device_type="cpu" if cluster.devices[0].kind == "cpu" else "cuda",
        stages=tuple(stages),
        regions=regions,
        cut_edges=cut_edges,
        ties=ties,
        predicted={"step_time_s": step, "bubble_fraction": cost.bubble_fraction,
                   "lower_bound_step_time_s": solution.lower_bound_step_time_s,  # the whole space's
                   "samples_per_s": global_batch / step if step > 0 else 0.0,
                   "sdc_check_s_per_step": cost.sdc_check_s,  # in step_time_s (Note [cost model])
                   "grad_norm_s_per_step": cost.grad_norm_s,
                   **feature_predicted,  # Note [feature pricing] in runtime/features/__init__.py
                   # interleaved only: each rank's v stages on one device (Note [interleaved pricing])
                   **({"rank_peak_memory_bytes": [int(x) for x in cost.rank_memory_bytes]}
                      if cost.rank_memory_bytes else {}),
                   **unpriced_field(gm)},  # Note [experts priced at 0] in passes/flops.py: said at compile too
        solver=solution_summary(solution),
        baselines=baseline_figures(solution),
        cluster=cluster.to_dict(),
        training=settings,
        decisions=decisions,
        tensor_parallel=tp,
    )


def memory_tier_choice(request, stages, cluster, assignment) -> dict:
    """The memory tier's redundancy for this layout (runtime/resilience/memtier/groups.py, Note [redundancy]): ranks
    grouped one per node, the i-th rank of each node by (stages, replica) so that group members hold
    the same stage; mode "auto" is none on one node, copy on two, parity on more. Says what it
    costs in host memory: shard = parameters + optimizer state of the rank's stages, two slots."""

    if isinstance(request, MemoryTierPlan):
        request = {k: v for k, v in request.to_dict().items() if v is not None}
    request = {"mode": request} if isinstance(request, str) else dict(request)
    world = assignment.pipeline_ranks * assignment.dp
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
            # a group size only where there are parity groups: one host's plan must not say 1
            # (runtime settings_from refuses --parity-group 1)
            "group_size": red.to_dict()["group_size"] if red.mode == "parity" else None,
            "hosts": hosts, "groups": [list(g) for g in red.groups],
            "shard_bytes": shard, "own_bytes": cost["own_bytes"], "redundancy_bytes": cost["redundancy_bytes"],
            "per_host_bytes": cost["per_host_bytes"]}


def _tp_runs(gm, tp, cluster, settings: TrainingSettings) -> bool:
    """Whether the program runs tensor-parallel degree ``tp`` with these settings (Note [only
    runnable plans]): the degree divides what the sharded nodes split, and compile() would accept it."""
    # lazy: loads networkx
    from passes.tp_roles import check_degree

    try:
        check_degree(gm, tp)
        check_tensor_parallel(tp, cluster, settings)
    except ValueError:
        return False
    return True


def _param_elem_bytes(model: torch.nn.Module) -> int:
    for p in model.parameters():
        return p.element_size()
    return 4


def _ties(gm):
    # lazy: loads networkx
    from passes.region_graph import region_ties

    # Only trained parameters are ties: their copies' gradients are summed. A buffer read on two
    # stages is simply held by both (Note [stages talk only to their neighbours] in split.py).
    return [(t.name, t.bytes, tuple(sorted(set(t.regions)))) for t in region_ties(gm)
            if len(set(t.regions)) > 1 and t.trainable]


def _cut_edges(gm: fx.GraphModule, stage_of_region, microbatch_size: int, example_batch: int):
    """Every tensor that crosses a stage boundary, with the boundaries it crosses.

    The graph was traced at the example batch; shapes and bytes are restated per microbatch
    (a leading dimension equal to the example batch is the batch dimension)."""
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
