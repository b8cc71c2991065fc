"""The program does only the per-step work its plan prices (docs/design.md §12): a run counted from
inside, one rank in this process (world of one, gloo), as `python train.py` runs it.

- clipping off and fp32: no global-norm pass or collective (Note [global gradient norm] in
  runtime/execute/grad_norm.py), metrics.jsonl without ``grad_norm``, no autocast context entered (Note
  [mixed precision] in runtime/execute/precision.py);
- clipping on under bf16-mixed: the norm's all-reduce every step and autocast around the forward,
  so the counters above are seen to count.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import runtime.execute.grad_norm as grad_norm
from _runtime_folders import mlp_folder, one_thread, read_metrics  # noqa: F401
from runtime.launch.rank import main

STEPS = 2


@pytest.fixture
def counted(monkeypatch):
    """Counts of the world all-reduces, global-norm passes and autocast entries of one run."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "x")  # registers the key for restoration
        monkeypatch.delenv(key)
    counts = {"all_reduce": 0, "norm_pass": 0, "autocast_on": 0}
    real_all_reduce, real_squares = dist.all_reduce, grad_norm.squares_sum

    def all_reduce(tensor, *args, **kwargs):
        counts["all_reduce"] += 1
        return real_all_reduce(tensor, *args, **kwargs)

    def squares_sum(grads):
        counts["norm_pass"] += 1
        return real_squares(grads)

    class CountedAutocast(torch.autocast):
        def __enter__(self):
            counts["autocast_on"] += bool(self._enabled)
            return super().__enter__()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(grad_norm, "squares_sum", squares_sum)
    monkeypatch.setattr(torch, "autocast", CountedAutocast)
    return counts


def test_no_clipping_fp32_makes_no_norm_collective_and_no_autocast(tmp_path, counted):
    mlp_folder(str(tmp_path), splits=[[0, 1, 2, 3]], ranks=[([0], 0)], steps=STEPS)
    losses = main(str(tmp_path), argv=["--no-checkpoint"], exit_on_error=False)
    assert len(losses) == STEPS
    assert counted["norm_pass"] == 0
    assert counted["all_reduce"] == STEPS  # the step's loss only
    assert counted["autocast_on"] == 0
    assert all("grad_norm" not in row for row in read_metrics(str(tmp_path)))


def test_clipping_under_bf16_makes_the_norm_collective_and_autocasts(tmp_path, counted):
    mlp_folder(str(tmp_path), splits=[[0, 1, 2, 3]], ranks=[([0], 0)], steps=STEPS,
               extra={"precision": "bf16-mixed", "clip_grad_norm": 0.5})
    main(str(tmp_path), argv=["--no-checkpoint"], exit_on_error=False)
    assert counted["norm_pass"] == STEPS
    assert counted["all_reduce"] == 2 * STEPS  # the norm, then the loss
    assert counted["autocast_on"] >= STEPS  # the forward of every microbatch and its loss
    norms = [row["grad_norm"] for row in read_metrics(str(tmp_path))]
    assert len(norms) == STEPS and all(n > 0 for n in norms)


def test_the_norm_is_priced_only_where_the_program_computes_it():
    """Note [cost model]'s grad_norm term: the slowest stage's norm pass + the world's all-reduce
    latencies, when clipping (or fp16) makes the program compute it; nothing otherwise."""
    from partitioner.config.cluster import ClusterSpec
    from partitioner.solver import problem as sp
    from partitioner.solver.evaluate import evaluate
    from partitioner.solver.grad_norm_cost import NORM_BYTES_PER_S, computes_global_norm
    from runtime.program.parts import Precision

    regions = (sp.RegionCost("a", 1e6, 2e6, 4_000_000, 4_000_000, 8_000_000, 1024, 1024),
               sp.RegionCost("b", 1e6, 2e6, 16_000_000, 16_000_000, 32_000_000, 1024, 1024))
    problem = sp.PartitionProblem(regions, (sp.Edge(0, 1, 512),), input_bytes_per_sample=64)
    two = sp.Assignment(stage_of_region=(0, 1), recompute=(False, False), device_of_stage_replica=((0,), (1,)),
                        num_stages=2, dp=1, num_microbatches=2, microbatch_size=2, schedule="1f1b")
    cluster = ClusterSpec.homogeneous(2, "cpu", cores=4)
    off, on = evaluate(problem, cluster, two), evaluate(problem, cluster, two, global_norm=True)
    latency = cluster.link_between(0, 1).latency_s
    assert off.grad_norm_s == 0.0
    assert on.grad_norm_s == pytest.approx(16e6 / NORM_BYTES_PER_S["cpu"] + 2 * latency)  # stage 1's gradients
    assert on.step_time_s == pytest.approx(off.step_time_s + on.grad_norm_s, rel=1e-12)
    assert not computes_global_norm(None, Precision.FP32)
    assert computes_global_norm(1.0, Precision.FP32)
    assert computes_global_norm(None, Precision.FP16_MIXED)


def test_a_clipping_plan_predicts_its_norm(tmp_path):
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import mlp

    def plan(**training):
        return partitioner.compile(mlp(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=2,
                                   dp=1, microbatches=2, training=training or None)

    plain, clipped = plan(), plan(clip_grad_norm=1.0)
    assert plain.predicted["grad_norm_s_per_step"] == 0.0
    assert clipped.predicted["grad_norm_s_per_step"] > 0.0
    assert clipped.predicted["step_time_s"] == pytest.approx(
        plain.predicted["step_time_s"] + clipped.predicted["grad_norm_s_per_step"], rel=1e-9)
