"""`partitioner inspect --html`: one self-contained page (stage graph, timeline, memory per stage,
figures, cut edges), written atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from partitioner.inspect.graph import svg_stage_graph
from partitioner.inspect.table import balance, samples_per_s
from partitioner.inspect.timeline import svg_timeline, timeline
from partitioner.inspect.units import escape, held, human_bytes, ms, si, stage_colour

if TYPE_CHECKING:  # annotations only
    from partitioner.solver.plan import Plan


MEMORY_PARTS = (("weights", "params_bytes", "#4e79a7"), ("gradients", "grads_bytes", "#59a14f"),
                ("optimizer", "optimizer_bytes", "#edc948"), ("activations", "activations_bytes", "#e15759"),
                ("buffers", "buffers_bytes", "#9c755f"), ("backward transient", "transient_bytes", "#b07aa1"))


def svg_memory(plan: Plan) -> tuple[str, str]:
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
                         f'<title>stage {s.index} {name}: {escape(human_bytes(value))}</title></rect>')
            x += w
        cap_x = label_w + s.memory_capacity_bytes / axis * plot_w if axis > 0 else label_w
        if not zoom:
            parts.append(f'<line x1="{cap_x:.2f}" y1="{y - 3}" x2="{cap_x:.2f}" y2="{y + row_h - 5}" '
                         'stroke="#222" stroke-width="2" stroke-dasharray="4,2"/>')
        used = 100 * s.peak_memory_bytes / s.memory_capacity_bytes if s.memory_capacity_bytes else 0.0
        parts.append(f'<text x="{label_w + plot_w + 10}" y="{y + 17}" font-size="12">'
                     f'{escape(human_bytes(s.peak_memory_bytes))} of {escape(human_bytes(s.memory_capacity_bytes))} '
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
        timeline_svg = svg_timeline(plan, tl)
        weights = " (input gradient), weight gradient (W) dashed" if any(b["kind"] == "W" for b in tl["bars"]) else ""
        timeline_note = (f"one step of one replica, forward solid, backward light{weights}; the schedule's makespan "
                         f"{ms(tl['makespan_s'])} ms (the cost model's step {ms(p['step_time_s'])} ms adds "
                         "the data-parallel all-reduce and tie synchronisation)")
    except Exception as exc:  # noqa: BLE001 - a page without a timeline beats no page
        timeline_svg = '<svg id="timeline" width="10" height="10"></svg>'
        timeline_note = f"no timeline for schedule {plan.schedule}: {exc}"
    memory_svg, memory_note = svg_memory(plan)
    cards = [("step time", f"{ms(p['step_time_s'])} ms"), ("samples/s", f"{samples_per_s(plan):.1f}"),
             ("bubble", f"{p['bubble_fraction'] * 100:.1f}%"),
             ("lower bound", f"{ms(p['lower_bound_step_time_s'])} ms"),
             ("balance (time)", f"{balance(plan)['time_max_over_mean']:.3f}"),
             ("solver", f"{plan.solver['status']} · gap {plan.solver.get('gap', 0.0) * 100:.2f}%")]
    for name in ("uniform", "param_balanced"):
        t = (plan.baselines.get(name) or {}).get("step_time_s")
        if t:
            cards.append((f"{name} baseline", f"{ms(t)} ms ({t / p['step_time_s']:.2f}x)"))
    rows = []
    for s in plan.stages:
        rows.append("<tr>" + "".join(
            f'<td class="{c}">{escape(v)}</td>' for c, v in (
                ("", s.index), ("", ",".join(map(str, s.ranks))), ("", s.device), ("", held(s.region_names)),
                ("n", si(s.params)), ("n", si(s.fwd_flops)), ("n", si(s.bwd_flops)),
                ("n", ms(s.predicted_time_s)), ("n", human_bytes(s.peak_memory_bytes)),
                ("n", human_bytes(s.memory_capacity_bytes)), ("n", human_bytes(s.send_bytes))))
            + "</tr>")
    cut_rows = "".join(
        f"<tr><td>{escape(t)}</td><td>{escape(list(sh))}</td><td class=\"n\">{escape(human_bytes(e.bytes_per_microbatch))}</td>"
        f"<td>{escape(','.join(f'{b}|{b + 1}' for b in e.boundaries))}</td></tr>"
        for e in plan.cut_edges for t, sh in zip(e.tensors, e.shapes))
    legend = "".join(f'<i style="background:{c}"></i>{n}' for n, _a, c in MEMORY_PARTS)
    stage_legend = "".join(f'<i style="background:{stage_colour(s.index)}"></i>stage {s.index}' for s in plan.stages)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>plan {escape(plan.content_hash())} · {escape(plan.workload)}</title>
<style>{CSS}</style></head>
<body>
<h1>{escape(plan.workload)}</h1>
<div class="sub">plan {escape(plan.content_hash())} · {plan.num_stages} stage(s) × {plan.dp} data-parallel =
{plan.world_size} rank(s) · {plan.num_microbatches} microbatches of {plan.microbatch_size} (global batch
{plan.global_batch}) · schedule {escape(plan.schedule)}</div>
<div class="cards">{"".join(f'<div class="card"><b>{escape(v)}</b><span>{escape(k)}</span></div>' for k, v in cards)}</div>
<h2>Stages</h2>
<div class="legend">{stage_legend}</div>
{svg_stage_graph(plan)}
<h2>Predicted pipeline timeline</h2>
<div class="legend">{stage_legend}</div>
{timeline_svg}
<div class="note">{escape(timeline_note)}</div>
<h2>Memory per stage</h2>
<div class="legend">{legend}</div>
{memory_svg}
<div class="note">{escape(memory_note)}</div>
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
    if path.is_dir() and not path.is_symlink():
        raise ValueError(f"--html {path} is a folder: give the page a file name (e.g. --html {path / 'plan.html'})")
    text = html_page(plan)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise ValueError(f"--html {path}: cannot write in {folder} ({exc.strerror or exc}); write it elsewhere") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

