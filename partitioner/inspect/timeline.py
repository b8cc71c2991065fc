"""The predicted pipeline timeline of one step: every rank's forwards and backwards in the order
torch.distributed.pipelining runs them, timed by runtime.execute.schedule.timed_actions (the simulation
behind the runtime's printable schedule, so the page and the run's schedule table agree), with
each stage's predicted time as its durations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partitioner.inspect.units import escape, ms, stage_colour

if TYPE_CHECKING:  # annotations only
    from partitioner.solver.plan import Plan


def stage_fwd_bwd_s(plan: Plan) -> list[tuple[float, float, float]]:
    """Per stage, (forward, input-gradient backward, weight-gradient backward) seconds of one
    microbatch: the stage's predicted time (compute + communication, what the cost model sums)
    split in the ratio of its forward, backward and weight-gradient FLOPs, a recomputed region's
    forward counted again in backward; the weight part is 0 unless the schedule splits the
    backward (zb, zbv: Note [weight-gradient flops])."""
    split = plan.pipeline_schedule.split_backward
    b = plan.microbatch_size
    out = []
    for s in plan.stages:
        recomputed = sum(r.fwd_flops for r in plan.regions if r.stage == s.index and r.recompute) * b
        total = s.fwd_flops + s.bwd_flops + recomputed
        share = s.fwd_flops / total if total > 0 else 1 / 3
        weight = (s.bwd_weight_flops / total if total > 0 else 0.0) if split else 0.0
        out.append((s.predicted_time_s * share, s.predicted_time_s * (1 - share - weight), s.predicted_time_s * weight))
    return out


def timeline(plan: Plan) -> dict:
    """One step of one data-parallel replica: for every rank of the pipeline, its forward (F) and
    backward (B; under zb and zbv the input gradient, and W the weight gradient) of every microbatch as [start, end) seconds (``runtime.execute.schedule.timed_actions``:
    torch.distributed.pipelining's order; F of stage s waits for F of stage s-1, B of stage s for
    its own F and B of stage s+1)."""
    # Here, not at the top: runtime.execute.schedule imports torch.distributed.pipelining (seconds), and
    # only the HTML page draws a timeline.
    from runtime.execute.schedule import timed_actions

    ranks = []
    for s in plan.stages:
        if s.ranks[0] not in ranks:
            ranks.append(s.ranks[0])
    rank_of_stage = [ranks.index(s.ranks[0]) for s in plan.stages]
    durations = stage_fwd_bwd_s(plan)
    actions = timed_actions(plan.schedule, len(ranks), plan.num_stages, plan.num_microbatches,
                            lambda kind, stage: durations[stage]["FBW".index(kind)])
    bars = [{"rank_position": pos, "rank": ranks[pos], "kind": kind, "stage": stage, "microbatch": mb,
             "start_s": start, "end_s": finish} for pos, (kind, stage, mb), start, finish in actions]
    assert all(rank_of_stage[b["stage"]] == b["rank_position"] for b in bars)
    # Data-parallel replicas run the same timeline: a row stands for every replica's rank.
    labels = [",".join(map(str, next(s.ranks for s in plan.stages if s.ranks[0] == r))) for r in ranks]
    return {"ranks": ranks, "rank_labels": labels, "bars": bars,
            "makespan_s": max((b["end_s"] for b in bars), default=0.0)}


def svg_timeline(plan: Plan, tl: dict) -> str:
    ranks, bars, makespan = tl["ranks"], tl["bars"], tl["makespan_s"]
    label_w = 80 if max(len(x) for x in tl["rank_labels"]) < 6 else 140
    row_h, width = 30, 1240
    plot_w = width - label_w - 20
    height = len(ranks) * row_h + 50
    scale = plot_w / makespan if makespan > 0 else 0.0
    parts = []
    for pos, label in enumerate(tl["rank_labels"]):
        y = 10 + pos * row_h
        parts.append(f'<text x="4" y="{y + 19}" font-size="12">rank{"s" if "," in label else ""} {escape(label)}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{row_h - 4}" fill="#f3f3f3"/>')
    for bar in bars:
        x = label_w + bar["start_s"] * scale
        w = max((bar["end_s"] - bar["start_s"]) * scale, 0.5)
        y = 10 + bar["rank_position"] * row_h
        colour = stage_colour(bar["stage"])
        forward = bar["kind"] == "F"
        weight = bar["kind"] == "W"
        style = (f'fill="{colour}"' if forward else f'fill="{colour}" fill-opacity="0.25" stroke="{colour}" '
                 'stroke-dasharray="3,2"' if weight else f'fill="{colour}" fill-opacity="0.55" stroke="{colour}"')
        text = f'{bar["kind"]}{bar["microbatch"]}'
        what = "forward" if forward else "weight-gradient backward" if weight else "backward"
        parts.append(f'<g class="{"fwd" if forward else "wgt" if weight else "bwd"}"><title>{what} of '
                     f'microbatch {bar["microbatch"]}, stage {bar["stage"]}: {ms(bar["start_s"])}-'
                     f'{ms(bar["end_s"])} ms</title>'
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
                     f'font-size="11">{ms(t)} ms</text>')
    return (f'<svg id="timeline" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="pipeline timeline">' + "".join(parts)
            + "</svg>")

