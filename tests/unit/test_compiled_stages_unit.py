"""Compiled stages' pieces in one process (Notes [compiled stages] in runtime/execute/compile_stages.py,
[masks outside the compiled graph] in runtime/execute/randomness.py): the keyed masks under
torch.compile, the setting from job file to plan.json, the flag."""

from __future__ import annotations

import os

import pytest
import torch

from partitioner.cli.commands import build_parser
from partitioner.config.settings import TrainingSettings
from runtime.execute import randomness
from runtime.execute.compile_stages import compile_stage
from runtime.execute.recompute import checkpointed
from runtime.execute.recompute import checkpointed as checkpointed_eager

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # one compile thread: shared cores


def _random_block(x):
    """Every keyed draw a stage file makes, in one function."""
    y = randomness.dropout(x, 0.3, True, op="dropout", batch_dim=0)
    y, keep = randomness.native_dropout(y * 2.0, 0.2, True, op="native_dropout", batch_dim=0)
    q = y.view(x.shape[0], 2, x.shape[1], x.shape[2] // 2)
    z = randomness.attention(q, q, q, None, 0.25, True, op="attention", batch_dim=0)
    table = randomness.rand([4], op="table", batch_dim=None)
    return z.sum(dim=(1, 3)) + table.sum(), keep


class _RecomputingStage(torch.nn.Module):
    """What a stage file that recomputes a region looks like (partitioner/codegen/stage_code.py)."""

    def forward(self, x):
        return checkpointed(self.recompute_block, x * 1.0)

    def recompute_block(self, x):
        return _random_block(x)[0]


def test_compiled_masks_are_the_eager_ones_for_every_microbatch_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_random_block, backend=counter, dynamic=False)
    x = torch.randn(3, 5, 8, requires_grad=True)
    for step, microbatch in ((0, 0), (0, 1), (1, 0), (7, 3)):
        randomness.set_context(seed=5, step=step, first_sample=3 * microbatch, microbatch=microbatch)
        eager, keep_eager = _random_block(x)
        got, keep_got = compiled(x)
        assert torch.equal(keep_got, keep_eager), (step, microbatch)  # the same elements dropped
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)  # fused sums round differently
        grad_eager, = torch.autograd.grad(eager.sum(), x)
        grad_got, = torch.autograd.grad(got.sum(), x)
        torch.testing.assert_close(grad_got, grad_eager, rtol=1e-4, atol=5e-5)
    # the context is read when the op runs: one graph for every step and microbatch
    assert counter.frame_count == 1


def test_a_recompute_rerun_in_backward_draws_the_forward_masks_under_compile():
    """The region compiled on its own, its checkpoint a graph break: the backward's rerun happens
    when the context names a later microbatch (as under 1F1B) and must still draw this one's."""
    stage = compile_stage(_RecomputingStage())
    assert globals()["checkpointed"] is not checkpointed_eager  # the stage file's name: a graph break now
    x = torch.randn(2, 5, 8, requires_grad=True)
    randomness.set_context(seed=1, step=2, first_sample=0, microbatch=0)
    want, = torch.autograd.grad(_random_block(x)[0].sum(), x)
    out = stage(x)
    randomness.set_context(seed=1, step=2, first_sample=2, microbatch=1)  # another microbatch's forward
    out.sum().backward()  # reentrant checkpoint: no inputs= (as the pipeline's backward)
    torch.testing.assert_close(x.grad, want, rtol=1e-4, atol=5e-5)


def test_the_setting_travels_from_job_file_to_the_program_and_is_checked():
    assert TrainingSettings.from_dict({"compile_stages": True}).to_dict()["compile_stages"] is True
    assert "compile_stages" not in TrainingSettings().to_dict()  # left out: off, and plan.json unchanged
    with pytest.raises(ValueError, match="compile_stages = 'yes' must be true or false"):
        TrainingSettings.from_dict({"compile_stages": "yes"})
    from partitioner.config.job import nested_training

    assert nested_training({"compile_stages": True}, "[training]") == {"compile_stages": True}  # the job file's key
    args = build_parser().parse_args(["compile", "gpt", "-o", "out", "--compile-stages"])
    assert args.compile_stages is True
    assert build_parser().parse_args(["compile", "gpt", "-o", "out"]).compile_stages is False


def test_tensor_parallel_compiled_stages_compile_and_only_zero_bubble_is_refused(tmp_path):
    """tp 2 with compiled stages compiles (Note [compiled stages]); its stage file runs keyed attention
    on each rank's heads; a DTensor stage pays no per-op dispatch in the price (Note [compiled
    regions priced]); zb/zbv are still refused (Note [zero-bubble schedules])."""
    import dataclasses

    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import hf_llama
    from partitioner.solver.tensor_groups import dtensor_op_s
    from runtime.program.spec import load_program

    def plan(compiled, **options):
        return partitioner.compile(hf_llama(layers=1, width=32, heads=4, vocab=64, seq=8, dropout=0.1), global_batch=4,
                                   cluster=ClusterSpec.homogeneous(2, "cpu"), machine_profile="preset",
                                   training={"compile_stages": compiled}, **options)

    compiled, eager = plan(True, tensor_parallel=2), plan(False, tensor_parallel=2)
    assert compiled.tensor_parallel == 2
    assert dtensor_op_s(compiled.problem, "cpu") == 0.0 < dtensor_op_s(eager.problem, "cpu")
    assert compiled.predicted["step_time_s"] < eager.predicted["step_time_s"]
    compiled.save(tmp_path / "out")
    assert "randomness.tensor_parallel_attention(" in (tmp_path / "out" / "stage_0.py").read_text()
    program = load_program(str(tmp_path / "out"))
    assert program.compile_stages is True and program.tensor_parallel == 2
    for schedule in ("zb", "zbv"):  # a split backward is not one compiled graph (Note [zero-bubble schedules])
        with pytest.raises(ValueError, match=f"compile_stages with schedule {schedule} does not run yet.*--schedule 1f1b"):
            dataclasses.replace(program, schedule=schedule)


def test_keyed_attention_on_a_slice_of_the_heads_is_that_slice_of_the_whole():
    """A tensor-parallel rank runs keyed attention on its heads (randomness.tensor_parallel_attention): the
    mask is drawn for every head and sliced, so each slice drops what the whole model drops."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    randomness.set_context(seed=3, step=1, first_sample=2, microbatch=1)
    whole = randomness.attention(q, k, v, mask, 0.3, False, op="sdpa_3", batch_dim=0)
    pieces = [randomness.attention(q.chunk(2, 1)[i], k.chunk(2, 1)[i], v.chunk(2, 1)[i], mask, 0.3, False,
                                   op="sdpa_3", batch_dim=0, heads=(i, 2)) for i in range(2)]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=0, atol=1e-6)
    # and the mask is the keyed one: another op name drops other elements
    other = randomness.attention(q.chunk(2, 1)[0], k.chunk(2, 1)[0], v.chunk(2, 1)[0], mask, 0.3, False,
                                 op="sdpa_4", batch_dim=0, heads=(0, 2))
    assert not torch.allclose(other, pieces[0])


def test_calibration_measures_compiled_regions_and_a_profile_measured_the_other_way_is_refused():
    """Note [compiled regions priced] in partitioner/calibrate/measure.py."""
    import partitioner
    from partitioner.calibrate import DeviceProfile, DirectionFit, calibrate
    from partitioner.config.cluster import ClusterSpec
    from partitioner.frontend.analysis import annotate, trace_keyed
    from partitioner.models.builtin import mlp

    workload = mlp()
    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity="block", loss_outside_graph=True)
    profile = calibrate(workload, gm, warmup=1, repeats=2, compiled=True)
    assert profile.meta["compiled"] is True
    assert {row["kind"] for row in profile.measurements} == {"region"}  # no single ops: each a compile of its own
    assert all(row["fwd_s"] > 0 for row in profile.measurements)

    fit = DirectionFit(0.0, 0.0, 0.0, 0.0)
    eager = DeviceProfile("cpu", fit, fit, meta={"precision": "fp32"})
    cluster = ClusterSpec.homogeneous(2, "cpu")
    with pytest.raises(ValueError, match="measured eager, but this plan compiles its stages: recalibrate with "
                                         "--calibrate --compile-stages"):
        partitioner.compile(mlp(), cluster=cluster, global_batch=4, profiles=[eager], training={"compile_stages": True})
    with pytest.raises(ValueError, match="measured with compiled regions, but this plan runs eager stages"):
        partitioner.compile(mlp(), cluster=cluster, global_batch=4, profiles=[profile])
    plan = partitioner.compile(mlp(), cluster=cluster, global_batch=4, profiles=[profile],
                               training={"compile_stages": True})
    assert plan.num_stages >= 1
