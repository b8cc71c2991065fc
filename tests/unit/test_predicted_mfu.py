"""`inspect` prints the plan's predicted MFU beside the best published figure for its device kind
(Note [predicted MFU against published runs] in partitioner/inspect/mfu.py), counted by hand here."""

from __future__ import annotations

import dataclasses

from partitioner import compile
from partitioner.config.cluster import ClusterSpec
from partitioner.inspect import table
from partitioner.inspect.mfu import PUBLISHED_MFU, mfu_line, predicted_mfu
from partitioner.models.builtin import gpt
from partitioner.solver import SolverConfig


def _a100_plan():
    cluster = ClusterSpec.from_dict({"group": [{"kind": "a100-80gb", "count": 2, "devices_per_node": 2}]})
    model = gpt(layers=2, width=64, heads=2, vocab=128, seq=16, batch=1, device="meta")
    return compile(model, cluster=cluster, global_batch=8, precision="bf16-mixed",
                   solver_config=SolverConfig(time_limit_s=5)).plan


def test_predicted_mfu_is_model_flops_over_step_and_peak_and_printed_beside_the_published_figure():
    plan = _a100_plan()
    flops = sum(s.fwd_flops + s.bwd_flops for s in plan.stages) * plan.num_microbatches * plan.dp
    # by hand: every rank an A100 at its bf16 datasheet peak, 312 TFLOP/s (Note [datasheet peaks])
    expected = flops / plan.predicted["step_time_s"] / (plan.world_size * 312e12)
    assert abs(predicted_mfu(plan) - expected) <= 1e-12 * expected
    line = mfu_line(plan)
    assert line in table(plan)
    assert f"{expected * 100:.1f}%" in line and "best published 56.3%" in line and "2205.05198" in line
    assert "optimistic" not in line  # a tiny model is far below the published figure
    # a prediction above every published run says so
    fast = dataclasses.replace(plan, predicted={**plan.predicted,
                                                "step_time_s": flops / (0.9 * plan.world_size * 312e12)})
    assert "above every published run" in mfu_line(fast) and "90.0%" in mfu_line(fast)
    assert set(PUBLISHED_MFU) == {"a100-80gb", "h100"}
