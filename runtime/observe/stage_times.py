"""What each stage of a run measured: its forward, backward and loss seconds per microbatch (Note
[stage times]).

Note [stage times]
    The step time alone cannot tell a slow stage from a slow schedule, so every rank also times
    its stages' ``forward_one_chunk`` and ``backward_one_chunk`` (and, under a split backward,
    ``backward_weight_one_chunk``, counted in the backward and recorded apart): what the cost
    model's compute term prices. The schedule waits on its receives before either call, so a wait
    for a neighbour is not in them; the loss is timed apart. Each rank writes
    RUN_DIR/stage_times_rank_<r>.json with medians over the steps after the first (as summary.json:
    Note [step time summary] in runtime/execute/train.py), which `calibrate --from-run` refits
    from (Note [refit from a run] in partitioner/calibrate/refit.py). On a GPU they are timed by
    CUDA events (Note [timing on a device] in runtime/observe/clock.py): a host clock would time
    kernel launches, and the refit would take the GPU for many times faster than it is.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Callable, Sequence

import torch

from runtime.observe.clock import clock_for

FORMAT = "partitioner.stage-times/1"


class StageTimes:
    """Per-step sums of a rank's stage calls (Note [stage times])."""

    def __init__(self, pipe_stages: Sequence, stage_ids: Sequence[int], num_microbatches: int,
                 device: torch.device | str = "cpu"):
        self.clock = clock_for(device)  # Note [timing on a device]
        self.stage_ids = tuple(stage_ids)
        self.num_microbatches = num_microbatches
        self.current = {s: [0.0, 0.0, 0.0] for s in self.stage_ids}  # forward, backward, weight backward
        self._loss_s = [0.0]  # a list: the clock adds into it (on a GPU at end_step)
        self.compile_s: float | None = None  # a compiled program's warm-up (Note [compiled stages])
        self.compiled_graphs: int | None = None  # its graphs and graph breaks (Note [graph breaks are said])
        self.graph_breaks: int | None = None
        self.steps: list[dict] = []
        for stage_id, stage in zip(self.stage_ids, pipe_stages):
            for name, slot in (("forward_one_chunk", 0), ("backward_one_chunk", 1),
                               ("backward_weight_one_chunk", 2)):
                if hasattr(stage, name):  # a stage without a split backward has no weight action to time
                    setattr(stage, name, self._timed(getattr(stage, name), stage_id, slot))

    def _timed(self, call: Callable, stage_id: int, slot: int) -> Callable:
        return self._timed_into(call, self.current[stage_id], slot)

    def _timed_into(self, call: Callable, sums: list, slot: int) -> Callable:
        clock = self.clock

        def timed(*args, **kwargs):
            start = clock.mark()
            try:
                return call(*args, **kwargs)
            finally:
                clock.add(start, clock.mark(), sums, slot)

        return timed

    def timed_loss(self, loss_fn: Callable) -> Callable:
        return self._timed_into(loss_fn, self._loss_s, 0)

    @property
    def loss_s(self) -> float:
        """The loss's seconds in the step so far (a canary's re-run saves and restores it)."""
        return self._loss_s[0]

    @loss_s.setter
    def loss_s(self, seconds: float) -> None:
        self._loss_s[0] = seconds

    def begin_step(self) -> None:
        self.clock.discard()  # spans of calls outside a step (a canary's re-run) are not the step's
        for sums in self.current.values():
            sums[0] = sums[1] = sums[2] = 0.0
        self._loss_s[0] = 0.0

    def end_step(self, *, schedule: tuple, optimizer: tuple) -> None:
        """After the step's last synchronization: ``schedule`` and ``optimizer`` are each a pair
        of ``self.clock`` marks around the phase."""
        phases = [0.0, 0.0]
        self.clock.add(*schedule, phases, 0)
        self.clock.add(*optimizer, phases, 1)
        self.clock.settle()
        self.steps.append({"stages": {s: tuple(v) for s, v in self.current.items()}, "loss_s": self._loss_s[0],
                           "schedule_s": phases[0], "optimizer_s": phases[1]})

    def summary(self, *, rank: int, replica: int) -> dict | None:
        """The run's figures (Note [stage times]), or None before any step."""
        if not self.steps:
            return None
        steps = self.steps[1:] if len(self.steps) > 1 else self.steps  # the first pays for warm-up
        m = self.num_microbatches

        def median(values):
            return statistics.median(values)

        return {
            "format": FORMAT, "rank": rank, "replica": replica, "num_microbatches": m, "timed_steps": len(steps),
            "stages": [{"stage": s,
                        "forward_s_per_microbatch": median([st["stages"][s][0] for st in steps]) / m,
                        "backward_s_per_microbatch": median([st["stages"][s][1] + st["stages"][s][2]
                                                             for st in steps]) / m,
                        "weight_backward_s_per_microbatch": median([st["stages"][s][2] for st in steps]) / m}
                       for s in self.stage_ids],
            "loss_s_per_microbatch": median([st["loss_s"] for st in steps]) / m,
            "schedule_s": median([st["schedule_s"] for st in steps]),
            "optimizer_s": median([st["optimizer_s"] for st in steps]),
            **({} if self.compile_s is None else {"compile_s": self.compile_s, "compiled_graphs": self.compiled_graphs,
                                                   "graph_breaks": self.graph_breaks}),
        }

    def write(self, run_dir: str, *, rank: int, replica: int) -> str | None:
        body = self.summary(rank=rank, replica=replica)
        if body is None:
            return None
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, f"stage_times_rank_{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)
        return path
