"""Re-plan a compiled program for the ranks that are left after a host is lost (`partitioner replan`,
`partitioner run --elastic`): from the problem saved in its plan.json, without tracing the model
again, and write the new program folder beside the old one.

Note [re-plan on the same cuts]: a program folder's stage files were traced at the plan's
microbatch size and split at its cuts; re-tracing needs the user's model and takes the longest part
of a compile. So a re-plan keeps what the stage files fix, the stage cuts, the recomputed regions
and the microbatch size, and re-chooses what only plan.json says: the
data-parallel degree for the surviving ranks, the number of microbatches (the global batch stays,
so the run consumes the same samples: microbatches = global batch / (dp x microbatch size)) and the
schedule (gpipe or 1f1b; 1f1b needs microbatches >= stages, Note [only runnable plans]). Every
candidate is priced by the one cost model (``solver.evaluate.evaluate``) on the survivors' devices,
the ones that fit memory compared, the fastest kept (the old schedule, then the larger dp, on a
tie). The stage files are the old ones with the new plan hash in their header; the weights are
hard-linked (copied across filesystems), the user files copied; train.py,
README and plan.json are written new. What cannot be re-planned this way is refused with one line
naming the value and the fix (``ElasticRefusal``): fewer survivors than stages, a tensor-parallel
or interleaved plan, no candidate that fits memory. The new folder records where it came from in elastic.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from partitioner.codegen.readme import readme_source
from partitioner.config.cluster import ClusterSpec
from partitioner.config.device_presets import world_peak_flops_per_s
from partitioner.solver import serialize
from partitioner.solver.evaluate import evaluate
from partitioner.solver.grad_norm_cost import computes_global_norm
from partitioner.solver.plan import MemoryBreakdown, Plan, PlanTie
from partitioner.solver.problem import Assignment
from runtime.launch.entry_files import entry_files, refuse_old_shape
from runtime.program.parts import MemoryTierPlan, RankSpec
from runtime.program.schedules import SCHEDULES
from runtime.program.spec import Program, file_digests, load_plan, seal_plan

ELASTIC_FILE = "elastic.json"  # in a re-planned folder: what it was re-planned from, and why
# the schedules a re-plan weighs (one stage per rank: Note [re-plan on the same cuts]), 1f1b first
REPLANNED = tuple(sorted((cls() for cls in SCHEDULES.values() if cls.replans), key=lambda s: s.preference))


class ElasticRefusal(ValueError):
    """No plan on the surviving ranks runs this program exactly: the message names why and the fix."""


@dataclass(frozen=True)
class Candidate:
    dp: int
    num_microbatches: int
    schedule: str
    step_time_s: float
    peak_memory_bytes: float
    capacity_bytes: float

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class Replanned:
    plan: Plan
    program: Program
    survivors: tuple[int, ...]      # the old ranks left, in the order of the new ranks' devices
    candidates: tuple[Candidate, ...]
    old_plan_hash: str
    seconds: float                  # the re-plan's own time (loading, pricing), not the write

    def summary(self) -> str:
        p = self.plan
        return (f"re-planned {self.old_plan_hash} for {len(self.survivors)} ranks: {p.num_stages} stages x dp {p.dp}, "
                f"{p.num_microbatches} microbatches, {p.schedule}, predicted {p.predicted['step_time_s']:.4g} s/step "
                f"({len(self.candidates)} candidates priced in {self.seconds:.2f} s)")


def survivor_cluster(cluster: ClusterSpec, devices: Sequence[int]) -> ClusterSpec:
    """The cluster of the survivors' devices (old device indices), in that order, with the old links."""
    return dataclasses.replace(cluster, devices=tuple(cluster.devices[i] for i in devices))


def old_devices(assignment: Assignment, num_stages: int) -> dict[int, int]:
    """Old rank -> its device index (rank = stage * dp + replica, Note [rank layout])."""
    return {s * assignment.dp + rep: assignment.device_of_stage_replica[s][rep]
            for s in range(num_stages) for rep in range(assignment.dp)}


def candidates(problem, cluster: ClusterSpec, old: Assignment, plan: Plan, num_ranks: int) -> list[tuple]:
    """(Candidate, Assignment, CostBreakdown) of every (dp, schedule) the survivors can run on the
    same cuts (Note [re-plan on the same cuts]); ``cluster`` holds the survivors' devices."""
    p, b, g = plan.num_stages, plan.microbatch_size, plan.global_batch
    out = []
    for dp in range(num_ranks // p, 0, -1):
        if g % (dp * b):
            continue
        m = g // (dp * b)
        for schedule in REPLANNED:
            if schedule.refusal(p, m) is not None:
                continue
            a = Assignment(stage_of_region=old.stage_of_region, recompute=old.recompute,
                           device_of_stage_replica=tuple(tuple(s * dp + r for r in range(dp)) for s in range(p)),
                           num_stages=p, dp=dp, num_microbatches=m, microbatch_size=b, schedule=schedule.name)
            cost = evaluate(problem, cluster, a, sdc_every=plan.decisions.sdc_every if dp > 1 else 0,
                            global_norm=computes_global_norm(plan.training.clip_grad_norm, plan.decisions.precision))
            worst = max(cost.stages, key=lambda s: s.memory_bytes / max(s.capacity_bytes, 1))
            out.append((Candidate(dp, m, schedule.name, cost.step_time_s, worst.memory_bytes, worst.capacity_bytes), a, cost))
    return out


def refusal_for(plan: Plan, survivors: Sequence[int]) -> str | None:
    """Why this plan cannot be re-planned on ``survivors`` at all (before any pricing), or None."""
    n = len(survivors)
    if plan.tensor_parallel > 1:
        return (f"tensor parallelism {plan.tensor_parallel}: a tensor-parallel program is not re-planned (its stage "
                "files are split for that degree); compile it again for the surviving ranks with --devices "
                f"{n}, or compile without --tp")
    if not plan.pipeline_schedule.replans:
        return (f"schedule {plan.schedule}: an interleaved program is not re-planned (its stages are cut for "
                f"{plan.world_size} ranks); compile it with --schedule 1f1b or gpipe to run it --elastic")
    if n < plan.num_stages:
        return (f"{n} surviving rank{'s' if n != 1 else ''} cannot hold the {plan.num_stages} pipeline stages of "
                f"plan {plan.content_hash()} (a re-plan keeps the cuts: Note [re-plan on the same cuts]); bring "
                f"back at least {plan.num_stages - n} rank(s), or compile again for {n} devices")
    return None


def replan(folder: str | Path, survivors: Sequence[int]) -> Replanned:
    """The plan and program for the old ranks ``survivors`` of the program in ``folder``; an
    ElasticRefusal when none runs (Note [re-plan on the same cuts])."""
    t0 = time.perf_counter()
    folder = Path(folder)
    body = load_plan(str(folder))  # bounded (Note [files are not trusted])
    plan = Plan.from_dict(body)
    survivors = tuple(survivors)
    bad = [r for r in survivors if not 0 <= r < plan.world_size]
    if bad or len(set(survivors)) != len(survivors) or not survivors:
        raise ElasticRefusal(f"--ranks {','.join(map(str, survivors))}: give distinct ranks of the program's "
                             f"{plan.world_size} (0..{plan.world_size - 1}), comma-separated")
    if "problem" not in body or "assignment" not in body:
        raise ElasticRefusal(f"{folder}/plan.json holds no saved problem (\"problem\", \"assignment\"): recompile it "
                             "with `partitioner compile` to re-plan it")
    why = refusal_for(plan, survivors)
    if why:
        raise ElasticRefusal(why)
    problem = serialize.problem_from_dict(body["problem"])
    old = serialize.assignment_from_dict(body["assignment"])
    devices_of = old_devices(old, plan.num_stages)
    cluster = survivor_cluster(ClusterSpec.from_dict(body["cluster"]), [devices_of[r] for r in sorted(survivors)])
    priced = candidates(problem, cluster, old, plan, len(survivors))
    fitting = [c for c in priced if c[0].fits]
    if not fitting:
        best = min(priced, key=lambda c: c[0].peak_memory_bytes / max(c[0].capacity_bytes, 1))[0]
        raise ElasticRefusal(f"no plan of {plan.num_stages} stages fits the {len(survivors)} surviving ranks' memory: "
                             f"the smallest needs {best.peak_memory_bytes / 2**20:.1f} MiB on a device of "
                             f"{best.capacity_bytes / 2**20:.1f} MiB (dp {best.dp}); bring back ranks, or compile "
                             "again with --granularity op or recompute for fewer devices")
    chosen, assignment, cost = min(fitting, key=lambda c: (c[0].step_time_s, c[1].pipeline_schedule != plan.pipeline_schedule,
                                                           -c[0].dp))
    new_plan = _plan_of(plan, cluster, assignment, cost)
    program = _program_of(body, new_plan)
    return Replanned(new_plan, program, tuple(sorted(survivors)), tuple(c[0] for c in priced),
                     plan.content_hash(), time.perf_counter() - t0)


def _plan_of(plan: Plan, cluster: ClusterSpec, a: Assignment, cost) -> Plan:
    """The old plan with the new layout's figures (the stage cuts, regions and cut edges unchanged)."""
    stages = tuple(dataclasses.replace(
        old, ranks=tuple(a.rank_of(s, rep) for rep in range(a.dp)),
        compute_time_s=sc.compute_s, comm_time_s=sc.comm_s, predicted_time_s=sc.time_s,
        memory=MemoryBreakdown(*(int(x) for x in (sc.params_bytes, sc.grads_bytes, sc.optimizer_bytes,
                                                  sc.activations_bytes, sc.buffers_bytes, sc.transient_bytes,
                                                  sc.step_buffers_bytes))),
        peak_memory_bytes=int(sc.memory_bytes), memory_capacity_bytes=int(sc.capacity_bytes),
        nodes=tuple(cluster.devices[i].node for i in a.device_of_stage_replica[s]))
        for s, (old, sc) in enumerate(zip(plan.stages, cost.stages)))
    ties = tuple(dataclasses.replace(t, cost_s=next((c.cost_s for c in cost.ties if tuple(c.stages) == t.stages),
                                                    t.cost_s)) if isinstance(t, PlanTie) else t for t in plan.ties)
    decisions = plan.decisions
    if decisions.memory_tier is not None:
        decisions = dataclasses.replace(decisions, memory_tier=_memory_tier(decisions.memory_tier, stages, cluster, a))
    step = cost.step_time_s
    predicted = {**plan.predicted, "step_time_s": step, "bubble_fraction": cost.bubble_fraction,
                 "samples_per_s": plan.global_batch / step if step > 0 else 0.0,
                 "sdc_check_s_per_step": cost.sdc_check_s, "grad_norm_s_per_step": cost.grad_norm_s}
    solver = {**plan.solver, "status": "REPLANNED", "objective": step, "bound": None}
    return dataclasses.replace(plan, dp=a.dp, num_microbatches=a.num_microbatches, schedule=a.schedule,
                               world_size=a.num_stages * a.dp, stages=stages, ties=ties, predicted=predicted,
                               solver=solver, cluster=cluster.to_dict(), decisions=decisions)


def _memory_tier(old: dict, stages, cluster: ClusterSpec, a: Assignment) -> dict:
    """The memory tier's redundancy for the new layout, decided as compile decides it (the old
    plan's request and interval kept)."""
    # lazy: the compiler's module loads the tracing passes; only a plan with a memory tier needs it
    from partitioner.compiler import memory_tier_choice

    requested = old.get("requested", old.get("mode", "auto"))
    choice = memory_tier_choice({"mode": requested if requested in ("auto", "none") else "auto",
                                 "group_size": old.get("group_size"), "every": old.get("every", 1)}, stages, cluster, a)
    return {**old, **{k: v for k, v in choice.items() if k not in ("requested", "every")}}


def _program_of(body: dict, plan: Plan) -> Program:
    """The old program object with the new layout (the stages, data and settings unchanged)."""
    old = Program.from_dict(body["program"])
    tier = plan.decisions.memory_tier
    return dataclasses.replace(
        old, world_size=plan.world_size, dp=plan.dp, num_microbatches=plan.num_microbatches, schedule=plan.schedule,
        ranks=tuple(RankSpec(**r) for r in plan.rank_layout()),
        predicted_step_time_s=float(plan.predicted["step_time_s"]),
        peak_flops_per_s=world_peak_flops_per_s(plan.stages, plan.tensor_parallel, old.precision.dtype_name),
        memory_tier=MemoryTierPlan(mode=tier["mode"], every=int(tier.get("every", 1)),
                                   group_size=tier.get("group_size")) if tier else old.memory_tier,
        plan_hash=None)


def write_replanned(folder: str | Path, replanned: Replanned, out: str | Path, *, reason: dict | None = None) -> Path:
    """The re-planned program folder ``out``, written atomically beside nothing it overwrites but an
    older program folder (Note [re-plan on the same cuts])."""
    folder, out = Path(folder), Path(out)
    body = load_plan(str(folder))
    refuse_old_shape(str(folder), body)  # Note [roles from the plan] in runtime/launch/entry_files.py
    plan, program = replanned.plan, replanned.program
    new_hash = plan.content_hash()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name in sorted(body.get("files", {})):
            src, dst = folder / name, tmp / name
            if name in ("train.py", "README.md"):
                continue  # written new below
            dst.parent.mkdir(parents=True, exist_ok=True)
            if name.startswith("stage_") and name.endswith(".py"):
                dst.write_text(src.read_text().replace(replanned.old_plan_hash, new_hash))
            elif name.startswith("weights/"):
                _link_or_copy(src, dst)  # a large model's weights: no second copy on the same disk
            else:
                shutil.copyfile(src, dst)
        files = dict(entry_files(program))
        files["README.md"] = readme_source(plan, new_hash)
        for name, text in files.items():
            (tmp / name).write_text(text)
        (tmp / ELASTIC_FILE).write_text(json.dumps({
            "replanned_from": str(folder.resolve()), "old_plan_hash": replanned.old_plan_hash,
            "survivors": list(replanned.survivors), "reason": reason or {},
            "candidates": [dataclasses.asdict(c) for c in replanned.candidates]}, indent=1, sort_keys=True) + "\n")
        new_body = plan.stable_dict()
        new_body["plan_hash"] = new_hash
        new_body["program"] = program.to_dict()
        new_body["problem"] = body["problem"]
        assignment = serialize.assignment_from_dict(body["assignment"])
        new_body["assignment"] = serialize.to_dict(dataclasses.replace(
            assignment, dp=plan.dp, num_microbatches=plan.num_microbatches, schedule=plan.schedule,
            device_of_stage_replica=tuple(tuple(s * plan.dp + r for r in range(plan.dp))
                                          for s in range(plan.num_stages))))
        new_body = seal_plan(new_body, file_digests(str(tmp)))
        (tmp / "plan.json").write_text(json.dumps(new_body, indent=1, sort_keys=True) + "\n")
        if out.exists():
            if not (out / "plan.json").exists() and any(out.iterdir()):
                raise ElasticRefusal(f"{out} exists and is not a program folder: choose another -o DIR")
            shutil.rmtree(out)
        os.replace(tmp, out)
        os.chmod(out, 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed there
        shutil.copyfile(src, dst)
