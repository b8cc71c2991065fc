"""What people watch (runtime/observe/watch.py): the plan's FLOPs per step, MFU, peak memory, ETA, and
TensorBoard scalars (tensorboard is in the test extras, so this runs)."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.observe.watch import StepWatch, eta_text, plan_step_flops


def _plan(folder, *, stages, m=4, dp=2):
    plan = {"num_microbatches": m, "dp": dp, "stages": stages,
            "cluster": {"group": [{"kind": "cpu", "count": 4, "flops_per_s": 1e9},
                                  {"kind": "h100", "count": 8, "flops_per_s": 4e14}]}}
    (folder / "plan.json").write_text(json.dumps(plan))


def test_step_flops_are_the_plans_forward_and_backward_for_every_microbatch_and_replica(tmp_path):
    _plan(tmp_path, stages=[{"flops_fwd": 10.0, "flops_bwd": 20.0, "device": "cpu"},
                            {"flops_fwd": 1.0, "flops_bwd": 2.0, "device": "h100"}])
    flops, peak = plan_step_flops(str(tmp_path))
    assert flops == (10 + 20 + 1 + 2) * 4 * 2
    assert peak == (1e9 + 4e14) * 2  # each stage's device, once per replica


def test_a_folder_without_flops_gives_none(tmp_path):
    assert plan_step_flops(str(tmp_path)) == (None, None)
    (tmp_path / "plan.json").write_text("{}")
    assert plan_step_flops(str(tmp_path)) == (None, None)


def test_measure_gives_mfu_memory_and_eta(tmp_path):
    _plan(tmp_path, stages=[{"flops_fwd": 1e6, "flops_bwd": 2e6, "device": "cpu"}], m=2, dp=1)
    watch = StepWatch(str(tmp_path), torch.device("cpu"), rank=0, run_dir=str(tmp_path / "run"), steps=5,
                      start_step=0)
    first = watch.measure(0, 0.5)
    second = watch.measure(1, 0.25)
    assert first["model_flops"] == 6e6 and first["achieved_flops_per_s"] == pytest.approx(12e6)
    assert first["mfu"] == pytest.approx(12e6 / 1e9)
    assert second["mfu"] == pytest.approx(24e6 / 1e9)
    assert len(first["peak_memory_bytes"]) == 1 and first["peak_memory_bytes"][0] > 2**20
    assert first["peak_memory_kind"] == "host_peak_rss"
    assert second["eta_s"] >= 0 and watch.eta_s(4) == 0
    assert "mfu 2.4%" in watch.line(second) and "eta" in watch.line(second)
    record = {"step": 1, "loss": 0.5, "lr": 1e-3, **second}
    watch.board_write(record)
    watch.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/mfu", "memory/peak_bytes_max_rank"} <= set(events.Tags()["scalars"])
    assert events.Scalars("train/loss")[0].value == pytest.approx(0.5)


def test_eta_text():
    assert eta_text(12.4) == "12s"
    assert eta_text(245) == "4m05s"
    assert eta_text(3 * 3600 + 125) == "3h02m"
