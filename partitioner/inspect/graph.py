"""The region graph coloured by stage: as Graphviz (`inspect --dot`) and as the SVG stage boxes of
the HTML page."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partitioner.inspect.units import escape, held, human_bytes, ms, si, stage_colour

if TYPE_CHECKING:  # annotations only
    from partitioner.solver.plan import Plan


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
            f"step {ms(plan.predicted['step_time_s'])} ms") + ", labelloc=t];",
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
                                                f"{ms(s.predicted_time_s)} ms/mb, {human_bytes(s.peak_memory_bytes)}")
                     + f'; color="{colour}"; penwidth=2;')
        for r in by_stage.get(s.index, []):
            label = (f"{r.name}\n{si(r.fwd_flops + r.bwd_flops)} FLOP/sample\n{human_bytes(r.param_bytes)} params"
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


def svg_stage_graph(plan: Plan) -> str:
    """Stage boxes left to right joined by their cut edges, over a strip of every region (width
    proportional to its FLOPs) in topological order, coloured by stage."""
    p = plan.num_stages
    box_w, box_h, gap, top = 210, 128, 70, 30
    width = max(700, p * box_w + (p - 1) * gap + 40)
    parts = []
    for s in plan.stages:
        x = 20 + s.index * (box_w + gap)
        colour = stage_colour(s.index)
        rows = [f"stage {s.index}", f"rank(s) {','.join(map(str, s.ranks))} · {s.device}", held(s.region_names),
                f"{si(s.params)} params", f"{ms(s.predicted_time_s)} ms / microbatch",
                f"peak {human_bytes(s.peak_memory_bytes)}"]
        parts.append(f'<g><title>{escape(", ".join(s.region_names))}</title>'
                     f'<rect x="{x}" y="{top}" width="{box_w}" height="{box_h}" rx="8" fill="{colour}"/>')
        for i, text in enumerate(rows):
            weight = ' font-weight="bold"' if i == 0 else ""
            parts.append(f'<text x="{x + 10}" y="{top + 20 + i * 18}" fill="#fff" font-size="{13 if i == 0 else 12}"'
                         f'{weight}>{escape(text[:30])}</text>')
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
        parts.append(f'<g><title>{escape(tensors or "no tensors")}</title>'
                     f'<line x1="{x1 + 4}" y1="{top + box_h / 2}" x2="{x1 + gap - 6}" y2="{top + box_h / 2}" stroke="#d62728" '
                     f'stroke-width="3" marker-end="url(#arrow)"/>'
                     f'<text x="{x1 + gap / 2}" y="{top + box_h / 2 - 8}" text-anchor="middle" font-size="11">{escape(label)}</text>'
                     "</g>")
    # region strip
    strip_y, strip_h = top + box_h + 22, 26
    weights = [max(r.fwd_flops + r.bwd_flops, 0.0) for r in plan.regions]
    total = sum(weights) or 1.0
    floor = 0.15 * total / max(1, len(weights))  # regions without FLOPs (embeddings) stay visible
    weights = [max(w, floor) for w in weights]
    scale = (width - 40) / sum(weights)
    x = 20.0
    for r, w in zip(plan.regions, weights):
        rw = w * scale
        parts.append(f'<rect x="{x:.2f}" y="{strip_y}" width="{max(rw - 1, 0.5):.2f}" height="{strip_h}" '
                     f'fill="{stage_colour(r.stage)}"><title>{escape(r.name)}: stage {r.stage}, '
                     f'{si(r.fwd_flops + r.bwd_flops)} FLOP/sample, {escape(human_bytes(r.param_bytes))} params'
                     f'{", recompute" if r.recompute else ""}</title></rect>')
        if rw > 7 * len(r.name):
            parts.append(f'<text x="{x + rw / 2:.2f}" y="{strip_y + 17}" text-anchor="middle" fill="#fff" '
                         f'font-size="11">{escape(r.name)}</text>')
        x += rw
    parts.append(f'<text x="20" y="{strip_y + strip_h + 16}" font-size="11" fill="#555">regions in topological '
                 "order, width proportional to FLOPs (hover for names)</text>")
    height = strip_y + strip_h + 26
    return (f'<svg id="stage-graph" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="stage graph">'
            '<defs><marker id="arrow" markerWidth="10" markerHeight="10" refX="8" refY="5" orient="auto" '
            'markerUnits="userSpaceOnUse"><path d="M0,0 L10,5 L0,10 z" fill="#d62728"/></marker></defs>' + "".join(parts) + "</svg>")

