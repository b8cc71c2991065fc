"""Note [one region per call] in passes/regions.py: a block the forward calls four times (ALBERT's
sharing) is a region per call, so its repeats can run on different stages, their shared weights a
tie the program syncs; trained under torchrun against the one-process oracle."""

from __future__ import annotations

from pathlib import Path

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import load_workload
from partitioner.cli.verify import verify

MODEL = str(Path(__file__).resolve().parents[1] / "own_model" / "reused_block.py") + ":build"


def test_a_reused_block_is_a_region_per_call_and_its_repeats_spread_over_stages(tmp_path):
    compiled = partitioner.compile(load_workload(MODEL), cluster=ClusterSpec.homogeneous(4, "cpu"), global_batch=8,
                                   num_stages=4, dp=1)
    plan = compiled.plan
    names = [r.name for r in plan.regions]
    assert names == ["inp", "block", "block@1", "block@2", "block@3", "head"]
    stage_of = {r.name: r.stage for r in plan.regions}
    repeats = {stage_of[n] for n in names if n.startswith("block")}
    assert len(repeats) >= 2  # four stages, six regions: the repeats cannot all share one
    tied = {t.param: t for t in plan.ties}
    assert set(tied) == {"block.ln.weight", "block.ln.bias", "block.fc.weight", "block.fc.bias"}
    assert all(len(t.stages) == len(repeats) for t in tied.values())
    folder = tmp_path / "prog"
    compiled.save(folder)
    report = verify(folder, steps=3)
    assert report.ok, report.text()
