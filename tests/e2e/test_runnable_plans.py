"""Only runnable plans (Note [only runnable plans] in partitioner/solver/problem.py): every plan the
solver emits runs under torch.distributed.pipelining, and what torch would refuse is refused first,
in words."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import partitioner
from partitioner.config.cluster import ClusterSpec
from runtime.program.schedules import schedule_named
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data
from runtime.program.spec import Program
from _shared_launch import Job, prepare


class UsersNet(nn.Module):
    """A small model of a user's own: not one of ours, no transformer blocks to group by."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.ReLU(),
                                    nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))

    def forward(self, x):
        return self.layers(x)


def users_workload(batch: int) -> Workload:
    torch.manual_seed(0)
    return Workload(
        model=UsersNet(), example_args=(torch.zeros(batch, 6),), loss_fn=data.mse_loss,
        make_batch=functools.partial(data.regression_batch, features=6, outputs=3, seed=0),
        name="users-net",
        source={"make_batch": ("runtime.data.synthetic:regression_batch", {"features": 6, "outputs": 3, "seed": 0}),
                "loss_fn": ("runtime.data.synthetic:mse_loss", {})},
    )


def test_1f1b_refuses_fewer_microbatches_than_stages_and_gpipe_does_not():
    assert schedule_named("1f1b").refusal(2, 1) is not None
    assert schedule_named("1f1b").refusal(2, 2) is None
    assert schedule_named("gpipe").refusal(4, 1) is None


def test_fixing_stages_and_too_few_microbatches_is_a_clear_error():
    with pytest.raises(ValueError, match="microbatches >= stages.*--microbatches 2 or more"):
        partitioner.compile(users_workload(2), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4,
                            num_stages=2, microbatches=1)


def test_a_hand_written_program_with_too_few_microbatches_is_refused_before_any_rank_starts():
    program = {"world_size": 2, "num_stages": 2, "dp": 1, "num_microbatches": 1, "global_batch": 2,
               "schedule": "1f1b", "ranks": [{"rank": 0, "stages": [0], "replica": 0},
                                             {"rank": 1, "stages": [1], "replica": 0}],
               "stages": [{"index": k, "module": f"stage_{k}", "class": f"Stage{k}", "params": [],
                           "inputs": [], "outputs": []} for k in (0, 1)],
               "data": {"make_batch": "m:f", "loss_fn": "m:g"}, "optimizer": {"lr": 1e-3}}
    with pytest.raises(ValueError, match="microbatches >= stages.*recompile with --microbatches 2 or more"):
        Program.from_dict(program)


# (devices, global batch, stages or None for the solver's choice, schedule)
GRID = [(2, 4, 2, "1f1b"), (2, 2, 2, "1f1b"), (2, 3, None, "1f1b"), (2, 1, 2, "gpipe"),
        (3, 3, 3, "1f1b"), (3, 6, None, "1f1b"), (4, 4, 4, "1f1b"), (4, 8, None, "1f1b"),
        (4, 4, 2, "gpipe")]


@prepare
def _grid(root: Path):
    """Every plan of GRID, each trained one step in the session's shared launch of its world size."""
    plans, jobs = [], []
    for devices, global_batch, stages, schedule in GRID:
        folder = root / f"d{devices}_b{global_batch}_p{stages}_{schedule}"
        plan = partitioner.compile(users_workload(1), cluster=ClusterSpec.homogeneous(devices, "cpu"),
                                   global_batch=global_batch, num_stages=stages, schedule=schedule)
        plan.save(folder)
        plans.append((folder, global_batch, plan))
        jobs.append(Job(plan.world_size, [folder, "--steps", "1"]))
    return plans, jobs


def test_every_plan_over_a_grid_of_devices_stages_and_batches_runs_a_step(shared_launches):
    plans, _ = shared_launches.result(_grid)
    assert len(plans) == len(GRID)
    for folder, global_batch, plan in plans:
        assert schedule_named(plan.schedule).refusal(plan.num_stages, plan.num_microbatches) is None
        assert plan.dp * plan.num_microbatches * plan.microbatch_size == global_batch
        assert (folder / "run" / "metrics.jsonl").read_text().count("\n") == 1, folder
