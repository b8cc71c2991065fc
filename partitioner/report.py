"""Plans for people: the table `partitioner inspect` and `Plan.summary()` print, the JSON scripts
read (DESIGN section 11), the region graph as Graphviz, one self-contained HTML page, and the
answer to "why is this node on this stage?".

Everything here reads a Plan only (plain data, no torch, no model): a plan.json copied off a
cluster can be inspected anywhere.

Note [rebuilt cost model]
    `explain_node` prices moving a region to a neighbouring stage with the solver's own
    ``evaluate`` (Note [cost model] in partitioner/solver/check.py), on a PartitionProblem rebuilt
    from plan.json. The plan keeps every region's flops, parameter and saved-activation bytes
    (per sample), the cut edges and the cluster, but not the full region edge list, per-region
    gradient/optimizer bytes, nor which regions a tied parameter spans. So:
    * gradient and optimizer bytes of a region = its parameter bytes x its stage's grads/params
      and optimizer/params ratios;
    * the region graph is the chain of regions in topological order plus the plan's cut edges;
      the chain edge that a move turns into the new stage boundary is assumed to carry as many
      bytes as the boundary it replaces (exact for a transformer's constant-width residual
      stream, an estimate elsewhere);
    * tied parameters keep their placement and cost;
    * stage s runs on the device the solver's placement gives it (``place_stages``).
    The rebuilt model re-prices the plan as it stands first; the explanation prints how far that
    is from the plan's own figure, so a reader can tell how much the estimate is worth.
"""

from __future__ import annotations

import difflib
import html
import json
import math
import os
import tempfile
from pathlib import Path

from partitioner.plan import Plan

KIB, MIB, GIB = 2**10, 2**20, 2**30

# Colours of stages 0, 1, ... (Tableau 10); further stages cycle.
STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                 "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")


def stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


# ---------------------------------------------------------------------------------------------
# Units


def _si(value: float) -> str:
    """1234567 -> '1.23M' (for counts and FLOPs; the unit sits in the column header)."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.0f}"


def _byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit a column of byte counts is written in, chosen by its largest entry."""
    if largest >= GIB:
        return "GiB", GIB
    if largest >= MIB:
        return "MiB", MIB
    return "KiB", KIB


def human_bytes(num_bytes: float) -> str:
    unit, scale = _byte_unit(num_bytes)
    if num_bytes < KIB:
        return f"{num_bytes:.0f} B"
    return f"{num_bytes / scale:.1f} {unit}" if num_bytes / scale < 1000 else f"{num_bytes / scale:.0f} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _held(names) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def _render_columns(header: list[str], units: list[str], rows: list[list[str]], align: str) -> list[str]:
    """Columns padded to their widest cell; ``align`` is one '<' or '>' per column."""
    widths = [max(len(c) for c in col) for col in zip(header, units, *rows)]

    def line(cells):
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths)).rstrip()

    out = [line(header)]
    if any(units):
        out.append(line(units))
    out += [line(r) for r in rows]
    return out


# ---------------------------------------------------------------------------------------------
# Derived figures


def balance(plan: Plan) -> dict:
    times = [s.predicted_time_s for s in plan.stages]
    mems = [s.peak_memory_bytes for s in plan.stages]
    mean_t = sum(times) / len(times)
    mean_m = sum(mems) / len(mems)
    return {"time_max_over_mean": max(times) / mean_t if mean_t > 0 else 1.0,
            "memory_max_over_mean": max(mems) / mean_m if mean_m > 0 else 1.0}


def samples_per_s(plan: Plan) -> float:
    step = plan.predicted["step_time_s"]
    return plan.predicted.get("samples_per_s") or (plan.global_batch / step if step > 0 else 0.0)


# ---------------------------------------------------------------------------------------------
# The terminal table


def table(plan: Plan) -> str:
    p = plan.predicted
    lines = [
        f"plan {plan.content_hash()}  {plan.workload}",
        f"{plan.num_stages} stage(s) x {plan.dp} data-parallel = {plan.world_size} rank(s); "
        f"{plan.num_microbatches} microbatches of {plan.microbatch_size} (global batch {plan.global_batch}); "
        f"schedule {plan.schedule}",
        "",
    ]
    mem_unit, mem_scale = _byte_unit(max(s.peak_memory_bytes for s in plan.stages))
    send_unit, send_scale = _byte_unit(max([s.send_bytes for s in plan.stages] + [1]))
    header = ["stage", "ranks", "device", "regions held", "params", "fwd FLOP", "bwd FLOP", "compute",
              "comm", "time", "weights", "grads", "optim", "activ", "buffers", "transient", "peak", "capacity",
              "used", "send"]
    units = ["", "", "", "", "", "/mb", "/mb", "ms/mb", "ms/mb", "ms/mb", mem_unit, mem_unit, mem_unit,
             mem_unit, mem_unit, mem_unit, mem_unit, "GiB", "%", f"{send_unit}/mb"]
    align = "><<<>>>>>>>>>>>>>>>>"
    rows = []
    for s in plan.stages:
        m = s.memory
        mem = [f"{b / mem_scale:.1f}" for b in (m.params_bytes, m.grads_bytes, m.optimizer_bytes,
                                                m.activations_bytes, m.buffers_bytes, m.transient_bytes,
                                                s.peak_memory_bytes)]
        used = 100.0 * s.peak_memory_bytes / s.memory_capacity_bytes if s.memory_capacity_bytes else 0.0
        rows.append([str(s.index), ",".join(map(str, s.ranks)), s.device, _held(s.region_names), _si(s.params),
                     _si(s.flops_fwd), _si(s.flops_bwd), _ms(s.compute_time_s), _ms(s.comm_time_s),
                     _ms(s.predicted_time_s), *mem, f"{s.memory_capacity_bytes / GIB:.1f}",
                     "<0.01" if used < 0.01 else f"{used:.2f}" if used < 10 else f"{used:.1f}",
                     f"{s.send_bytes / send_scale:.1f}" if s.send_bytes else "-"])
    lines += _render_columns(header, units, rows, align)

    bal = balance(plan)
    solver = plan.solver
    lower = p["lower_bound_step_time_s"]
    lines += [
        "",
        f"predicted step  {_ms(p['step_time_s'])} ms, {samples_per_s(plan):.1f} samples/s, "
        f"bubble {p['bubble_fraction'] * 100:.1f}%, lower bound {_ms(lower)} ms"
        + (f" (step is {p['step_time_s'] / lower:.2f}x it)" if lower > 0 else ""),
        f"balance         max/mean stage time {bal['time_max_over_mean']:.3f}, "
        f"max/mean peak memory {bal['memory_max_over_mean']:.3f}",
        f"solver          {solver['status']}, objective {solver['objective']:.6g}, bound {solver['bound']:.6g}, "
        f"gap {solver.get('gap', 0.0) * 100:.2f}%, {solver.get('solve_time_s', 0.0):.2f} s",
    ]

    base_rows = [["ours", _ms(p["step_time_s"]), f"{samples_per_s(plan):.1f}", "1.00x"]]
    for name in ("uniform", "param_balanced"):
        t = (plan.baselines.get(name) or {}).get("step_time_s")
        if t:
            base_rows.append([name, _ms(t), f"{plan.global_batch / t:.1f}", f"{t / p['step_time_s']:.2f}x"])
        elif name in plan.baselines:
            base_rows.append([name, "-", "-", "n/a"])
    lines += ["", "baselines (same cost model)"]
    lines += ["  " + x for x in _render_columns(["split", "step", "samples/s", "vs ours"],
                                                 ["", "ms", "", "time"], base_rows, "<>>>")]

    lines += ["", "cut edges"]
    if plan.cut_edges:
        names = {r.id: r.name for r in plan.regions}
        cut_unit, cut_scale = _byte_unit(max(e.bytes_per_microbatch for e in plan.cut_edges))
        cut_rows = []
        for e in plan.cut_edges:
            for i, (tensor, shape) in enumerate(zip(e.tensors, e.shapes)):
                first = i == 0
                cut_rows.append([
                    tensor, "x".join(map(str, shape)) or "scalar",
                    f"{e.bytes_per_microbatch / cut_scale:.1f}" if first else "",
                    f"{names.get(e.src_region, e.src_region)} -> {names.get(e.dst_region, e.dst_region)}" if first else "",
                    ",".join(f"{b}|{b + 1}" for b in e.boundaries) if first else ""])
        lines += ["  " + x for x in _render_columns(["tensor", "shape", "bytes", "regions", "boundaries"],
                                                     ["", "", f"{cut_unit}/mb", "", ""], cut_rows, "<<><<")]
    else:
        lines.append("  none (one stage)")
    for t in plan.ties:
        lines.append(f"tied parameter {t.param}: {t.placement} on stages {list(t.stages)}, "
                     f"costs {_ms(t.cost_s)} ms/step")
    if plan.training.get("memory_tier"):
        lines.append(memory_tier_line(plan.training["memory_tier"]))
    return "\n".join(lines)


def memory_tier_line(choice: dict) -> str:
    """The plan's memory tier: redundancy, groups, and the host memory it costs."""
    unit, scale = _byte_unit(max(choice["per_host_bytes"] + [1]))
    what = {"none": "no redundancy (one host: covers worker crashes, not a lost host)",
            "copy": "full copy on a peer host", "parity": f"XOR parity over groups of {choice['group_size']} hosts"}
    extra = [r / s for r, s in zip(choice["redundancy_bytes"], choice["own_bytes"]) if s]
    return (f"memory tier     every {choice['every']} step(s), {what.get(choice['mode'], choice['mode'])}"
            + (f", groups {choice['groups']}" if choice["mode"] != "none" else "")
            + f"; host memory {', '.join(f'{b / scale:.1f}' for b in choice['per_host_bytes'])} {unit} per host"
            + (f" (redundancy {max(extra):.2f} x the own snapshots)" if extra and choice["mode"] != "none" else "")
            + " (two slots each)")


# ---------------------------------------------------------------------------------------------
# JSON


def inspect_json(plan: Plan) -> dict:
    """The fields DESIGN section 11 promises, and more beside them (never fewer, never renamed)."""
    stages = []
    for s in plan.stages:
        m = s.memory
        stages.append({
            # DESIGN 11
            "index": s.index, "ranks": list(s.ranks), "device": s.device, "regions": list(s.region_names),
            "params": s.params, "flops_fwd": s.flops_fwd, "flops_bwd": s.flops_bwd,
            "predicted_time_s": s.predicted_time_s, "peak_memory_bytes": s.peak_memory_bytes,
            "memory_capacity_bytes": s.memory_capacity_bytes, "send_bytes": s.send_bytes,
            # extensions
            "region_ids": list(s.regions), "compute_time_s": s.compute_time_s, "comm_time_s": s.comm_time_s,
            "memory": {"params_bytes": m.params_bytes, "grads_bytes": m.grads_bytes,
                       "optimizer_bytes": m.optimizer_bytes, "activations_bytes": m.activations_bytes,
                       "buffers_bytes": m.buffers_bytes, "transient_bytes": m.transient_bytes,
                       "step_buffers_bytes": m.step_buffers_bytes},
        })
    predicted = {k: plan.predicted[k] for k in ("step_time_s", "bubble_fraction", "lower_bound_step_time_s")}
    predicted["samples_per_s"] = samples_per_s(plan)
    solver = {k: plan.solver.get(k) for k in ("status", "objective", "bound", "solve_time_s")}
    solver["gap"] = plan.solver.get("gap", 0.0)
    return {
        "plan_hash": plan.content_hash(),
        "workload": plan.workload,
        "num_stages": plan.num_stages,
        "dp": plan.dp,
        "microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "global_batch": plan.global_batch,
        "schedule": plan.schedule,
        "world_size": plan.world_size,
        "predicted": predicted,
        "balance": balance(plan),
        "solver": solver,
        "stages": stages,
        "cut_edges": [{"src_region": e.src_region, "dst_region": e.dst_region, "tensors": list(e.tensors),
                       "shapes": [list(x) for x in e.shapes], "bytes_per_microbatch": e.bytes_per_microbatch,
                       "boundaries": list(e.boundaries)} for e in plan.cut_edges],
        "ties": [{"param": t.param, "stages": list(t.stages), "placement": t.placement, "cost_s": t.cost_s}
                 for t in plan.ties],
        "regions": [{"id": r.id, "name": r.name, "stage": r.stage, "layer": r.layer, "recompute": r.recompute,
                     "flops_fwd_per_sample": r.flops_fwd, "flops_bwd_per_sample": r.flops_bwd,
                     "param_bytes": r.param_bytes, "activation_bytes_per_sample": r.activation_bytes,
                     "nodes": list(r.nodes)} for r in plan.regions],
        "baselines": {name: {"step_time_s": b.get("step_time_s")} for name, b in plan.baselines.items()},
        **({"memory_tier": plan.training["memory_tier"]} if plan.training.get("memory_tier") else {}),
    }


# ---------------------------------------------------------------------------------------------
# Graphviz


def region_graph_edges(plan: Plan) -> list[tuple[int, int, str]]:
    """(src, dst, kind) for drawing: "cut" edges from the plan, and "stage" edges joining
    consecutive regions of one stage (the plan records only the edges that cross a boundary)."""
    edges = [(e.src_region, e.dst_region, "cut") for e in plan.cut_edges]
    for s in plan.stages:
        edges += [(a, b, "stage") for a, b in zip(s.regions, s.regions[1:])]
    return edges


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot(plan: Plan) -> str:
    lines = [
        f"// plan {plan.content_hash()}: regions coloured by stage. Solid edges join consecutive regions",
        "// of a stage (the plan keeps only edges that cross stages); bold red edges are the cut edges.",
        "digraph plan {",
        "  rankdir=LR;",
        '  graph [fontname="Helvetica", label=' + _dot_quote(
            f"{plan.workload}: {plan.num_stages} stages x dp {plan.dp}, {plan.schedule}, "
            f"step {_ms(plan.predicted['step_time_s'])} ms") + ", labelloc=t];",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    by_stage = {s.index: [] for s in plan.stages}
    for r in plan.regions:
        by_stage.setdefault(r.stage, []).append(r)
    for s in plan.stages:
        colour = stage_colour(s.index)
        lines.append(f"  subgraph cluster_stage{s.index} {{")
        lines.append("    label=" + _dot_quote(f"stage {s.index}: rank(s) {','.join(map(str, s.ranks))}, {s.device}, "
                                                f"{_ms(s.predicted_time_s)} ms/mb, {human_bytes(s.peak_memory_bytes)}")
                     + f'; color="{colour}"; penwidth=2;')
        for r in by_stage.get(s.index, []):
            label = (f"{r.name}\n{_si(r.flops_fwd + r.flops_bwd)} FLOP/sample\n{human_bytes(r.param_bytes)} params"
                     + ("\nrecompute" if r.recompute else ""))
            lines.append(f"    r{r.id} [label={_dot_quote(label)}, fillcolor=\"{colour}\", fontcolor=white];")
        lines.append("  }")
    cut_label = {}
    for e in plan.cut_edges:
        tensors = ", ".join(e.tensors[:3]) + (f" +{len(e.tensors) - 3}" if len(e.tensors) > 3 else "")
        cut_label[(e.src_region, e.dst_region)] = f"{tensors}\n{human_bytes(e.bytes_per_microbatch)}/mb"
    for src, dst, kind in region_graph_edges(plan):
        if kind == "cut":
            lines.append(f"  r{src} -> r{dst} [label={_dot_quote(cut_label[(src, dst)])}, color=\"#d62728\", "
                         "penwidth=2.5];")
        else:
            lines.append(f"  r{src} -> r{dst};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The predicted pipeline timeline


def _stage_fwd_bwd_s(plan: Plan) -> list[tuple[float, float]]:
    """Per stage, (forward, backward) seconds of one microbatch: the stage's predicted time (compute
    + communication, what the cost model sums) split in the ratio of its forward and backward
    FLOPs, a recomputed region's forward counted again in backward."""
    b = plan.microbatch_size
    out = []
    for s in plan.stages:
        recomputed = sum(r.flops_fwd for r in plan.regions if r.stage == s.index and r.recompute) * b
        total = s.flops_fwd + s.flops_bwd + recomputed
        share = s.flops_fwd / total if total > 0 else 1 / 3
        out.append((s.predicted_time_s * share, s.predicted_time_s * (1 - share)))
    return out


def timeline(plan: Plan) -> dict:
    """One step of one data-parallel replica: for every rank of the pipeline, its forward (F) and
    backward (B) of every microbatch as [start, end) seconds. The order on each rank is the one
    ``runtime.schedule.simulate`` gives (torch.distributed.pipelining's); F of stage s waits for
    F of stage s-1, B of stage s for its own F and B of stage s+1."""
    from runtime.schedule import simulate

    ranks = []
    for s in plan.stages:
        if s.ranks[0] not in ranks:
            ranks.append(s.ranks[0])
    pp = len(ranks)
    rank_of_stage = [ranks.index(s.ranks[0]) for s in plan.stages]
    grid = simulate(plan.schedule, pp, plan.num_stages, plan.num_microbatches)
    orders = [[a for a in row if a is not None] for row in grid]
    durations = _stage_fwd_bwd_s(plan)
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    nxt = [0] * pp
    bars = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for pos in range(pp):
            while nxt[pos] < len(orders[pos]):
                kind, stage, mb = orders[pos][nxt[pos]]
                deps = [("F", stage - 1, mb)] if kind == "F" and stage > 0 else []
                if kind == "B":
                    deps = [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < plan.num_stages - 1 else [])
                if any(d not in end for d in deps):
                    break
                start = max([free[pos]] + [end[d] for d in deps])
                finish = start + durations[stage][0 if kind == "F" else 1]
                end[(kind, stage, mb)] = finish
                free[pos] = finish
                bars.append({"rank_position": pos, "rank": ranks[pos], "kind": kind, "stage": stage,
                             "microbatch": mb, "start_s": start, "end_s": finish})
                nxt[pos] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # simulate() already proved the order deadlock-free
            raise AssertionError(f"timeline of {plan.schedule} stalled")
    assert all(rank_of_stage[b["stage"]] == b["rank_position"] for b in bars)
    # Data-parallel replicas run the same timeline: a row stands for every replica's rank.
    labels = [",".join(map(str, next(s.ranks for s in plan.stages if s.ranks[0] == r))) for r in ranks]
    return {"ranks": ranks, "rank_labels": labels, "bars": bars, "makespan_s": max(free) if bars else 0.0}


# ---------------------------------------------------------------------------------------------
# HTML


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _svg_stage_graph(plan: Plan) -> str:
    """Stage boxes left to right joined by their cut edges, over a strip of every region (width
    proportional to its FLOPs) in topological order, coloured by stage."""
    p = plan.num_stages
    box_w, box_h, gap, top = 210, 128, 70, 30
    width = max(700, p * box_w + (p - 1) * gap + 40)
    parts = []
    for s in plan.stages:
        x = 20 + s.index * (box_w + gap)
        colour = stage_colour(s.index)
        rows = [f"stage {s.index}", f"rank(s) {','.join(map(str, s.ranks))} · {s.device}", _held(s.region_names),
                f"{_si(s.params)} params", f"{_ms(s.predicted_time_s)} ms / microbatch",
                f"peak {human_bytes(s.peak_memory_bytes)}"]
        parts.append(f'<g><title>{_e(", ".join(s.region_names))}</title>'
                     f'<rect x="{x}" y="{top}" width="{box_w}" height="{box_h}" rx="8" fill="{colour}"/>')
        for i, text in enumerate(rows):
            weight = ' font-weight="bold"' if i == 0 else ""
            parts.append(f'<text x="{x + 10}" y="{top + 20 + i * 18}" fill="#fff" font-size="{13 if i == 0 else 12}"'
                         f'{weight}>{_e(text[:30])}</text>')
        parts.append("</g>")
    cut_by_boundary: dict[int, list] = {}
    for e in plan.cut_edges:
        for b in e.boundaries:
            cut_by_boundary.setdefault(b, []).append(e)
    for b in range(p - 1):
        x1 = 20 + b * (box_w + gap) + box_w
        edges = cut_by_boundary.get(b, [])
        num_bytes = sum(e.bytes_per_microbatch for e in edges)
        label = human_bytes(num_bytes) if edges else "-"
        tensors = "; ".join(f"{t} {list(sh)}" for e in edges for t, sh in zip(e.tensors, e.shapes))
        parts.append(f'<g><title>{_e(tensors or "no tensors")}</title>'
                     f'<line x1="{x1 + 4}" y1="{top + box_h / 2}" x2="{x1 + gap - 6}" y2="{top + box_h / 2}" stroke="#d62728" '
                     f'stroke-width="3" marker-end="url(#arrow)"/>'
                     f'<text x="{x1 + gap / 2}" y="{top + box_h / 2 - 8}" text-anchor="middle" font-size="11">{_e(label)}</text>'
                     "</g>")
    # region strip
    strip_y, strip_h = top + box_h + 22, 26
    weights = [max(r.flops_fwd + r.flops_bwd, 0.0) for r in plan.regions]
    total = sum(weights) or 1.0
    floor = 0.15 * total / max(1, len(weights))  # regions without FLOPs (embeddings) stay visible
    weights = [max(w, floor) for w in weights]
    scale = (width - 40) / sum(weights)
    x = 20.0
    for r, w in zip(plan.regions, weights):
        rw = w * scale
        parts.append(f'<rect x="{x:.2f}" y="{strip_y}" width="{max(rw - 1, 0.5):.2f}" height="{strip_h}" '
                     f'fill="{stage_colour(r.stage)}"><title>{_e(r.name)}: stage {r.stage}, '
                     f'{_si(r.flops_fwd + r.flops_bwd)} FLOP/sample, {_e(human_bytes(r.param_bytes))} params'
                     f'{", recompute" if r.recompute else ""}</title></rect>')
        if rw > 7 * len(r.name):
            parts.append(f'<text x="{x + rw / 2:.2f}" y="{strip_y + 17}" text-anchor="middle" fill="#fff" '
                         f'font-size="11">{_e(r.name)}</text>')
        x += rw
    parts.append(f'<text x="20" y="{strip_y + strip_h + 16}" font-size="11" fill="#555">regions in topological '
                 "order, width proportional to FLOPs (hover for names)</text>")
    height = strip_y + strip_h + 26
    return (f'<svg id="stage-graph" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="stage graph">'
            '<defs><marker id="arrow" markerWidth="10" markerHeight="10" refX="8" refY="5" orient="auto" '
            'markerUnits="userSpaceOnUse"><path d="M0,0 L10,5 L0,10 z" fill="#d62728"/></marker></defs>' + "".join(parts) + "</svg>")


def _svg_timeline(plan: Plan, tl: dict) -> str:
    ranks, bars, makespan = tl["ranks"], tl["bars"], tl["makespan_s"]
    label_w = 80 if max(len(x) for x in tl["rank_labels"]) < 6 else 140
    row_h, width = 30, 1240
    plot_w = width - label_w - 20
    height = len(ranks) * row_h + 50
    scale = plot_w / makespan if makespan > 0 else 0.0
    parts = []
    for pos, label in enumerate(tl["rank_labels"]):
        y = 10 + pos * row_h
        parts.append(f'<text x="4" y="{y + 19}" font-size="12">rank{"s" if "," in label else ""} {_e(label)}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{row_h - 4}" fill="#f3f3f3"/>')
    for bar in bars:
        x = label_w + bar["start_s"] * scale
        w = max((bar["end_s"] - bar["start_s"]) * scale, 0.5)
        y = 10 + bar["rank_position"] * row_h
        colour = stage_colour(bar["stage"])
        forward = bar["kind"] == "F"
        style = f'fill="{colour}"' if forward else f'fill="{colour}" fill-opacity="0.55" stroke="{colour}"'
        text = f'{bar["kind"]}{bar["microbatch"]}'
        parts.append(f'<g class="{"fwd" if forward else "bwd"}"><title>{"forward" if forward else "backward"} of '
                     f'microbatch {bar["microbatch"]}, stage {bar["stage"]}: {_ms(bar["start_s"])}-'
                     f'{_ms(bar["end_s"])} ms</title>'
                     f'<rect x="{x:.2f}" y="{y}" width="{max(w - 1, 0.5):.2f}" height="{row_h - 4}" {style}/>')
        if w > 9 * len(text):
            parts.append(f'<text x="{x + w / 2:.2f}" y="{y + 18}" text-anchor="middle" font-size="11" '
                         f'fill="{"#fff" if forward else "#222"}">{text}</text>')
        parts.append("</g>")
    axis_y = 10 + len(ranks) * row_h + 4
    for i in range(6):
        t = makespan * i / 5
        x = label_w + t * scale
        parts.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 5}" stroke="#555"/>'
                     f'<text x="{x:.2f}" y="{axis_y + 18}" text-anchor="{("start", "middle", "middle", "middle", "middle", "end")[i]}" '
                     f'font-size="11">{_ms(t)} ms</text>')
    return (f'<svg id="timeline" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="pipeline timeline">' + "".join(parts)
            + "</svg>")


MEMORY_PARTS = (("weights", "params_bytes", "#4e79a7"), ("gradients", "grads_bytes", "#59a14f"),
                ("optimizer", "optimizer_bytes", "#edc948"), ("activations", "activations_bytes", "#e15759"),
                ("buffers", "buffers_bytes", "#9c755f"), ("backward transient", "transient_bytes", "#b07aa1"))


def _svg_memory(plan: Plan) -> tuple[str, str]:
    """Stacked bars per stage. The axis is the capacity; when every stage uses under 10% of it the
    axis zooms to the largest stage (and says so), so tiny models still show their split."""
    capacity = max(s.memory_capacity_bytes for s in plan.stages)
    peak = max(s.peak_memory_bytes for s in plan.stages)
    zoom = peak < 0.1 * capacity
    axis = peak * 1.1 if zoom else max(capacity, peak)
    label_w, row_h, width = 80, 30, 1240
    plot_w = width - label_w - 220
    parts = []
    for i, s in enumerate(plan.stages):
        y = 8 + i * row_h
        x = float(label_w)
        parts.append(f'<text x="4" y="{y + 17}" font-size="12">stage {s.index}</text>')
        for name, attr, colour in MEMORY_PARTS:
            value = getattr(s.memory, attr)
            w = value / axis * plot_w if axis > 0 else 0
            parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 8}" fill="{colour}">'
                         f'<title>stage {s.index} {name}: {_e(human_bytes(value))}</title></rect>')
            x += w
        cap_x = label_w + s.memory_capacity_bytes / axis * plot_w if axis > 0 else label_w
        if not zoom:
            parts.append(f'<line x1="{cap_x:.2f}" y1="{y - 3}" x2="{cap_x:.2f}" y2="{y + row_h - 5}" '
                         'stroke="#222" stroke-width="2" stroke-dasharray="4,2"/>')
        used = 100 * s.peak_memory_bytes / s.memory_capacity_bytes if s.memory_capacity_bytes else 0.0
        parts.append(f'<text x="{label_w + plot_w + 10}" y="{y + 17}" font-size="12">'
                     f'{_e(human_bytes(s.peak_memory_bytes))} of {_e(human_bytes(s.memory_capacity_bytes))} '
                     f'({used:.2g}%)</text>')
    height = 16 + len(plan.stages) * row_h
    svg = (f'<svg id="memory" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" role="img" aria-label="memory per stage">' + "".join(parts) + "</svg>")
    note = (f"axis zoomed to the largest stage ({human_bytes(peak)}); capacity {human_bytes(capacity)} is off the "
            "scale" if zoom else "dashed line: the device's capacity")
    return svg, note


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px 32px; color: #222;
       background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 15px; margin: 22px 0 6px 0; }
.sub { color: #555; font-size: 13px; margin-bottom: 10px; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 10px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 6px 12px; min-width: 110px; }
.card b { display: block; font-size: 17px; } .card span { color: #666; font-size: 11px; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 3px 9px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #fafafa; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.legend { font-size: 12px; color: #444; } .legend i { display: inline-block; width: 11px; height: 11px;
          margin: 0 4px 0 12px; vertical-align: -1px; }
.note { font-size: 11px; color: #666; }
"""


def html_page(plan: Plan) -> str:
    """One self-contained page: inline CSS and SVG, no script, font or image from anywhere else."""
    p = plan.predicted
    try:
        tl = timeline(plan)
        timeline_svg = _svg_timeline(plan, tl)
        timeline_note = (f"one step of one replica, forward solid, backward light; the schedule's makespan "
                         f"{_ms(tl['makespan_s'])} ms (the cost model's step {_ms(p['step_time_s'])} ms adds "
                         "the data-parallel all-reduce and tie synchronisation)")
    except Exception as exc:  # noqa: BLE001 - a page without a timeline beats no page
        timeline_svg = '<svg id="timeline" width="10" height="10"></svg>'
        timeline_note = f"no timeline for schedule {plan.schedule}: {exc}"
    memory_svg, memory_note = _svg_memory(plan)
    cards = [("step time", f"{_ms(p['step_time_s'])} ms"), ("samples/s", f"{samples_per_s(plan):.1f}"),
             ("bubble", f"{p['bubble_fraction'] * 100:.1f}%"),
             ("lower bound", f"{_ms(p['lower_bound_step_time_s'])} ms"),
             ("balance (time)", f"{balance(plan)['time_max_over_mean']:.3f}"),
             ("solver", f"{plan.solver['status']} · gap {plan.solver.get('gap', 0.0) * 100:.2f}%")]
    for name in ("uniform", "param_balanced"):
        t = (plan.baselines.get(name) or {}).get("step_time_s")
        if t:
            cards.append((f"{name} baseline", f"{_ms(t)} ms ({t / p['step_time_s']:.2f}x)"))
    rows = []
    for s in plan.stages:
        rows.append("<tr>" + "".join(
            f'<td class="{c}">{_e(v)}</td>' for c, v in (
                ("", s.index), ("", ",".join(map(str, s.ranks))), ("", s.device), ("", _held(s.region_names)),
                ("n", _si(s.params)), ("n", _si(s.flops_fwd)), ("n", _si(s.flops_bwd)),
                ("n", _ms(s.predicted_time_s)), ("n", human_bytes(s.peak_memory_bytes)),
                ("n", human_bytes(s.memory_capacity_bytes)), ("n", human_bytes(s.send_bytes))))
            + "</tr>")
    cut_rows = "".join(
        f"<tr><td>{_e(t)}</td><td>{_e(list(sh))}</td><td class=\"n\">{_e(human_bytes(e.bytes_per_microbatch))}</td>"
        f"<td>{_e(','.join(f'{b}|{b + 1}' for b in e.boundaries))}</td></tr>"
        for e in plan.cut_edges for t, sh in zip(e.tensors, e.shapes))
    legend = "".join(f'<i style="background:{c}"></i>{n}' for n, _a, c in MEMORY_PARTS)
    stage_legend = "".join(f'<i style="background:{stage_colour(s.index)}"></i>stage {s.index}' for s in plan.stages)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>plan {_e(plan.content_hash())} · {_e(plan.workload)}</title>
<style>{CSS}</style></head>
<body>
<h1>{_e(plan.workload)}</h1>
<div class="sub">plan {_e(plan.content_hash())} · {plan.num_stages} stage(s) × {plan.dp} data-parallel =
{plan.world_size} rank(s) · {plan.num_microbatches} microbatches of {plan.microbatch_size} (global batch
{plan.global_batch}) · schedule {_e(plan.schedule)}</div>
<div class="cards">{"".join(f'<div class="card"><b>{_e(v)}</b><span>{_e(k)}</span></div>' for k, v in cards)}</div>
<h2>Stages</h2>
<div class="legend">{stage_legend}</div>
{_svg_stage_graph(plan)}
<h2>Predicted pipeline timeline</h2>
<div class="legend">{stage_legend}</div>
{timeline_svg}
<div class="note">{_e(timeline_note)}</div>
<h2>Memory per stage</h2>
<div class="legend">{legend}</div>
{memory_svg}
<div class="note">{_e(memory_note)}</div>
<h2>Figures</h2>
<table><tr><th>stage</th><th>ranks</th><th>device</th><th>regions</th><th>params</th><th>fwd FLOP/mb</th>
<th>bwd FLOP/mb</th><th>time ms/mb</th><th>peak</th><th>capacity</th><th>send/mb</th></tr>
{"".join(rows)}</table>
<h2>Cut edges</h2>
<table><tr><th>tensor</th><th>shape</th><th>bytes/mb</th><th>boundaries</th></tr>{cut_rows or
'<tr><td colspan="4">none (one stage)</td></tr>'}</table>
</body></html>
"""


def write_html(plan: Plan, path: str | Path) -> Path:
    """Write the page atomically: a temporary file beside ``path``, then a rename."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"--html {path}: folder {folder} does not exist; create it or write elsewhere")
    text = html_page(plan)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# Why is this node here? (Note [rebuilt cost model])


def _cut_per_sample(plan: Plan) -> list[float]:
    """Bytes per sample crossing each boundary: the stage's send figure, which the cost model
    computed (the cut edges' own byte counts are a per-tensor listing; see _cut_edge_scale)."""
    return [s.send_bytes / plan.microbatch_size for s in plan.stages[:-1]]


def _cut_edge_scale(plan: Plan) -> float:
    """Factor that makes the cut edges' bytes add up to the stages' send bytes. It is 1 when the
    plan is self-consistent; a plan whose cut edges were measured at another batch size than the
    microbatch (the traced example batch) is priced by what the cost model used."""
    recorded = sum(e.bytes_per_microbatch * len(e.boundaries) for e in plan.cut_edges)
    truth = sum(s.send_bytes for s in plan.stages)
    return truth / recorded if recorded > 0 and truth > 0 else 1.0


def rebuild_problem(plan: Plan, *, boundary_estimate: dict[tuple[int, int], float] | None = None):
    """(PartitionProblem, ClusterSpec, Assignment) for ``plan`` (Note [rebuilt cost model]).
    ``boundary_estimate`` gives bytes per sample for chain edges the plan does not record."""
    from partitioner.cluster import ClusterSpec
    from partitioner.solver.problem import Assignment, Edge, PartitionProblem, Region, place_stages

    b = plan.microbatch_size
    stage_of = {r.id: r.stage for r in plan.regions}
    ratio = {}
    for s in plan.stages:
        m = s.memory
        ratio[s.index] = ((m.grads_bytes / m.params_bytes, m.optimizer_bytes / m.params_bytes)
                          if m.params_bytes else (1.0, 2.0))
    # Recomputed regions keep only their inputs: what the stage's activation figure leaves over.
    saved_left = {}
    for s in plan.stages:
        from partitioner.solver.problem import in_flight_microbatches

        in_flight = in_flight_microbatches(plan.schedule, s.index, plan.num_stages, plan.num_microbatches)
        kept = sum(r.activation_bytes for r in plan.regions if r.stage == s.index and not r.recompute)
        num_recompute = sum(1 for r in plan.regions if r.stage == s.index and r.recompute)
        held_outputs = s.send_bytes / b  # the stage's outputs, kept until their backward (Note [memory model])
        left = s.memory.activations_bytes / (in_flight * b) - kept - held_outputs
        saved_left[s.index] = max(0, int(round(left / num_recompute))) if num_recompute else 0
    regions = []
    for r in sorted(plan.regions, key=lambda r: r.id):
        g, o = ratio[r.stage]
        regions.append(Region(
            name=r.name, fwd_flops_per_sample=r.flops_fwd, bwd_flops_per_sample=r.flops_bwd,
            param_bytes=int(r.param_bytes), grad_bytes=int(round(r.param_bytes * g)),
            optimizer_bytes=int(round(r.param_bytes * o)), activation_bytes_per_sample=int(r.activation_bytes),
            recompute_activation_bytes_per_sample=saved_left[r.stage] if r.recompute else int(r.activation_bytes),
            layer=r.layer, transient_bytes_per_sample=int(r.transient_bytes)))
    edges: dict[tuple[int, int], float] = {}
    scale = _cut_edge_scale(plan)
    for e in plan.cut_edges:
        edges[(e.src_region, e.dst_region)] = edges.get((e.src_region, e.dst_region), 0.0) + \
            e.bytes_per_microbatch * scale / b
    for i in range(len(regions) - 1):
        if (i, i + 1) not in edges:
            # Crossing a boundary now but not recorded: it carries nothing (the plan lists every cut).
            estimate = (boundary_estimate or {}).get((i, i + 1), 0.0)
            edges[(i, i + 1)] = 0.0 if stage_of[i] != stage_of[i + 1] else estimate
    # Stage 0's buffers: m·b·cut0 gradient receive buffers + the global batch, d·m·b·(input + target)
    # (Note [memory model]); the target is folded into the input here.
    cut0 = _cut_per_sample(plan)[0] if plan.num_stages > 1 else 0.0
    m_b = plan.num_microbatches * b
    input_bytes = max(0.0, (plan.stages[0].memory.buffers_bytes - m_b * cut0) / (plan.dp * m_b))
    problem = PartitionProblem(tuple(regions), tuple(Edge(s, d, int(round(v))) for (s, d), v in sorted(edges.items())),
                               (), int(round(input_bytes)))
    cluster = ClusterSpec.from_dict(plan.cluster)
    classes = []
    for s in plan.stages:
        device = next((d for d in cluster.devices if d.kind == s.device), cluster.devices[0])
        classes.append(device.device_class)
    placement = (place_stages(cluster, plan.num_stages, plan.dp) if cluster.is_homogeneous
                 else place_stages(cluster, plan.num_stages, plan.dp, classes))
    assignment = Assignment(
        stage_of_region=tuple(stage_of[i] for i in range(len(regions))),
        recompute=tuple(r.recompute for r in sorted(plan.regions, key=lambda r: r.id)),
        device_of_stage_replica=placement, num_stages=plan.num_stages, dp=plan.dp,
        num_microbatches=plan.num_microbatches, microbatch_size=b, schedule=plan.schedule)
    return problem, cluster, assignment


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


def explain_node(plan: Plan, name: str) -> dict:
    """Where ``name`` sits, what its region costs, and what moving the region (with every region
    between it and the stage boundary, to keep stages contiguous) to a neighbouring stage would do
    to the predicted step time."""
    from partitioner.solver.check import evaluate, structural_violations
    from partitioner.solver.problem import SCHEDULES, Assignment

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
                   "num_nodes": len(region.nodes), "flops_fwd_per_sample": region.flops_fwd,
                   "flops_bwd_per_sample": region.flops_bwd, "param_bytes": region.param_bytes,
                   "activation_bytes_per_sample": region.activation_bytes},
        "stage": {"index": stage.index, "ranks": list(stage.ranks), "device": stage.device,
                  "regions": list(stage.region_names), "predicted_time_s": stage.predicted_time_s,
                  "share_of_stage_flops": ((region.flops_fwd + region.flops_bwd) * b /
                                           (stage.flops_fwd + stage.flops_bwd)
                                           if stage.flops_fwd + stage.flops_bwd > 0 else 0.0)},
        "neighbours": {"before": None if before is None else {"region": before.name, "stage": before.stage},
                       "after": None if after is None else {"region": after.name, "stage": after.stage}},
        "cut_edges": {"in": [list(e.tensors) for e in cuts_in], "out": [list(e.tensors) for e in cuts_out]},
        "moves": [],
        "approximation": ("cost model rebuilt from plan.json (Note [rebuilt cost model] in partitioner/report.py): "
                          "a new stage boundary is assumed to carry as many bytes as the one it replaces; tied "
                          "parameters keep their placement"),
    }
    if plan.num_stages == 1:
        out["verdict"] = "the plan has one stage: every region is on stage 0"
        return out
    if plan.schedule not in SCHEDULES:
        out["verdict"] = f"no cost estimate for moves under schedule {plan.schedule!r} (the cost model prices {SCHEDULES})"
        return out

    tie_cost = sum(t.cost_s for t in plan.ties)
    problem, cluster, current = rebuild_problem(plan)
    now = evaluate(problem, cluster, current)
    now_step = now.step_time_s + tie_cost
    out["rebuilt_step_time_s"] = now_step
    out["plan_step_time_s"] = plan.predicted["step_time_s"]
    out["rebuilt_error"] = abs(now_step - plan.predicted["step_time_s"]) / plan.predicted["step_time_s"]
    cut = _cut_per_sample(plan)
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
                               f"stages stay contiguous, so {_held(move['regions'])} would all move and "
                               f"stage {stage.index} would be empty")
            continue
        if direction == "later":
            key, boundary = (moved[0] - 1, moved[0]), stage.index
        else:
            key, boundary = (moved[-1], moved[-1] + 1), stage.index - 1
        problem_m, _, _ = rebuild_problem(plan, boundary_estimate={key: cut[boundary]})
        stage_of = list(current.stage_of_region)
        for r in moved:
            stage_of[r] = target
        trial = Assignment(tuple(stage_of), current.recompute, current.device_of_stage_replica, current.num_stages,
                           current.dp, current.num_microbatches, current.microbatch_size, current.schedule)
        violations = structural_violations(problem_m, cluster, trial)
        if violations:
            move["possible"] = False
            move["why_not"] = violations[0]
            continue
        cost = evaluate(problem_m, cluster, trial)
        step = cost.step_time_s + tie_cost
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
            why = (f"makes stage {best['bottleneck_stage']} the bottleneck at {_ms(best['bottleneck_time_s'])} ms/mb "
                   f"and changes the step by {best['change'] * 100:+.1f}%")
        out["verdict"] = f"stays on stage {stage.index}: the cheapest move (to stage {best['to_stage']}) {why}"
    else:
        best = min((m for m in priced if m["fits_memory"]), key=lambda m: m["step_time_s"])
        out["verdict"] = (f"moving to stage {best['to_stage']} would be {-best['change'] * 100:.1f}% faster by this "
                          f"estimate (solver status {plan.solver['status']}, gap {plan.solver.get('gap', 0) * 100:.2f}%;"
                          " the estimate's boundary bytes may be off)")
    if out["rebuilt_error"] > 0.01:
        out["verdict"] += (f" (the rebuilt cost model is {out['rebuilt_error'] * 100:.1f}% off the plan's own step "
                           "time: treat these figures as a rough guide)")
    return out


def explain_text(info: dict) -> str:
    r, s = info["region"], info["stage"]
    lines = [
        f"node {info['node']} is in region {r['name']} (id {r['id']}"
        + (f", layer {r['layer']}" if r["layer"] is not None else "") + f", {r['num_nodes']} graph nodes)"
        f" on stage {s['index']} (rank(s) {','.join(map(str, s['ranks']))}, {s['device']})",
        f"region costs    fwd {_si(r['flops_fwd_per_sample'])} FLOP/sample, bwd {_si(r['flops_bwd_per_sample'])} "
        f"FLOP/sample, params {human_bytes(r['param_bytes'])}, saved activations "
        f"{human_bytes(r['activation_bytes_per_sample'])}/sample, recompute {'yes' if r['recompute'] else 'no'}",
        f"stage {s['index']}         {_held(s['regions'])}, {_ms(s['predicted_time_s'])} ms/mb; this region does "
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
    if "rebuilt_step_time_s" in info:
        lines.append(f"cost model      rebuilt from plan.json: step {_ms(info['rebuilt_step_time_s'])} ms "
                     f"(plan says {_ms(info['plan_step_time_s'])} ms, {info['rebuilt_error'] * 100:.2f}% apart)")
    for m in info["moves"]:
        moved = m["regions"][0] if len(m["regions"]) == 1 else f"{_held(m['regions'])}"
        if not m.get("possible"):
            lines.append(f"move to stage {m['to_stage']}: not possible ({m['why_not']})")
            continue
        times = " / ".join(_ms(t) for t in m["stage_times_s"])
        lines.append(f"move to stage {m['to_stage']} ({moved}): step {_ms(m['step_time_s'])} ms ({m['change'] * 100:+.1f}%), "
                     f"stage times {times} ms/mb, bottleneck stage {m['bottleneck_stage']}, "
                     + ("fits memory" if m["fits_memory"] else f"stages {m['over_capacity_stages']} over capacity"))
    lines.append("verdict         " + info["verdict"])
    if info["moves"]:
        lines.append("note            " + info["approximation"])
    return "\n".join(lines)


def to_json_text(value) -> str:
    return json.dumps(value, indent=1, allow_nan=False, default=lambda v: None if isinstance(v, float) and
                      not math.isfinite(v) else str(v))
