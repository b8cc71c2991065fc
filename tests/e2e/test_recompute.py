"""Regions the plan recomputes run under activation checkpointing (partitioner/codegen/recompute.py,
runtime/execute/recompute.py), on devices whose memory makes the solver choose it.

The twin of every recompute folder is the same plan with no region recomputed ("plain"): same
weights, same seeds, same stage boundaries; only the checkpointing differs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch

import partitioner
from tests.drivers import RUN_MANY
from runtime.launch.torchrun import run_env, torchrun_command
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from partitioner.cli.verify import check_run
from runtime.execute.stage import build_stage

STEPS = 3


def small_devices(memory_bytes: int, count: int = 2) -> ClusterSpec:
    return ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": count, "memory_bytes": memory_bytes}]})


def compile_pair(root: Path, workload, *, memory_bytes: int, **options):
    """(plan, recompute folder, plain folder): the plan compiled for devices of ``memory_bytes``, and
    the same plan with recompute switched off."""
    plan = partitioner.compile(workload, cluster=small_devices(memory_bytes), global_batch=8, num_stages=2,
                               microbatches=4, **options)
    plain = dataclasses.replace(plan, plan=dataclasses.replace(
        plan.plan, regions=tuple(dataclasses.replace(r, recompute=False) for r in plan.regions)))
    plan.save(root / "recompute")
    plain.save(root / "plain")
    return plan, root / "recompute", root / "plain"


def forward_backward(folder: Path, stage: int, inputs, seed: int):
    """One forward (under a counter of the bytes autograd saves) and backward of a stage built from
    ``folder``; returns (output, gradients by original name, saved bytes)."""
    module = build_stage(str(folder), stage)
    module.train()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    _seed(seed)  # what the runtime does before a stage forward (Note [randomness per microbatch])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    _seed(seed + 1)  # as under 1F1B: another microbatch's forward runs before this backward
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return out.detach(), {n: p.grad for n, p in module.named_parameters()}, sum(saved)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    try:  # keyed randomness, where the branch has it (Note [recompute draws the same randomness])
        from runtime.execute import randomness
    except ImportError:
        return
    if hasattr(randomness, "set_context"):
        randomness.set_context(seed=seed, step=0, first_sample=0, microbatch=seed)


@pytest.fixture(scope="module")
def dropout_pair(tmp_path_factory):
    # 680 KB devices: stage 0 needs ~800 KB without recompute (dropout 0.1 saves its masks too).
    return compile_pair(tmp_path_factory.mktemp("dropout"), gpt(layers=4, width=32, heads=2, vocab=64, seq=16,
                                                                 dropout=0.1), memory_bytes=680_000)


def test_recomputed_stage_gives_the_plain_stage_gradients_and_saves_less(dropout_pair):
    """Dropout 0.1: the recompute must draw the first forward's masks (Note [recompute draws the same
    randomness]), or the gradients differ from the plain stage's."""
    plan, recompute, plain = dropout_pair
    assert [r.name for r in plan.regions if r.recompute], "the devices were meant to force recompute"
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out_r, grads_r, saved_r = forward_backward(recompute, 0, (tokens,), seed=123)
    out_p, grads_p, saved_p = forward_backward(plain, 0, (tokens,), seed=123)
    assert torch.equal(out_r, out_p)
    assert grads_r.keys() == grads_p.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_r[name], grads_p[name], rtol=0, atol=1e-7, msg=name)
    assert saved_r < 0.75 * saved_p, (saved_r, saved_p)


def test_recompute_without_the_randomness_context_would_draw_other_masks(dropout_pair, monkeypatch):
    """The check above can fail: with the forward's randomness context not made current again for
    the rerun, the recompute's masks differ."""
    import runtime.execute.recompute as rc

    _, recompute, plain = dropout_pair
    monkeypatch.setattr(rc, "_replay", lambda fn, context, *args: fn(*args))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    _, grads_r, _ = forward_backward(recompute, 0, (tokens,), seed=123)
    _, grads_p, _ = forward_backward(plain, 0, (tokens,), seed=123)
    assert any(not torch.allclose(grads_r[n], grads_p[n]) for n in grads_p)


def test_stage_file_says_what_it_recomputes_and_why(dropout_pair):
    plan, recompute, plain = dropout_pair
    text = (recompute / "stage_0.py").read_text()
    regions = [r.name for r in plan.regions if r.recompute and r.stage == 0]
    for region in regions:
        method = "recompute_" + region.replace(".", "_")
        assert f"checkpointed(self.{method}," in text
        assert f"def {method}(self," in text
    words = " ".join(text.split())
    assert "The plan chose it because memory binds on this stage's device" in words and "capacity" in words
    compile(text, "stage_0.py", "exec")
    imports = {line.split()[1] for line in text.splitlines() if line.startswith(("import ", "from "))}
    # `from runtime.execute import randomness`: the model has dropout, drawn keyed (runtime/execute/randomness.py);
    # `import torch.nn.functional as F`: the stage's calls spelled as a person writes them (partitioner/codegen/spelling.py)
    assert imports == {"torch", "torch.nn.functional", "runtime.execute.recompute", "runtime.execute"}
    # Checkpoints stay keyed by original names: the stage holds the same parameters as the plain one.
    for k in range(plan.num_stages):
        names = lambda folder: [n for n, _ in build_stage(str(folder), k).named_parameters()]  # noqa: E731
        assert names(recompute) == names(plain)


def test_plan_that_fits_only_through_recompute_runs_within_capacity(tmp_path):
    """Devices of 1.3 MB: stage 0 needs ~1.6 MB unless it recomputes. Both programs train in one
    torchrun launch with peak memory measured per rank (runtime/observe/memory.py)."""
    capacity = 1_300_000
    plan, recompute, plain = compile_pair(tmp_path, gpt(layers=4, width=32, heads=2, vocab=64, seq=64),
                                          memory_bytes=capacity)
    assert any(r.recompute for r in plan.regions)
    command = torchrun_command(RUN_MANY, 2, args=[recompute, "--steps", STEPS, "--", plain, "--steps", STEPS])
    done = subprocess.run(command, env={**run_env(), "PARTITIONER_MEASURE_MEMORY": "1"},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "peak memory per rank, measured / predicted / capacity" in done.stdout

    def peaks(folder):
        rows = [json.loads(p.read_text()) for p in sorted((folder / "run").glob("memory_rank_*.json"))]
        return {row["rank"]: row for row in rows}

    measured, without = peaks(recompute), peaks(plain)
    assert sorted(measured) == [0, 1]
    for rank, row in measured.items():
        assert row["capacity_bytes"] == capacity
        assert row["measured_peak_bytes"] <= capacity, row
    recomputing = {plan.stages[r.stage].ranks[0] for r in plan.regions if r.recompute}
    # Without recompute the same program does not fit: on some recomputing rank the plain twin
    # measures over capacity (the conservative memory model may recompute on a rank with a little
    # real slack too; Note [memory model] in partitioner/solver/evaluate.py).
    assert any(without[rank]["measured_peak_bytes"] > capacity for rank in recomputing), without
    report = check_run(recompute, recompute / "run", steps=STEPS, workload=gpt(
        layers=4, width=32, heads=2, vocab=64, seq=64))
    assert report.ok, report.text()
    assert report.oracle == "original model"
