"""Buffers end to end, on a small BatchNorm CNN (tests/_bn_workload.py) compiled to 2 stages:

- a buffer read on two stages is held by both, not a tie, and the plan runs;
- the running statistics (buffers the forward updates) live on the stage that updates them, are
  listed in MUTABLE_BUFFERS, end in final/, and match the one-process oracle (verify), also under
  data parallelism (replica 0's buffers broadcast after each step; the oracle reproduces that);
- a drifted running mean fails verify;
- checkpoints (disk and memory tier) carry them, load into another partition, and a SIGKILLed rank
  resumes bit-exact, buffers and numpy's / Python's generators included;
- a buffer updated on one stage and read (before the update) on another is refused, naming it.

One torchrun launch of 2 workers trains every folder (tests/drivers/run_many.py); the
killed job comes last, so torchrun's restart re-runs the others as resumes of finished runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import partitioner
from _bn_workload import workload
from _checkpoint_helpers import FakeTrainer
from _runtime_folders import REPO, child_env, one_thread  # noqa: F401
from partitioner.config.cluster import ClusterSpec
from partitioner.cli.verify import check_run, read_program_buffers
from runtime.resilience import checkpoint as ck
from runtime.resilience import memtier as mt
from runtime.program.spec import load_program
from tests.drivers import RUN_MANY
from runtime.launch.torchrun import torchrun_command

STEPS, EVERY = 6, 2
RUNNING = ["bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked",
           "bn2.running_mean", "bn2.running_var", "bn2.num_batches_tracked"]


def _compile(folder, *, stages, dp, noise=0.0):
    plan = partitioner.compile(workload(noise=noise), cluster=ClusterSpec.homogeneous(stages * dp, "cpu"),
                               global_batch=8, num_stages=stages, dp=dp, microbatches=2)
    plan.save(folder)
    return plan


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("buffers")
    plans = {"two": _compile(root / "two", stages=2, dp=1),
             "noisy": _compile(root / "noisy", stages=2, dp=1, noise=0.1),
             "dp": _compile(root / "dp", stages=1, dp=2)}
    jobs = [[root / "two", "--steps", str(STEPS)],
            [root / "dp", "--steps", str(STEPS)],
            [root / "noisy", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
             "--run-dir", root / "noisy_full", "--checkpoint-dir", root / "ck_full"],
            # rank 1 (stage 1: every running statistic) killed before step 3, after the step-2 checkpoint
            [root / "noisy", "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--fail-at", "1:3:kill",
             "--run-dir", root / "noisy_killed", "--checkpoint-dir", root / "ck_killed"]]
    args = [str(a) for job in jobs for a in job + ["--"]]
    cmd = torchrun_command(RUN_MANY, 2, args=args, max_restarts=1)
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return root, plans, done.stdout + done.stderr


def _stage_list(folder, k, name):
    namespace: dict = {}
    exec(compile((folder / f"stage_{k}.py").read_text(), "stage", "exec"), namespace)
    return namespace[name]


def test_buffer_read_on_two_stages_is_held_by_both_not_tied(runs):
    root, plans, _ = runs
    assert plans["two"].ties == ()
    assert load_program(str(root / "two")).ties == ()
    assert "gain" in _stage_list(root / "two", 0, "BUFFERS") and "gain" in _stage_list(root / "two", 1, "BUFFERS")
    assert json.loads((root / "two" / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == STEPS - 1


def test_running_statistics_live_on_their_stage(runs):
    root, _, _ = runs
    assert _stage_list(root / "two", 0, "MUTABLE_BUFFERS") == []
    assert sorted(_stage_list(root / "two", 1, "MUTABLE_BUFFERS")) == sorted(RUNNING)
    assert "gain" not in _stage_list(root / "two", 1, "MUTABLE_BUFFERS")


def test_two_stages_verify_with_buffers(runs):
    root, _, _ = runs
    report = check_run(root / "two", root / "two" / "run", steps=STEPS, workload=workload())
    assert report.ok, report.text()
    buffers = read_program_buffers(root / "two" / "run")
    assert sorted(buffers) == sorted(RUNNING)
    assert int(buffers["bn1.num_batches_tracked"]) == STEPS * 2  # every microbatch, once
    assert float((buffers["bn1.running_var"] - 1).abs().min()) > 0.1  # moved away from the initial 1


def test_data_parallel_replicas_take_replica_zero_buffers(runs):
    root, _, _ = runs
    report = check_run(root / "dp", root / "dp" / "run", steps=STEPS, workload=workload())
    assert report.ok and report.max_replica_diff == 0.0, report.text()
    buffers = read_program_buffers(root / "dp" / "run")
    assert int(buffers["bn1.num_batches_tracked"]) == STEPS * 2  # replica 0's two microbatches a step


def test_drifted_running_mean_fails_verify(runs, tmp_path):
    root, _, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "two" / "run", run)
    path = run / "final" / "buffers_rank_1.safetensors"
    buffers = load_file(str(path))
    buffers["bn2.running_mean"] = buffers["bn2.running_mean"] + 1e-2
    save_file(buffers, str(path))
    report = check_run(root / "two", run, steps=STEPS, workload=workload())
    assert not report.ok and report.worst_buffer == "bn2.running_mean", report.text()


def test_killed_rank_resumes_bit_exact_with_buffers(runs):
    root, _, out = runs
    assert "fault injection: kill before step 3" in out
    full, killed = root / "noisy_full", root / "noisy_killed"
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["loss"] for r in rows(killed)] == [r["loss"] for r in rows(full)]
    for pattern in ("rank_{}", "optim_rank_{}", "buffers_rank_{}"):
        for rank in range(2):
            got = load_file(str(killed / "final" / (pattern.format(rank) + ".safetensors")))
            want = load_file(str(full / "final" / (pattern.format(rank) + ".safetensors")))
            assert sorted(got) == sorted(want)
            for name in want:
                assert torch.equal(got[name], want[name]), (pattern, rank, name)
    assert sorted(load_file(str(killed / "final" / "buffers_rank_1.safetensors"))) == sorted(RUNNING)


def test_checkpoint_of_buffers_round_trips_and_reshards(runs, tmp_path):
    """Disk and memory tier carry the buffers bit for bit; a 2-stage checkpoint loads into the
    1-stage x dp 2 program (keyed by original names)."""
    root, _, _ = runs
    folder, program = str(root / "two"), load_program(str(root / "two"))
    trainer = FakeTrainer(folder, 1, program)
    with torch.no_grad():
        for i, buffer in enumerate(trainer.named_mutable_buffers().values()):
            buffer.add_(i + 1)
    first = FakeTrainer(folder, 0, program)
    first.steps_done = trainer.steps_done = 2
    want = {n: b.clone() for n, b in trainer.named_mutable_buffers().items()}
    snaps = [ck.snapshot(first), ck.snapshot(trainer)]
    ck.commit_local(str(tmp_path / "ck"), snaps, program)
    fresh = FakeTrainer(folder, 1, program)
    ck.restore(fresh, ck.load_for_rank(str(tmp_path / "ck"), 2, program, 1, ck.state_names(program, [1])))
    for name, value in want.items():
        assert torch.equal(fresh.named_mutable_buffers()[name], value), name
    # the memory tier writes the same shard through ck.state_entries
    store = mt.LocalStore(str(tmp_path / "shm"), 1, mt.plan_redundancy((0, 1), mode="none"), program.plan_hash)
    slot, nbytes, _ = store.snapshot(trainer)
    store.commit_own(slot, 2, nbytes)
    loaded = ck.loaded_from_bytes(slot.verify(slot.record()), step=2, program=program, rank=1,
                                  needed=ck.state_names(program, [1]), where="slot")
    fresh = FakeTrainer(folder, 1, program)
    ck.restore(fresh, loaded)
    for name, value in want.items():
        assert torch.equal(fresh.named_mutable_buffers()[name], value), name
    # another partition: one stage per replica holds every buffer
    other = load_program(str(root / "dp"))
    for rank in range(2):
        resharded = FakeTrainer(str(root / "dp"), rank, other)
        ck.restore(resharded, ck.load_for_rank(str(tmp_path / "ck"), 2, other, rank, ck.state_names(other, [0])))
        for name, value in want.items():
            assert torch.equal(resharded.named_mutable_buffers()[name], value), name


def test_host_generators_are_seeded_and_checkpointed():
    from runtime.execute.train import seed_host_generators

    seed_host_generators(7)
    first = (np.random.random(), random.random(), float(torch.rand(())))
    seed_host_generators(7)
    tensors, meta = ck.capture_rng()
    assert (np.random.random(), random.random(), float(torch.rand(()))) == first
    ck.restore_rng(tensors, meta)
    assert (np.random.random(), random.random(), float(torch.rand(()))) == first


class _ReadThenUpdatedElsewhere(torch.nn.Module):
    """``count`` is read by the first layer and updated in place after the last: split between
    them, the first stage's copy would never see an update. (A read after the update is fine:
    export makes it read the update's result, an activation that crosses stages like any other.)"""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        out = self.b(torch.tanh(self.a(x) + self.count))
        self.count.add_(1)
        return out


def test_buffer_updated_on_one_stage_and_read_on_another_is_refused():
    from partitioner.codegen.split import check_mutable_buffers, mutated_buffers
    from partitioner.frontend.trace import trace

    gm = trace(_ReadThenUpdatedElsewhere(), (torch.zeros(2, 4),)).gm
    assert list(mutated_buffers(gm)) == ["count"]
    compute = [n for n in gm.graph.nodes if n.op != "get_attr"]
    half = len(compute) // 2
    stage_of = {n.name: int(i >= half) for i, n in enumerate(compute)}
    stage_of.update({n.name: 0 for n in gm.graph.nodes if n.op == "get_attr"})
    with pytest.raises(ValueError, match=r"buffer 'count' is updated in place .* read on stages \[0, 1\]"):
        check_mutable_buffers(gm, stage_of)
    check_mutable_buffers(gm, {n: 0 for n in stage_of})  # one stage: fine


def test_a_mutable_buffer_on_two_stages_is_refused_at_load(runs):
    from runtime.program.spec import Program

    root, _, _ = runs
    program = load_program(str(root / "two"))
    data = program.to_dict()
    data["stages"][0]["mutable_buffers"] = ["bn1.running_mean"]
    with pytest.raises(ValueError, match=r"mutable buffer 'bn1.running_mean' is listed by stages 0 and 1"):
        Program.from_dict(data)


def test_a_held_buffer_costs_memory_not_time():
    """The solver's check holds a buffer on every stage that reads it (its bytes on each) but
    prices no gradient sum for it, unlike a tied parameter."""
    from partitioner.solver import problem as sp
    from partitioner.solver.evaluate import evaluate

    regions = tuple(sp.RegionCost(name=f"r{i}", fwd_flops_per_sample=1e6, bwd_flops_per_sample=2e6, param_bytes=1000,
                              grad_bytes=1000, optimizer_bytes=2000, activation_bytes_per_sample=10,
                              recompute_activation_bytes_per_sample=10)
                    for i in range(2))
    split = sp.Assignment(stage_of_region=(0, 1), recompute=(False, False), device_of_stage_replica=((0,), (1,)),
                          num_stages=2, dp=1, num_microbatches=2, microbatch_size=1, schedule="1f1b")
    costs = {}
    for kind, tie in (("param", sp.SharedParam((0, 1), 400)), ("buffer", sp.SharedParam((0, 1), 400, grad_bytes=0, optimizer_bytes=0))):
        problem = sp.PartitionProblem(regions=regions, edges=(sp.Edge(0, 1, 10),), ties=(tie,))
        costs[kind] = evaluate(problem, ClusterSpec.homogeneous(2, "cpu"), split)
    assert costs["buffer"].ties[0].cost_s == 0.0 < costs["param"].ties[0].cost_s
    held = costs["buffer"].stages[1]
    assert (held.params_bytes, held.grads_bytes, held.optimizer_bytes) == (1400, 1000, 2000)


def test_a_region_that_updates_running_statistics_is_never_priced_as_saving_by_recompute():
    """Note [recompute never updates twice] holds: recomputing it would update the statistics twice."""
    from partitioner.frontend.analysis import analyze
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.codegen.split import updating_regions

    wl = workload()
    gm, _ = analyze(wl, granularity="node")
    problem = build_problem(gm, wl.example_batch_size)
    updating = updating_regions(gm)
    assert updating, "the BatchNorm nodes update buffers: some region must say so"
    for region in problem.regions:
        if region.name in updating:
            assert region.recompute_activation_bytes_per_sample >= region.activation_bytes_per_sample, region
