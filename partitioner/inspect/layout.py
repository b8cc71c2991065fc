"""Which ranks form each tensor group, pipeline stage and data-parallel replica (`inspect` table
and --json). The tensor index is innermost (Note [tensor groups] in
partitioner/solver/tensor_groups.py): the stage replica whose group starts at rank g holds
ranks g .. g + tp - 1; ``Plan.rank_layout()`` lists every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partitioner.inspect.units import render_columns

if TYPE_CHECKING:  # annotations only
    from partitioner.solver.plan import Plan

MAX_ROWS = 16  # a 1,024-rank plan's layout stays a screen; --json has every group


def tensor_groups(plan: Plan) -> list[dict]:
    """One entry per (stage, replica): its tensor group's ranks."""
    tp = plan.tensor_parallel
    return [{"stage": s.index, "replica": replica, "ranks": list(range(first, first + tp))}
            for s in plan.stages for replica, first in enumerate(s.ranks)]


def layout_json(plan: Plan) -> dict:
    return {"tensor_parallel": plan.tensor_parallel, "pipeline_stages": plan.num_stages, "dp": plan.dp,
            "world_size": plan.world_size, "tensor_groups": tensor_groups(plan),
            "sequence_parallel": plan.decisions.sequence_parallel}


def layout_lines(plan: Plan) -> list[str]:
    """The table's layout section; empty at tp 1 (the stage table's ranks column says it all)."""
    tp = plan.tensor_parallel
    if tp == 1:
        return []
    groups = tensor_groups(plan)
    rows = [[str(g["stage"]), str(g["replica"]), f"{g['ranks'][0]}-{g['ranks'][-1]}"] for g in groups[:MAX_ROWS]]
    lines = ["", f"layout          tp {tp} x pp {plan.num_stages} x dp {plan.dp} = {plan.world_size} ranks: each stage "
             f"replica runs on a tensor group of {tp} consecutive ranks (tensor index innermost)"]
    lines.append(f"sequence par.   {_sequence_parallel(plan)}")
    lines += ["  " + x for x in render_columns(["stage", "replica", "tensor group ranks"], ["", "", ""], rows, ">><")]
    if len(groups) > MAX_ROWS:
        lines.append(f"  ... ({len(groups)} tensor groups in all; --json lists every one)")
    return lines


def _sequence_parallel(plan: Plan) -> str:
    """Note [sequence parallelism as a decision] in partitioner/solver/sequence_parallel.py."""
    if plan.decisions.sequence_parallel:
        return (f"on: norms, dropouts and residual adds between the tensor-parallel blocks on a 1/{plan.tensor_parallel} "
                "slice of the sequence (row outputs reduce-scattered, column inputs all-gathered)")
    return "off: every member holds the norms' and residuals' activations whole"
