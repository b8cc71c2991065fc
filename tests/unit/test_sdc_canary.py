"""Compute canaries as a plan setting and a run flag (Note [compute canaries] in
runtime/resilience/canary.py, Note [canary price] in partitioner/solver/canary_cost.py): the price
(bubble used, else extra) in the predicted step, ``sdc_canary_every`` from compile to the program
object, `inspect` saying it, every refusal with its fix, the blame rule, and --fault-matmul."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import partitioner
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import mlp
from partitioner.solver.canary_cost import canary_seconds
from partitioner.solver.plan import Plan
from runtime.launch.run_options import FlagError, RunOptions
from runtime.program.spec import load_program
from runtime.resilience import faults
from runtime.program.schedules import schedule_named
from runtime.resilience.canary_rules import program_refusal, refusal


def _stage(compute_s, fwd=1.0, bwd=2.0, comm_s=0.0):
    return SimpleNamespace(compute_time_s=compute_s, comm_time_s=comm_s, fwd_flops=fwd, bwd_flops=bwd)


def test_the_price_uses_the_bubble_and_charges_what_does_not_fit():
    one = [_stage(0.3)]  # one stage: no bubble, the whole re-run is extra
    per_step, used = canary_seconds(one, every=5, world_size=2, latency_s=0.0)
    assert per_step == pytest.approx(0.3 / 5) and used == 0.0
    # two stages: stage 1 waits for stage 0's backward (2/3 of 0.3 s); its re-run (0.1 s) fits there, and
    # stage 0's (0.3 s) does not fit anywhere: the step pays stage 0's
    two = [_stage(0.3), _stage(0.1)]
    per_step, used = canary_seconds(two, every=2, world_size=4, latency_s=0.0)
    assert per_step == pytest.approx(0.3 / 2) and used == pytest.approx(0.1)
    assert canary_seconds(two, every=0, world_size=4) == (0.0, 0.0)
    assert canary_seconds(two, every=4, world_size=4, latency_s=0.0)[0] == pytest.approx(0.3 / 4)  # amortised


def test_refusals_name_the_value_and_the_fix():
    assert refusal(0, dp=1) is None and refusal(3, dp=2) is None
    assert "dp 1" in refusal(3, dp=1) and "--sdc-canary-every 3" in refusal(3, dp=1)
    assert "--tp 1" in refusal(3, dp=2, tensor_parallel=2)
    assert "--schedule 1f1b" in refusal(3, dp=2, local_stages=2)
    assert "--shard-optimizer off" in refusal(3, dp=2, sharded=True)
    program = {"dp": 2, "num_stages": 4, "world_size": 4, "tensor_parallel": 1}  # 2 ranks a pipeline: interleaved
    assert "interleaved" in program_refusal(program, 2)
    for schedule in ("zb", "zbv"):  # a split backward: B and W are separate actions (Note [zero-bubble schedules])
        assert "--schedule 1f1b" in refusal(3, dp=2, schedule=schedule_named(schedule))
        assert f"schedule {schedule} splits it" in program_refusal({**program, "num_stages": 2, "schedule": schedule}, 2)
    with pytest.raises(FlagError, match="--sdc-canary-every -1"):
        RunOptions(features={"sdc_canary_every": -1})
    with pytest.raises(FlagError, match="--fault-matmul 5:1"):
        RunOptions(fault_matmul=("5:1",)).check_for(world_size=4, sharded=False, steps=8)
    with pytest.raises(ValueError, match="RANK:STEP"):
        faults.parse_fault_matmul("1:2:sometimes")
    assert faults.parse_fault_matmul("1:2:permanent") == faults.MatmulFault(1, 2, True)


def test_the_flags_travel_to_the_ranks():
    options = RunOptions.parse(["--sdc-canary-every", "4", "--fault-matmul", "1:3", "--fault-matmul", "2:5:permanent"],
                               side="run")
    assert options.features["sdc_canary_every"] == 4 and options.fault_matmul == ("1:3", "2:5:permanent")
    assert RunOptions.parse(options.to_argv(), side="rank") == options


def test_a_faulty_matmul_changes_the_first_product_only_while_armed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    clean = model(x)
    hook = faults.matmul_hook([faults.MatmulFault(0, 2)], 0, [model])
    hook(1)
    assert torch.equal(model(x), clean)  # not yet armed
    hook(2)
    assert not torch.equal(model(x), clean)
    hook(1)  # a rollback: the transient fault is gone
    hook(2)
    assert torch.equal(model(x), clean)
    assert faults.matmul_hook([faults.MatmulFault(1, 2)], 0, [model]) is None  # another rank's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_faulty_matmul_moves_every_product_in_every_precision(dtype):
    """Under bf16-mixed (autocast, the GPU default) the old x * (1 + 1e-3) rounded back to x:
    the drill armed, said so, and faulted nothing (Note [a faulty matmul])."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)

    def product():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            return model(x)

    clean = product()
    assert clean.dtype == dtype
    hook = faults.matmul_hook([faults.MatmulFault(0, 0)], 0, [model])
    hook(0)
    faulty = product()
    moved = (faulty != clean) | (clean == 0)
    assert bool(moved.all()), f"{int((~moved).sum())} of {clean.numel()} {dtype} products unmoved"


def test_blame_by_majority_with_three_replicas_and_the_pair_with_two():
    from runtime.resilience.canary import ComputeCanary

    def blamed(groups, table):
        canary = object.__new__(ComputeCanary)
        canary.layout = SimpleNamespace(dp_groups=groups, stages_of_rank={r: (0,) for g in groups for r in g})
        return sorted({r for v in canary.verdicts(table) for r in v.blamed})

    # ring 0 -> 1 -> 2 -> 0; a row is [owner the rank verified, mask of the parts that differ]
    assert blamed(((0, 1, 2),), [[2, 0], [0, 0], [1, 0]]) == []
    assert blamed(((0, 1, 2),), [[2, 0], [0, 9], [1, 9]]) == [1]  # 1's record and 1's re-run of 0's
    assert blamed(((0, 1),), [[1, 1], [0, 1]]) == [0, 1]


def _compile(tmp_path, name, **training):
    plan = partitioner.compile(mlp(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=1,
                               dp=2, microbatches=2, training=training or None)
    plan.save(tmp_path / name)
    return tmp_path / name


def test_sdc_canary_every_travels_from_compile_to_the_program_and_is_priced(tmp_path, capsys):
    off, on = _compile(tmp_path, "off", sdc_every=0), _compile(tmp_path, "on", sdc_every=0, sdc_canary_every=4)
    plan_off, plan_on = Plan.load(off), Plan.load(on)
    assert plan_on.decisions.features["sdc_canary_every"] == 4 and load_program(str(on)).features["sdc_canary_every"] == 4
    assert "sdc_canary_every" not in load_program(str(off)).features and "sdc_canary_every" not in plan_off.decisions.to_dict()
    extra = plan_on.predicted["sdc_canary_s_per_step"]
    assert extra > 0  # one stage: no bubble to hide the re-run in
    assert plan_on.predicted["step_time_s"] - plan_off.predicted["step_time_s"] == pytest.approx(extra, rel=1e-9)
    assert extra > plan_on.stages[0].compute_time_s / 4  # the re-run of a microbatch, amortised over K, and more
    assert main(["inspect", str(on)]) == 0
    assert "compute canary  a replica re-runs one microbatch of each stage every 4 steps" in capsys.readouterr().out
    assert main(["inspect", str(on), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["sdc_canary_s_per_step"] == pytest.approx(extra)


def test_compile_refuses_canaries_without_a_second_replica(tmp_path, capsys):
    assert main(["compile", "mlp", "-o", str(tmp_path / "bad"), "--dp", "1", "--stages", "1", "--quiet",
                 "--sdc-canary-every", "3"]) == 2
    err = capsys.readouterr().err
    assert "sdc_canary_every=3" in err and "dp 1" in err and not (tmp_path / "bad").exists()
