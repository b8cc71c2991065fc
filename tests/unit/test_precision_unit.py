"""Single-process pieces of mixed precision, clipping, parameter groups and sharded optimizer
state: the no-decay choice, fp16's loss scale, the shard layout and stitching pieces back at any
dp degree, and what the cost model changes for a policy or for sharding."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import CheckpointCorruptError
from runtime.execute.grad_norm import no_decay_names, param_groups
from runtime.execute.precision import LossScaler, Precision, cast_outputs, clip_coefficient, wrap_forward
from runtime.parallel.zero import layout, piece_state


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: both names exempt


def test_no_decay_default_exempts_norms_biases_embeddings_and_their_aliases():
    names = no_decay_names(Net())
    assert set(names) == {"emb.weight", "head.weight", "ln.weight", "ln.bias", "fc.bias"}
    assert no_decay_names(Net(), "none") == []
    assert no_decay_names(Net(), ["*.bias"]) == ["ln.bias", "fc.bias"]
    with pytest.raises(ValueError, match="no_weight_decay"):
        no_decay_names(Net(), "everything")


def test_param_groups_put_exempt_parameters_at_zero_decay():
    net = Net()
    named = list(net.named_parameters(remove_duplicate=False))
    groups = param_groups(named, 0.1, no_decay_names(net))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [p for p in groups[0]["params"]] == [net.fc.weight]
    assert sum(len(g["params"]) for g in groups) == len(list(net.parameters()))  # the tie once


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps():
    s = LossScaler(True, 8.0, growth_interval=2)
    assert s.update(False) is False and s.scale == 4.0
    assert s.update(True) and s.update(True) and s.scale == 8.0
    off = LossScaler.for_policy(Precision.BF16_MIXED)
    assert off.scale == 1.0 and off.update(False) is True  # never skips without fp16
    assert clip_coefficient(10.0, 1.0) == pytest.approx(0.1, rel=1e-6) and clip_coefficient(0.5, 1.0) == 1.0


def test_wrap_forward_runs_under_autocast_and_casts_outputs_back():
    lin = torch.nn.Linear(4, 4)
    wrap_forward(lin, Precision.BF16_MIXED, "cpu", [torch.float32])
    out = lin(torch.randn(2, 4))
    assert out.dtype == torch.float32  # the plan's boundary dtype
    raw = torch.nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert raw(torch.randn(2, 4)).dtype == torch.bfloat16
    assert cast_outputs((torch.ones(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.long)),
                        [torch.float32, torch.float32])[1].dtype == torch.long  # integers untouched


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_layout_covers_every_element_once(dp):
    names, numels = ["a", "b", "c"], [5, 7, 3]
    seen = {n: [] for n in names}
    for replica in range(dp):
        pieces, length, padded = layout(names, numels, dp, replica)
        assert padded == length * dp >= sum(numels)
        for pc in pieces:
            seen[pc.name].append((pc.start, pc.end))
            assert 0 <= pc.flat_offset < length
    for n, numel in zip(names, numels):
        spans = sorted(seen[n])
        assert spans[0][0] == 0 and spans[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_piece_state_reshards_from_pieces_or_whole_state():
    full = torch.arange(10.0)
    pieces = {"w": [(0, 4, {"exp_avg": full[0:4]}), (4, 10, {"exp_avg": full[4:10]})]}
    assert torch.equal(piece_state("w", 2, 7, {}, pieces)["exp_avg"], full[2:7])  # across two pieces
    assert torch.equal(piece_state("w", 3, 9, {"w": {"exp_avg": full.view(2, 5)}}, {})["exp_avg"], full[3:9])
    assert piece_state("v", 0, 3, {}, {}) is None  # no state saved yet
    with pytest.raises(CheckpointCorruptError, match="missing"):
        piece_state("w", 0, 10, {}, {"w": [(0, 4, {"exp_avg": full[0:4]})]})


def test_sharded_problem_divides_optimizer_state_and_precision_adds_weight_copies():
    from partitioner.config.cluster import ClusterSpec
    from partitioner.solver.precision_cost import cluster_for_precision, precision_problem
    from partitioner.solver.problem import Edge, PartitionProblem, RegionCost
    from partitioner.solver.zero_choice import sharded_problem

    region = RegionCost("r", 1e6, 2e6, param_bytes=400, grad_bytes=400, optimizer_bytes=800,
                        activation_bytes_per_sample=10, recompute_activation_bytes_per_sample=5)
    problem = PartitionProblem(regions=(region, region), edges=(Edge(0, 1, 4),))
    sharded = sharded_problem(problem, 4)
    assert [r.optimizer_bytes for r in sharded.regions] == [200, 200]
    assert [r.param_bytes for r in sharded.regions] == [400, 400]
    mixed = precision_problem(problem, "bf16-mixed", 4)
    assert [r.param_bytes for r in mixed.regions] == [600, 600]  # fp32 weights + their bf16 copy
    assert precision_problem(problem, "fp32", 4) is problem
    h100 = ClusterSpec.homogeneous(1, "h100")
    assert cluster_for_precision(h100, "fp32").devices[0].flops_per_s == pytest.approx(26.8e12)
    assert cluster_for_precision(h100, "bf16-mixed").devices[0].flops_per_s == pytest.approx(396e12)


def test_calibration_fits_the_plans_precision_and_a_mismatched_profile_is_refused():
    from partitioner import compile as compile_plan
    from partitioner.calibrate import CalibrationConfig
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import mlp

    cluster = ClusterSpec.homogeneous(2, "cpu")
    compiled = compile_plan(mlp(), cluster=cluster, global_batch=8, precision="bf16-mixed",
                            calibrate=CalibrationConfig(repeats=1, warmup=0))
    assert compiled.plan.decisions.precision == "bf16-mixed"
    measured = CalibrationConfig(repeats=1, warmup=0).run(mlp(), _annotated(mlp()), precision="bf16-mixed")
    assert measured.meta["precision"] == "bf16-mixed"
    with pytest.raises(ValueError, match="fitted under precision bf16-mixed.*--precision bf16-mixed"):
        compile_plan(mlp(), cluster=cluster, global_batch=8, precision="fp32", profiles=[measured])


def _annotated(workload):
    from partitioner.frontend.analysis import annotate, trace_keyed

    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    return annotate(traced, granularity="block", optimizer="adamw", loss_outside_graph=True)
