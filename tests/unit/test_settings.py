"""The user's settings, the request and the compiler's decisions kept apart (Note [settings and
decisions] in partitioner/config/settings.py); the precision policy as one typed value."""

from __future__ import annotations

import copy
import json

import pytest

from partitioner.cli import main
from partitioner.config.job import TRAINING_SCHEMA, check_table
from partitioner.solver.plan import Plan
from partitioner.config.settings import Decisions, Request, TrainingSettings, split_legacy_training
from runtime.program.spec import load_program
from runtime.program.parts import OptimizerSettings, Precision

# the demo's compile (partitioner/cli/demo.py), smaller, with the settings that used to be rewritten
DEMO = ["compile", "gpt:layers=2,width=32,heads=2,vocab=64,seq=16", "--devices", "4", "--stages", "2",
        "--global-batch", "16", "--checkpoint-every", "5", "--memory-tier", "auto", "--lr", "3e-4", "-q"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("settings") / "demo"
    assert main([*DEMO, "-o", str(out)]) == 0
    return out


def test_the_demo_plans_training_block_reads_back_and_validates(demo):
    body = json.loads((demo / "plan.json").read_text())
    check_table(body["training"], TRAINING_SCHEMA, "plan.json training")  # raises on a decision in it
    settings = TrainingSettings.from_dict(body["training"])
    assert settings.to_dict() == body["training"]
    assert settings.optimizer.lr == 3e-4 and settings.checkpoint_every == 5 and settings.precision is None
    assert settings.memory_tier.mode == "auto"  # what was asked, not what was chosen
    chosen = Decisions.from_dict(body["decisions"])
    assert chosen.memory_tier["requested"] == "auto" and chosen.memory_tier["mode"] in ("none", "copy", "parity")
    assert chosen.precision is Precision.FP32 and chosen.sdc_every >= 0 and chosen.no_decay
    plan = Plan.load(demo)
    assert plan.training == settings and plan.decisions == chosen
    program = load_program(str(demo))  # the one read on the rank side
    assert program.precision is Precision.FP32 and program.optimizer.no_decay == chosen.no_decay
    assert program.optimizer.lr == settings.optimizer.lr and program.sdc_every == chosen.sdc_every


def test_compile_never_writes_into_the_users_settings():
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import load_workload

    asked = {"optimizer": {"lr": 3e-4}, "memory_tier": "auto"}
    kept = copy.deepcopy(asked)
    settings = TrainingSettings.from_dict(asked)
    compiled = partitioner.compile(load_workload("mlp"), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8,
                                   training=settings)
    assert asked == kept and compiled.plan.training is settings  # frozen, and the plan keeps what was asked
    assert compiled.plan.decisions.memory_tier is not None and settings.memory_tier.mode == "auto"


def test_a_plan_written_before_the_split_still_loads(demo):
    body = json.loads((demo / "plan.json").read_text())
    for key in ("program", "files", "program_hash", "problem", "assignment"):
        body.pop(key, None)
    chosen = body.pop("decisions")
    # how an older compile wrote it: its decisions inside "training"
    body["training"] = {**body["training"], "precision": chosen["precision"], "sdc_every": chosen["sdc_every"],
                        "shard_optimizer": chosen["shard_optimizer"], "memory_tier": chosen["memory_tier"],
                        "optimizer": {**body["training"]["optimizer"], "no_decay": chosen["no_decay"]}}
    body.pop("plan_hash")
    from partitioner.solver.plan import _hash_of

    body["plan_hash"] = _hash_of(body)
    plan = Plan.from_dict(body)
    assert plan.decisions == Decisions.from_dict(chosen)
    assert plan.training.memory_tier.mode == "auto" and plan.training.optimizer.lr == 3e-4
    settings, decisions = split_legacy_training(body["training"])
    assert decisions.shard_optimizer is chosen["shard_optimizer"] and settings.precision is Precision.FP32


def test_settings_are_checked_once_naming_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"training.seed = -1 must be >= 0"):
        TrainingSettings(seed=-1)
    with pytest.raises(ValueError, match=r"training.precision 'bf16' is not one of .*--precision"):
        TrainingSettings(precision="bf16")
    with pytest.raises(ValueError, match=r"shard_optimizer='maybe'"):
        Request(shard_optimizer="maybe")
    assert Request(shard_optimizer=True).shard_optimizer == "on"
    # one set of optimizer defaults: the compile's and a hand-written program's
    assert TrainingSettings().optimizer == OptimizerSettings() == OptimizerSettings.from_dict({})


def test_the_precision_policy_carries_what_acts_on_it():
    import torch

    assert [p.value for p in Precision] == ["fp32", "bf16-mixed", "fp16-mixed"]
    assert (Precision.FP32.autocast_dtype, Precision.BF16_MIXED.autocast_dtype,
            Precision.FP16_MIXED.autocast_dtype) == (None, torch.bfloat16, torch.float16)
    assert [p.compute_elem_bytes for p in Precision] == [4, 2, 2]
    assert [p.loss_scaling for p in Precision] == [False, False, True]
    assert Precision.default_for("cpu") is Precision.FP32 and Precision.default_for("h100") is Precision.BF16_MIXED
    assert json.dumps({"precision": Precision.FP16_MIXED}) == '{"precision": "fp16-mixed"}'  # plan.json's text
