"""`partitioner calibrate --from-run RUN_DIR`: the machine profile refit to what a finished run
measured (Note [refit from a run]).

Note [refit from a run]
    A run measures what the profile predicts (summary.json's step time, each stage's seconds per
    microbatch: Note [stage times] in runtime/observe/stage_times.py). The refit reprices the run's
    own plan and fits two things: the region scales (measured over priced, forward and backward)
    and the per-microbatch overhead that makes ``evaluate`` give the measured step (what the model
    leaves out on this machine: the schedule's Python, waits on sends). A negative overhead is 0
    and the pipeline latency is refit instead (a busy measurement prices sends too high); if even
    that is not enough, both region scales shrink by one factor. Both are relative to the profile
    that priced the plan, so the plan must have been priced by this machine's profile and the same
    measurement (after a ``--refresh``: recompile, run, refit). The newest run wins (the machine
    as it is now). Tensor-parallel runs are refused: their collectives are inside the stage times.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from partitioner.calibrate.machine import KIND, MachineProfile, Refit
from partitioner.calibrate.machine_profile import STEP_S_BOUNDS, outside
from partitioner.config.cluster import ClusterSpec
from partitioner.solver.plan import Plan
from runtime.observe.stage_times import FORMAT

_PROBE_S = 1e-3  # the overhead's second point of the linear solve


@dataclass(frozen=True)
class RefitReport:
    profile: MachineProfile        # the refit profile (not yet saved)
    run_dir: Path
    folder: Path
    measured_step_s: float
    predicted_before_s: float      # the plan's own prediction
    predicted_after_s: float       # the same plan priced by the refit profile
    forward_scale: float           # this run's factors, of the plan's pricing
    backward_scale: float
    microbatch_overhead_before_s: float
    microbatch_overhead_after_s: float
    stage_times: bool              # per-stage times were there (else one factor for all)
    link_latency_before_s: float = 0.0
    link_latency_after_s: float = 0.0

    def text(self) -> str:
        how = ("regions x{:.2f} forward, x{:.2f} backward (per-stage times)".format(self.forward_scale,
                                                                                   self.backward_scale)
               if self.stage_times else f"everything x{self.forward_scale:.2f} (no per-stage times in the run)")
        return "\n".join([
            f"refit from {self.run_dir} (program {self.folder}):",
            f"  measured   {self.measured_step_s * 1e3:.1f} ms/step",
            f"  predicted  {self.predicted_before_s * 1e3:.1f} ms/step before "
            f"({self.predicted_before_s / self.measured_step_s:.2f}x measured), "
            f"{self.predicted_after_s * 1e3:.1f} ms/step after "
            f"({self.predicted_after_s / self.measured_step_s:.2f}x)",
            f"  fitted     {how}; per-microbatch overhead {self.microbatch_overhead_before_s * 1e3:.2f} -> "
            f"{self.microbatch_overhead_after_s * 1e3:.2f} ms"
            + (f"; a pipeline send's latency {self.link_latency_before_s * 1e3:.2f} -> "
               f"{self.link_latency_after_s * 1e3:.2f} ms" if self.link_latency_after_s != self.link_latency_before_s
               else ""),
        ])


def _run_paths(path: str | Path) -> tuple[Path, dict]:
    """(the run folder, its summary.json) of RUN_DIR, or of a program folder's DIR/run."""
    path = Path(path)
    if (path / "plan.json").is_file() and not (path / "summary.json").is_file():
        path = path / "run"
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise ValueError(f"--from-run {path}: no summary.json there; pass the folder `partitioner run` wrote "
                         "(DIR/run, or its --run-dir) after a run finished")
    try:
        summary = json.loads(summary_path.read_text())
        step_s = summary["measured_step_time_s"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{summary_path} is not a run summary ({type(exc).__name__}: {exc}): run the program "
                         "again with `partitioner run`") from None
    _check_seconds(step_s, f"{summary_path}: measured_step_time_s")
    return path, summary


def _check_seconds(value, what: str) -> None:
    """ValueError, one line naming ``what`` and the value, when a measured time is no step's (Note
    [machine figures are bounded] in partitioner/calibrate/machine_profile.py): nothing is refit."""
    if outside(value, STEP_S_BOUNDS):
        lo, hi = STEP_S_BOUNDS
        raise ValueError(f"{what} is {value!r}, which no run measures (a step takes {lo:g} to {hi:g} s): the "
                         "profile is not refit; run the program again with `partitioner run` and refit from that run")


def _stage_times(run_dir: Path) -> dict[int, tuple[float, float]]:
    """stage -> (forward, backward) measured seconds per microbatch, averaged over its replicas."""
    seen: dict[int, list[tuple[float, float]]] = {}
    for path in sorted(run_dir.glob("stage_times_rank_*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            continue
        for entry in body.get("stages", ()):
            try:
                stage, times = int(entry["stage"]), (entry["forward_s_per_microbatch"],
                                                     entry["backward_s_per_microbatch"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: a stage entry is malformed ({type(exc).__name__}: {exc}): run the "
                                 "program again with `partitioner run` and refit from that run") from None
            for name, value in zip(("forward_s_per_microbatch", "backward_s_per_microbatch"), times):
                if value != 0:  # 0: nothing timed that way; the refit's scale bounds judge what it makes
                    _check_seconds(value, f"{path}: stage {stage}'s {name}")
            seen.setdefault(stage, []).append((float(times[0]), float(times[1])))
    return {s: (statistics.mean(f for f, _ in v), statistics.mean(b for _, b in v)) for s, v in seen.items()}


def _scaled_problem(problem, forward: float, backward: float, overhead_s: float | None):
    """The cpu kind's region seconds times the factors, and its per-microbatch overhead."""
    def times(mapping, factor):
        if not mapping or mapping.get(KIND) is None:
            return mapping
        return {**mapping, KIND: mapping[KIND] * factor}

    regions = tuple(dataclasses.replace(
        r, fwd_s_per_sample_by_kind=times(r.fwd_s_per_sample_by_kind, forward),
        fwd_s_per_microbatch_by_kind=times(r.fwd_s_per_microbatch_by_kind, forward),
        bwd_s_per_sample_by_kind=times(r.bwd_s_per_sample_by_kind, backward),
        bwd_s_per_microbatch_by_kind=times(r.bwd_s_per_microbatch_by_kind, backward)) for r in problem.regions)
    changes = {"regions": regions}
    if overhead_s is not None:
        changes["microbatch_overhead_s_by_kind"] = {**(problem.microbatch_overhead_s_by_kind or {}), KIND: overhead_s}
    return dataclasses.replace(problem, **changes)


def _predicted_step_s(plan, problem, cluster, assignment) -> float:
    """The plan's step as compile priced it (make_plan in partitioner/compiler.py)."""
    # lazy: loads OR-Tools
    from partitioner.solver.evaluate import evaluate
    # lazy: loads OR-Tools
    from partitioner.solver.grad_norm_cost import computes_global_norm
    # lazy: loads OR-Tools
    from partitioner.solver.zero_choice import allgather_s

    chosen = plan.decisions
    cost = evaluate(problem, cluster, assignment, sdc_every=chosen.sdc_every,
                    global_norm=computes_global_norm(plan.training.clip_grad_norm, chosen.precision))
    extra = allgather_s(problem, cluster, assignment) if chosen.shard_optimizer else 0.0
    return cost.step_time_s + extra


def _stage_compute_s(problem, cluster, assignment) -> list[tuple[float, float]]:
    """Per stage, the (forward, backward) region seconds of one microbatch the plan priced (a
    recomputed region's rerun in the backward, where the runtime runs it)."""
    # lazy: loads OR-Tools
    from partitioner.solver.problem import region_times_s
    # lazy: loads OR-Tools
    from partitioner.solver.recompute_cost import recompute_s

    b = assignment.microbatch_size
    out = []
    for s in range(assignment.num_stages):
        device = cluster.devices[assignment.device_of_stage_replica[s][0]]
        fwd = bwd = 0.0
        for r, region in enumerate(problem.regions):
            if assignment.stage_of_region[r] != s:
                continue
            f, bb = region_times_s(region, device, b)
            fwd += f
            bwd += bb + (recompute_s(problem, region, device, b) if assignment.recompute[r] else 0.0)
        out.append((fwd, bwd))
    return out


def refit_from_run(run: str | Path, profile: MachineProfile) -> RefitReport:
    """The machine profile refit to a finished run (Note [refit from a run])."""
    # lazy: loads OR-Tools
    from partitioner.inspect.explain import load_priced
    # lazy: loads OR-Tools
    from partitioner.solver.problem import core_sharing_factor

    run_dir, summary = _run_paths(run)
    folder = Path(summary.get("folder") or run_dir.parent)
    if not (folder / "plan.json").is_file():
        raise ValueError(f"{run_dir}/summary.json names program folder {folder}, which has no plan.json: pass a "
                         "run of a program folder that still exists")
    plan = Plan.load(folder)
    if summary.get("plan_hash") not in (None, plan.content_hash()):
        raise ValueError(f"{run_dir} ran plan {summary['plan_hash']}, but {folder} now holds plan "
                         f"{plan.content_hash()}: run the program again, then refit")
    if plan.tensor_parallel > 1:
        raise ValueError(f"{folder} is tensor-parallel (tp {plan.tensor_parallel}): its collectives are inside the "
                         "stage times; refit from a run of a tp 1 plan")
    record = plan.predicted.get("cpu_time_model")
    if not record:
        raise ValueError(f"{folder} was priced by the cpu preset (compiled with --no-calibrate or "
                         "PARTITIONER_NO_CALIBRATE), not by this machine's profile: compile it again without "
                         "--no-calibrate, run it, then refit")
    if record.get("measurement_id") != profile.measurement_id:
        raise ValueError(f"{folder} was priced by machine measurement {record.get('measurement_id')}, but the "
                         f"cached profile is measurement {profile.measurement_id} (measured again since): compile "
                         "it again, run it, then refit")
    problem, assignment = load_priced(folder)
    cluster = ClusterSpec.from_dict(plan.cluster)
    measured = float(summary["measured_step_time_s"])
    before = float(plan.predicted["step_time_s"])
    core = core_sharing_factor(cluster, assignment.device_of_stage_replica)
    overhead_before = float((problem.microbatch_overhead_s_by_kind or {}).get(KIND) or 0.0)
    link = cluster.intra_node_link
    # the plan's link is the profile's (not a cluster file's) and the plan sends on it: its latency may be refit
    latency_refits = (profile.link() is not None and record.get("link_latency_s") == link.latency_s
                      and assignment.num_stages > 1)

    def step_s(forward: float, backward: float, overhead: float, latency_s: float | None = None) -> float:
        on = cluster if latency_s is None else dataclasses.replace(
            cluster, intra_node_link=dataclasses.replace(link, latency_s=latency_s))
        return _predicted_step_s(plan, _scaled_problem(problem, forward, backward, overhead), on, assignment)

    def solve(f, lo: float, hi: float) -> float:
        """x with f(x) = measured, f linear in x (two evaluations)."""
        f_lo, f_hi = f(lo), f(hi)
        return lo + (measured - f_lo) * (hi - lo) / (f_hi - f_lo) if f_hi != f_lo else lo

    latency = link.latency_s
    stages = _stage_times(run_dir)
    priced = _stage_compute_s(problem, cluster, assignment)
    if stages and set(stages) == set(range(assignment.num_stages)):
        fwd_priced = sum(f for f, _ in priced) * core
        bwd_priced = sum(b for _, b in priced) * core
        forward = sum(f for f, _ in stages.values()) / fwd_priced if fwd_priced > 0 else 1.0
        backward = sum(b for _, b in stages.values()) / bwd_priced if bwd_priced > 0 else 1.0
        overhead = solve(lambda o: step_s(forward, backward, o), 0.0, _PROBE_S)
        if overhead < 0:  # the rest of the step is less than the overhead and the sends price: the sends
            overhead = 0.0  # cost less than the profile says (a busy machine when it was measured)
            if latency_refits:
                latency = max(0.0, solve(lambda x: step_s(forward, backward, 0.0, x), 0.0, link.latency_s))
            if step_s(forward, backward, 0.0, latency) > measured * (1 + 1e-9):
                # even sends at no latency price more: the stages overlapped better than the pipeline
                # formula says; the regions shrink by one factor until the step is what was measured
                k = solve(lambda x: step_s(forward * x, backward * x, 0.0, latency), 0.5, 1.0)
                forward, backward = forward * k, backward * k
        with_stage_times = True
    else:  # Note [refit from a run]: one factor for all
        forward = backward = measured / before if before > 0 else 1.0
        overhead = overhead_before * forward
        with_stage_times = False
    regions_refit = record.get("regions") == "machine"
    # what this plan is priced at now: a --calibrate profile's regions stay as they were
    after = step_s(*((forward, backward) if regions_refit else (1.0, 1.0)), overhead, latency)
    base_forward = float(record.get("forward_scale", 1.0))
    base_backward = float(record.get("backward_scale", 1.0))
    new_forward = base_forward * forward if regions_refit else profile.forward_scale
    new_backward = base_backward * backward if regions_refit else profile.backward_scale
    new_latency = latency if latency != link.latency_s else profile.link_latency_s
    try:  # Note [machine figures are bounded]: a run this profile cannot be refit to leaves it as it is
        refit = Refit(run_dir=str(run_dir.resolve()), plan_hash=plan.content_hash(), measured_step_s=measured,
                      predicted_before_s=before, predicted_after_s=after, forward_scale=new_forward,
                      backward_scale=new_backward, microbatch_overhead_s=overhead, time_unix=time.time(),
                      link_latency_s=new_latency)
        new = dataclasses.replace(profile, forward_scale=new_forward, backward_scale=new_backward,
                                  microbatch_overhead_s=overhead, link_latency_s=new_latency,
                                  refits=profile.refits + (refit,))
    except ValueError as exc:
        raise ValueError(f"{run_dir / 'summary.json'}: its step of {measured!r} s (predicted {before:.6g} s) is not "
                         f"refit, since the {exc}; check that run (was the machine swapping or suspended?) and "
                         "refit from another") from None
    return RefitReport(profile=new, run_dir=run_dir, folder=folder, measured_step_s=measured,
                       predicted_before_s=before, predicted_after_s=after, forward_scale=forward,
                       backward_scale=backward, microbatch_overhead_before_s=overhead_before,
                       microbatch_overhead_after_s=overhead, stage_times=with_stage_times,
                       link_latency_before_s=link.latency_s, link_latency_after_s=latency)
