"""An MoE model's experts are priced at 0 FLOPs (their routed tokens are data-dependent): compile
says so on stderr and in plan.json's ``predicted.unpriced_flops``, which ``inspect`` prints (Note
[experts priced at 0] in passes/flops.py). A dense model says nothing."""

from __future__ import annotations

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.inspect import inspect_json, table
from partitioner.models.builtin import hf_qwen2_moe, mlp


def _compile(workload):
    return partitioner.compile(workload, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=4, num_stages=1,
                               dp=1, microbatches=2)


def test_an_moe_model_says_its_experts_are_not_priced(capsys):
    plan = _compile(hf_qwen2_moe(layers=1, heads=2, width=32, vocab=64, seq=16, batch=2)).plan
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "priced at 0 FLOPs" in line]
    assert len(lines) == 1, err
    assert "model.layers.0.mlp.experts" in lines[0] and "predicted step time" in lines[0]
    assert "shared_expert" not in lines[0]  # a dense MLP, priced as any other
    record = plan.predicted["unpriced_flops"]
    assert record["modules"] == ["model.layers.0.mlp.experts"] and record["ops"]
    assert inspect_json(plan)["predicted"]["unpriced_flops"] == record
    assert "not priced" in table(plan) and "model.layers.0.mlp.experts" in table(plan)
    assert type(plan).from_dict(plan.to_dict()).predicted["unpriced_flops"] == record  # plan.json keeps it


def test_a_dense_model_says_nothing(capsys):
    plan = _compile(mlp()).plan
    assert "priced at 0 FLOPs" not in capsys.readouterr().err
    assert "unpriced_flops" not in plan.predicted and "not priced" not in table(plan)
