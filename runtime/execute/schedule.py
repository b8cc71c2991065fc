"""Pipeline schedules: the plan's schedule name -> a torch.distributed.pipelining schedule, and
the same schedule as printable text.

Note [mean over microbatches]: each microbatch's loss is loss_fn(output, target) (a mean over the
microbatch); the schedule sums microbatch gradients and divides by num_microbatches
(``scale_grads=True``), and the data-parallel all-reduce then averages over replicas. With equal
microbatches this is the gradient of the mean loss over the global batch, which is what
``runtime.execute.reference.train_reference`` computes in one process.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from runtime.program.schedules import Action, schedule_named
from runtime.program.spec import Program
from runtime.execute.recompute import set_split_backward
from runtime.execute.recv_buffers import hold_in_flight
from runtime.execute.stage import example_args


def pipeline_stage(module: torch.nn.Module, program: Program, stage_index: int,
                   device: torch.device, group) -> PipelineStage:
    """PipelineStage with input/output metadata from the plan (static mode: no shape inference,
    no forward pass and no communication at construction or first step)."""
    spec = program.stages[stage_index]
    return hold_in_flight(PipelineStage(  # Note [receive buffers in flight]
        module, stage_index, program.num_stages, device,
        input_args=example_args(spec.inputs, requires_grad=stage_index > 0),
        output_args=example_args(spec.outputs, requires_grad=True),
        group=group))


def _unwrap_single(loss_fn: Callable) -> Callable:
    """The last stage's outputs go to loss_fn as the tensor when single, else as a tuple."""

    def loss(output, target):
        if isinstance(output, (tuple, list)) and len(output) == 1:
            output = output[0]
        return loss_fn(output, target)

    return loss


def build_schedule(stages: Sequence[PipelineStage], program: Program, loss_fn: Callable):
    schedule = program.pipeline_schedule
    set_split_backward(schedule.split_backward)  # Note [recompute under a split backward]
    first = program.stages[0]
    # Stage 0's inputs are chunked into microbatches along their batch_dim (targets along dim 0).
    chunk_spec = tuple(TensorChunkSpec(a.batch_dim or 0) for a in first.inputs)
    kwargs = dict(n_microbatches=program.num_microbatches, loss_fn=_unwrap_single(loss_fn),
                  args_chunk_spec=chunk_spec, scale_grads=True)
    if schedule.local_stages > 1:  # torch's multi-stage schedules take the rank's list of stages
        return getattr(pipelining, schedule.torch_class)(list(stages), **kwargs)
    if len(stages) != 1:
        raise ValueError(f"schedule {schedule.name!r} runs one stage per rank, but this rank holds "
                         f"{len(stages)} stages: use schedule 'interleaved'")
    return getattr(pipelining, schedule.torch_class)(stages[0], **kwargs)


# ---------------------------------------------------------------------------------------------
# Printable schedule


def _rank_orders(name: str, pp: int, num_stages: int, m: int) -> list[list[Action]]:
    """Per pipeline position, the order of compute actions (kind "F"/"B", stage, microbatch) as
    torch.distributed.pipelining executes them."""
    schedule = schedule_named(name, num_stages // pp)
    return [schedule.rank_order(pos, pp, num_stages, m) for pos in range(pp)]


def rank_actions(program: Program, rank: int) -> list[Action]:
    """``rank``'s compute actions of one step, (kind "F"/"B", stage, microbatch) in the order
    torch.distributed.pipelining executes them (the row of its pipeline position)."""
    layout = program.layout
    position = layout.pipelines[layout.pipeline_index(rank)].index(rank)
    return program.pipeline_schedule.rank_order(position, layout.pp_size, program.num_stages, program.num_microbatches)


def timed_actions(name: str, pp: int, num_stages: int, m: int,
                  seconds: Callable[[str, int], float] | None = None) -> list[tuple[int, Action, float, float]]:
    """Every compute action of one step as (pipeline position, action, start, end): each rank runs
    its actions in torch.distributed.pipelining's order, each as soon as its inputs are ready (F
    needs the previous stage's F of that microbatch; B needs its own F and the next stage's B).
    Under a split backward B is the input gradient (it needs the next stage's B) and W the weight
    gradient (it needs its own B). ``seconds(kind, stage)`` is an action's duration (default 1:
    time counts slots). Listed in the order they are resolved, which a drawing may rely on to be
    stable."""
    orders = _rank_orders(name, pp, num_stages, m)
    duration = seconds or (lambda kind, stage: 1.0)
    end: dict[Action, float] = {}
    free = [0.0] * pp
    nxt = [0] * pp
    out = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for pos in range(pp):
            while nxt[pos] < len(orders[pos]):
                act = orders[pos][nxt[pos]]
                kind, stage, mb = act
                deps = [("F", stage - 1, mb)] if kind == "F" and stage > 0 else []
                if kind == "B":
                    deps = [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < num_stages - 1 else [])
                elif kind == "W":
                    deps = [("B", stage, mb)]
                if any(d not in end for d in deps):
                    break
                start = max([free[pos]] + [end[d] for d in deps])
                end[act] = free[pos] = start + duration(kind, stage)
                out.append((pos, act, start, end[act]))
                nxt[pos] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} deadlocks in simulation: {orders}")
    return out


def simulate(name: str, pp: int, num_stages: int, m: int) -> list[list[Action | None]]:
    """Time slots (one forward or backward of one stage each) per pipeline position: the actions
    of ``timed_actions`` at unit duration, None where a rank waits."""
    actions = timed_actions(name, pp, num_stages, m)
    slots = int(max(finish for _pos, _act, _start, finish in actions))
    timeline: list[list[Action | None]] = [[None] * slots for _ in range(pp)]
    for pos, act, start, _finish in actions:
        timeline[pos][int(start)] = act
    return timeline


def schedule_text(program: Program) -> str:
    """Which microbatch's forward (F) / backward (B) each rank runs in each time slot."""
    name, p, m, dp = program.schedule, program.num_stages, program.num_microbatches, program.dp
    pipelines: dict[tuple[int, int], list[int]] = {}  # (replica, tensor index) -> ranks
    for e in sorted(program.ranks, key=lambda e: e.rank):
        pipelines.setdefault((e.replica, e.tp_index), []).append(e.rank)
    pp = len(pipelines[(0, 0)])
    timeline = simulate(name, pp, p, m)
    multi = p > pp
    cells = [[("" if a is None else f"{a[0]}{a[2]}" + (f".s{a[1]}" if multi else ""))
              for a in row] for row in timeline]
    labels = ["rank " + ",".join(str(pipelines[rep][pos]) for rep in sorted(pipelines))
              for pos in range(pp)]
    width = max(3, max(len(c) for row in cells for c in row) + 1)
    lw = max(len(s) for s in labels) + 2
    n = len(timeline[0])
    busy = sum(1 for row in timeline for a in row if a is not None)
    split = any(a is not None and a[0] == "W" for row in timeline for a in row)
    kinds = "F, B (input gradient) or W (weight gradient)" if split else "F or B"
    lines = [f"{name}: {p} stages on {pp} ranks per pipeline, {m} microbatches, dp={dp} "
             f"(replicas run the same timeline); one slot = one stage's {kinds} of one microbatch",
             ("slot".ljust(lw) + "".join(str(i).ljust(width) for i in range(n))).rstrip()]
    for label, row in zip(labels, cells):
        lines.append(label.ljust(lw) + "".join((c or ".").ljust(width) for c in row).rstrip())
    lines.append(f"{n} slots, bubble fraction {1 - busy / (n * pp):.2f}")
    return "\n".join(lines) + "\n"
