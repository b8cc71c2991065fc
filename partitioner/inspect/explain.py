"""`partitioner inspect --node NAME`: where a graph node sits, what its region costs, and what moving
the region to a neighbouring stage would do to the predicted step.

Note [priced moves]
    Moves are priced by the solver's own cost model (``evaluate`` and ``structural_violations``
    in partitioner/solver/evaluate.py and check.py) on the solver's own problem and assignment, which the compiler
    stores in plan.json beside the plan (partitioner/solver/serialize.py). So a move's figures
    are the ones the solver would have seen, with no estimate in between.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from partitioner.config.cluster import ClusterSpec
from partitioner.inspect.units import held, human_bytes, ms, si
from partitioner.solver.check import structural_violations
from partitioner.solver.evaluate import evaluate
from partitioner.solver.problem import Assignment, PartitionProblem
from partitioner.solver.schedules import priced_schedule
from partitioner.solver.serialize import assignment_from_dict, problem_from_dict
from runtime.file_trust import read_bounded

if TYPE_CHECKING:  # annotations only
    from partitioner.solver.plan import Plan


COST_MODEL = ("the solver's own cost model on the problem plan.json stores (Note [priced moves] in "
              "partitioner/inspect/explain.py)")


def load_priced(path: str | Path) -> tuple[PartitionProblem, Assignment]:
    """The solver's problem and assignment that plan.json (or the program folder's) keeps."""
    path = Path(path)
    if path.is_dir():
        path = path / "plan.json"
    body = json.loads(read_bounded(str(path), follow=True))  # Note [files are not trusted]
    missing = [key for key in ("problem", "assignment") if key not in body]
    if missing:
        raise ValueError(f"{path} has no {' or '.join(missing)}: it was written before plans kept the solver's "
                         "problem, so --node cannot price moves; recompile it with `partitioner compile`")
    if not isinstance(body["problem"], dict) or not isinstance(body["assignment"], dict):
        raise ValueError(f"{path}: its problem and assignment must be JSON objects, they are "
                         f"{type(body['problem']).__name__} and {type(body['assignment']).__name__}: the file was "
                         "edited or damaged; recompile it with `partitioner compile`")
    try:
        return problem_from_dict(body["problem"]), assignment_from_dict(body["assignment"])
    except (AttributeError, TypeError, KeyError, IndexError) as exc:  # a field of the wrong shape deep inside
        raise ValueError(f"{path}: its problem or assignment is malformed ({type(exc).__name__}: {exc}): the file "
                         "was edited or damaged; recompile it with `partitioner compile`") from None


def _node_index(plan: Plan) -> dict[str, int]:
    index = {}
    for r in plan.regions:
        for n in r.nodes:
            index.setdefault(n, r.id)
    for r in plan.regions:
        index.setdefault(r.name, r.id)
    return index


def find_region(plan: Plan, name: str) -> int:
    """The region holding graph node (or region) ``name``; ValueError with close matches if none."""
    index = _node_index(plan)
    if name in index:
        return index[name]
    close = difflib.get_close_matches(name, list(index), n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else \
        f"region names: {', '.join(r.name for r in plan.regions[:8])}{' ...' if len(plan.regions) > 8 else ''}"
    raise ValueError(f"--node {name!r} is not a node or region of plan {plan.content_hash()}; {hint} "
                     "(`partitioner inspect DIR --json` lists every region's nodes)")


def _check_matches(plan: Plan, problem: PartitionProblem, assignment: Assignment) -> None:
    """The stored problem must be this plan's: same regions, same stage of each."""
    stages = tuple(r.stage for r in sorted(plan.regions, key=lambda r: r.id))
    names = tuple(r.name for r in sorted(plan.regions, key=lambda r: r.id))
    if tuple(r.name for r in problem.regions) != names or tuple(assignment.stage_of_region) != stages:
        raise ValueError(f"the solver problem stored with plan {plan.content_hash()} describes other regions or "
                         "stages than the plan: the file was edited; recompile it with `partitioner compile`")


def explain_node(plan: Plan, name: str, problem: PartitionProblem, assignment: Assignment) -> dict:
    """Where ``name`` sits, what its region costs, and what moving the region (with every region
    between it and the stage boundary, to keep stages contiguous) to a neighbouring stage would do
    to the predicted step time. ``problem`` and ``assignment``: the solver's, as ``load_priced``
    reads them (Note [priced moves])."""
    rid = find_region(plan, name)
    region = next(r for r in plan.regions if r.id == rid)
    by_id = {r.id: r for r in plan.regions}
    stage = plan.stages[region.stage]
    b = plan.microbatch_size
    before = by_id.get(rid - 1)
    after = by_id.get(rid + 1)
    cuts_in = [e for e in plan.cut_edges if e.dst_region == rid]
    cuts_out = [e for e in plan.cut_edges if e.src_region == rid]
    out = {
        "node": name, "plan_hash": plan.content_hash(),
        "region": {"id": rid, "name": region.name, "layer": region.layer, "recompute": region.recompute,
                   "num_nodes": len(region.nodes), "flops_fwd_per_sample": region.fwd_flops,
                   "flops_bwd_per_sample": region.bwd_flops, "param_bytes": region.param_bytes,
                   "activation_bytes_per_sample": region.activation_bytes},
        "stage": {"index": stage.index, "ranks": list(stage.ranks), "device": stage.device,
                  "regions": list(stage.region_names), "predicted_time_s": stage.predicted_time_s,
                  "share_of_stage_flops": ((region.fwd_flops + region.bwd_flops) * b /
                                           (stage.fwd_flops + stage.bwd_flops)
                                           if stage.fwd_flops + stage.bwd_flops > 0 else 0.0)},
        "neighbours": {"before": None if before is None else {"region": before.name, "stage": before.stage},
                       "after": None if after is None else {"region": after.name, "stage": after.stage}},
        "cut_edges": {"in": [list(e.tensors) for e in cuts_in], "out": [list(e.tensors) for e in cuts_out]},
        "moves": [],
        "cost_model": COST_MODEL,
    }
    if plan.num_stages == 1:
        out["verdict"] = "the plan has one stage: every region is on stage 0"
        return out
    try:
        priced_schedule(plan.schedule)
    except ValueError as unknown:
        out["verdict"] = f"no cost estimate for moves: {unknown}"
        return out

    _check_matches(plan, problem, assignment)
    cluster = ClusterSpec.from_dict(plan.cluster)
    sdc_every = plan.decisions.sdc_every  # priced in the plan's step (Note [cost model])
    now_step = evaluate(problem, cluster, assignment, sdc_every=sdc_every).step_time_s
    out["repriced_step_time_s"] = now_step
    out["plan_step_time_s"] = plan.predicted["step_time_s"]
    out["repriced_error"] = abs(now_step - plan.predicted["step_time_s"]) / plan.predicted["step_time_s"]
    members = list(stage.regions)
    for direction, target in (("earlier", stage.index - 1), ("later", stage.index + 1)):
        if not 0 <= target < plan.num_stages:
            continue
        moved = [r for r in members if r <= rid] if direction == "earlier" else [r for r in members if r >= rid]
        move = {"to_stage": target, "regions": [by_id[r].name for r in moved]}
        out["moves"].append(move)
        if len(moved) == len(members):
            move["possible"] = False
            move["why_not"] = (f"stage {stage.index} would be empty (the plan has {plan.num_stages} stages)"
                               if len(moved) == 1 else
                               f"stages stay contiguous, so {held(move['regions'])} would all move and "
                               f"stage {stage.index} would be empty")
            continue
        stage_of = list(assignment.stage_of_region)
        for r in moved:
            stage_of[r] = target
        trial = dataclasses.replace(assignment, stage_of_region=tuple(stage_of))
        violations = structural_violations(problem, cluster, trial)
        if violations:
            move["possible"] = False
            move["why_not"] = violations[0]
            continue
        cost = evaluate(problem, cluster, trial, sdc_every=sdc_every)
        step = cost.step_time_s
        bottleneck = max(range(plan.num_stages), key=lambda s: cost.stages[s].time_s)
        over = [s for s, st in enumerate(cost.stages) if st.memory_bytes > st.capacity_bytes]
        move.update({
            "possible": True, "step_time_s": step, "change": step / now_step - 1.0,
            "stage_times_s": [st.time_s for st in cost.stages], "bottleneck_stage": bottleneck,
            "bottleneck_time_s": cost.stages[bottleneck].time_s,
            "peak_memory_bytes": [int(st.memory_bytes) for st in cost.stages], "fits_memory": not over,
            "over_capacity_stages": over,
        })
    priced = [m for m in out["moves"] if m.get("possible")]
    if not priced:
        out["verdict"] = "no neighbouring stage can take its region without emptying a stage"
    elif all(m["change"] >= -1e-9 or not m["fits_memory"] for m in priced):
        best = min(priced, key=lambda m: m["step_time_s"])
        if not best["fits_memory"]:
            why = f"does not fit memory (stages {best['over_capacity_stages']} over capacity)"
        else:
            why = (f"makes stage {best['bottleneck_stage']} the bottleneck at {ms(best['bottleneck_time_s'])} ms/mb "
                   f"and changes the step by {best['change'] * 100:+.1f}%")
        out["verdict"] = f"stays on stage {stage.index}: the cheapest move (to stage {best['to_stage']}) {why}"
    else:
        best = min((m for m in priced if m["fits_memory"]), key=lambda m: m["step_time_s"])
        out["verdict"] = (f"moving to stage {best['to_stage']} would be {-best['change'] * 100:.1f}% faster "
                          f"(solver status {plan.solver['status']}, gap {(plan.solver.get('gap') or 0) * 100:.2f}%: "
                          "it stopped before proving this plan optimal)")
    if out["repriced_error"] > 0.01:
        out["verdict"] += (f" (the stored problem prices this plan {out['repriced_error'] * 100:.1f}% off the plan's "
                           "own step time: plan and problem disagree; recompile before trusting these figures)")
    return out


def explain_text(info: dict) -> str:
    r, s = info["region"], info["stage"]
    lines = [
        f"node {info['node']} is in region {r['name']} (id {r['id']}"
        + (f", layer {r['layer']}" if r["layer"] is not None else "") + f", {r['num_nodes']} graph nodes)"
        f" on stage {s['index']} (rank(s) {','.join(map(str, s['ranks']))}, {s['device']})",
        f"region costs    fwd {si(r['flops_fwd_per_sample'])} FLOP/sample, bwd {si(r['flops_bwd_per_sample'])} "
        f"FLOP/sample, params {human_bytes(r['param_bytes'])}, saved activations "
        f"{human_bytes(r['activation_bytes_per_sample'])}/sample, recompute {'yes' if r['recompute'] else 'no'}",
        f"stage {s['index']}         {held(s['regions'])}, {ms(s['predicted_time_s'])} ms/mb; this region does "
        f"{s['share_of_stage_flops'] * 100:.1f}% of its FLOPs",
    ]
    nb = info["neighbours"]
    parts = []
    for side in ("before", "after"):
        if nb[side] is not None:
            parts.append(f"{side} {nb[side]['region']} (stage {nb[side]['stage']})")
    lines.append("neighbours      " + (", ".join(parts) or "none"))
    if info["cut_edges"]["in"] or info["cut_edges"]["out"]:
        lines.append("cut edges       " + "; ".join(
            [f"in {', '.join(t)}" for t in info["cut_edges"]["in"]] + [f"out {', '.join(t)}" for t in info["cut_edges"]["out"]]))
    if "repriced_step_time_s" in info:
        lines.append(f"cost model      the solver's, on its stored problem: step {ms(info['repriced_step_time_s'])} ms "
                     f"(plan says {ms(info['plan_step_time_s'])} ms, {info['repriced_error'] * 100:.2f}% apart)")
    for m in info["moves"]:
        moved = m["regions"][0] if len(m["regions"]) == 1 else f"{held(m['regions'])}"
        if not m.get("possible"):
            lines.append(f"move to stage {m['to_stage']}: not possible ({m['why_not']})")
            continue
        times = " / ".join(ms(t) for t in m["stage_times_s"])
        lines.append(f"move to stage {m['to_stage']} ({moved}): step {ms(m['step_time_s'])} ms ({m['change'] * 100:+.1f}%), "
                     f"stage times {times} ms/mb, bottleneck stage {m['bottleneck_stage']}, "
                     + ("fits memory" if m["fits_memory"] else f"stages {m['over_capacity_stages']} over capacity"))
    lines.append("verdict         " + info["verdict"])
    if info["moves"]:
        lines.append("note            moves priced by " + info["cost_model"])
    return "\n".join(lines)

