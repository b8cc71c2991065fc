"""A vision model's stochastic depth and in-place dropout (issue 41): timm-style DropPath,
torchvision-style stochastic_depth and an nn.Dropout(inplace=True) head, all at 0.1, compile to 2
stages, train with the drops on and verify against the one-process oracle (Note [in-place random
ops] in runtime/execute/randomness.py). The job joins the session's 2-rank shared launch (Note
[shared launches] in tests/_shared_launch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _programs import compile_to
from _shared_launch import Job, prepare
from _vision_blocks import vision_workload
from partitioner.cli.verify import check_run


@prepare
def _vision_program(root: Path):
    plan = compile_to(root / "vision", vision_workload(), devices=2, num_stages=2, dp=1, global_batch=4,
                      microbatches=2, flops_per_s=1e9)
    jobs = [Job(2, [root / "vision", "--steps", "3", "--run-dir", root / "run", "--checkpoint-dir", root / "ck"])]
    return (root, plan), jobs


@pytest.fixture(scope="module")
def vision(shared_launches):
    return shared_launches.result(_vision_program)[0]


def test_drop_path_and_in_place_dropout_train_on_two_stages_and_verify(vision):
    root, plan = vision
    assert plan.num_stages == 2
    report = check_run(root / "vision", root / "run", workload=vision_workload())
    assert report.ok, report.text()
