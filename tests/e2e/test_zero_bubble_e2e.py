"""Compiled zero-bubble programs (Note [zero-bubble schedules] in partitioner/solver/zero_bubble.py)
under torchrun (gloo), against the one-process oracle: zbv on 2 ranks (4 stages in a V) with
dropout, resumed bit for bit after a checkpoint and after a rank is killed, and resharded onto a
1f1b program; zb on
pp 2 x dp 2 (4 ranks) with dropout, GPT-2's tied embedding across stages and recomputed regions
(Note [recompute under a split backward]); zbv on 4 ranks (8 stages). Every job in the session's
shared launches (tests/_shared_launch.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _shared_launch import Job, prepare
from partitioner import compile as compile_plan
from partitioner.cli.verify import check_run
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt, hf_gpt2

STEPS, EVERY = 4, 2


def _losses(run_dir, start=0):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(start, start + len(rows)))
    return [r["loss"] for r in rows]


def _gpt(layers=4):
    return gpt(layers=layers, width=32, heads=2, vocab=64, seq=16, dropout=0.1)


def _tied_gpt2():
    return hf_gpt2(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=0.1)


def _compile(folder: Path, workload, *, devices, global_batch=8, recompute=(), **options):
    plan = compile_plan(workload, cluster=ClusterSpec.homogeneous(devices, "cpu"), global_batch=global_batch,
                        **options)
    if recompute:  # as tests/e2e/test_recompute.py: the same plan with these regions recomputed
        regions = tuple(dataclasses.replace(r, recompute=r.name in recompute) for r in plan.plan.regions)
        plan = dataclasses.replace(plan, plan=dataclasses.replace(plan.plan, regions=regions))
    plan.save(folder)
    return plan


@prepare
def _zero_bubble_programs(root: Path):
    plans = {
        "zbv": _compile(root / "zbv", _gpt(), devices=2, num_stages=4, dp=1, microbatches=4, schedule="zbv"),
        "onef": _compile(root / "onef", _gpt(), devices=2, num_stages=2, dp=1, microbatches=4, schedule="1f1b"),
        "zb22": _compile(root / "zb22", _tied_gpt2(), devices=4, global_batch=16, num_stages=4, dp=2,
                         microbatches=4, schedule="zb", recompute=("block.1", "block.3")),
        "zbv8": _compile(root / "zbv8", _gpt(layers=6), devices=4, num_stages=8, dp=1, microbatches=8,
                         schedule="zbv"),
    }
    every = ["--checkpoint-every", str(EVERY)]
    jobs = [Job(2, [root / "zbv", "--steps", str(STEPS), *every, "--run-dir", root / "full",
                    "--checkpoint-dir", root / "ck_full"]),
            Job(2, [root / "zbv", "--steps", str(EVERY), *every, "--run-dir", root / "part",
                    "--checkpoint-dir", root / "ck"]),
            Job(2, [root / "zbv", "--steps", str(EVERY), *every, "--run-dir", root / "part2",
                    "--checkpoint-dir", root / "ck_reshard"]),
            Job(2, [root / "zbv", "--steps", str(STEPS), *every, "--run-dir", root / "resumed",
                    "--checkpoint-dir", root / "ck"]),
            Job(2, [root / "onef", "--steps", str(STEPS), *every, "--run-dir", root / "onef_resumed",
                    "--checkpoint-dir", root / "ck_reshard"]),
            # rank 1 SIGKILLed before step 3, the job restarted (Note [restarts in a fork])
            Job(2, [root / "zbv", "--steps", str(STEPS), *every, "--fail-at", "1:3:kill", "--run-dir", root / "killed",
                    "--checkpoint-dir", root / "ck_killed"], restarts=1),
            Job(4, [root / "zb22", "--steps", "3", "--run-dir", root / "zb22_run"]),
            Job(4, [root / "zbv8", "--steps", "3", "--run-dir", root / "zbv8_run"])]
    return (root, plans), jobs


@pytest.fixture(scope="module")
def zero_bubble(shared_launches):
    (root, plans), outputs = shared_launches.result(_zero_bubble_programs)
    return root, plans, sum(outputs[1:], outputs[0])


def test_zbv_places_stages_in_a_v(zero_bubble):
    root, plans, _done = zero_bubble
    plan = plans["zbv"]
    assert plan.schedule == "zbv" and [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)]
    program = json.loads((root / "zbv" / "plan.json").read_text())["program"]
    assert sorted(tuple(r["stages"]) for r in program["ranks"]) == [(0, 3), (1, 2)]
    assert [s.ranks for s in plans["zbv8"].stages] == [(0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,)]


def test_zbv_trains_like_the_one_process_oracle_with_dropout(zero_bubble):
    root, _plans, _done = zero_bubble
    report = check_run(root / "zbv", root / "full", workload=_gpt())
    assert report.ok, report.text()


def test_zb_pp2_dp2_with_a_tie_and_recompute_trains_like_the_oracle(zero_bubble):
    root, plans, _done = zero_bubble
    plan = plans["zb22"]
    assert plan.schedule == "zb" and plan.dp == 2 and [r.name for r in plan.regions if r.recompute] == ["block.1", "block.3"]
    tie = [t for t in plan.ties if t.placement == "replicated"]
    assert tie and tie[0].stages[0] != tie[0].stages[-1], "the embedding and head must sit on different stages"
    report = check_run(root / "zb22", root / "zb22_run", workload=_tied_gpt2())
    assert report.ok, report.text()


def test_zbv_on_four_ranks_trains_like_the_oracle(zero_bubble):
    root, _plans, _done = zero_bubble
    report = check_run(root / "zbv8", root / "zbv8_run", workload=_gpt(layers=6))
    assert report.ok, report.text()


def test_zbv_resumes_bit_exact(zero_bubble):
    root, _plans, done = zero_bubble
    assert f"at step {EVERY}" in done.stderr + done.stdout
    assert _losses(root / "part") + _losses(root / "resumed", EVERY) == _losses(root / "full")
    for rank in range(2):
        for name in (f"rank_{rank}.safetensors", f"optim_rank_{rank}.safetensors"):
            got, want = load_file(root / "resumed" / "final" / name), load_file(root / "full" / "final" / name)
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[k], want[k]) for k in want), (rank, name)


def test_a_killed_zbv_rank_resumes_bit_exact(zero_bubble):
    root, _plans, done = zero_bubble
    text = done.stdout + done.stderr
    assert "fault injection: kill before step 3" in text and "restarting it" in text
    by_step = {}
    for line in (root / "killed" / "metrics.jsonl").open():  # a step re-run after the kill overwrites the lost one
        row = json.loads(line)
        by_step[row["step"]] = row["loss"]
    assert [by_step[k] for k in sorted(by_step)] == _losses(root / "full")
    for rank in range(2):
        for name in (f"rank_{rank}.safetensors", f"optim_rank_{rank}.safetensors"):
            got, want = load_file(root / "killed" / "final" / name), load_file(root / "full" / "final" / name)
            assert all(torch.equal(got[k], want[k]) for k in want), (rank, name)


def test_a_zbv_checkpoint_reshards_onto_1f1b(zero_bubble):
    """Steps 2 and 3 on the 1f1b program after a resume from the zbv checkpoint: with keyed dropout
    they are the uninterrupted zbv run's steps."""
    root, _plans, done = zero_bubble
    assert "resharded from plan" in done.stderr
    losses = _losses(root / "part2") + _losses(root / "onef_resumed", EVERY)
    torch.testing.assert_close(losses, _losses(root / "full"), rtol=1e-5, atol=1e-6)


def test_the_run_times_weight_gradients_and_the_timeline_draws_them(zero_bubble, capsys):
    from partitioner.cli import main
    from partitioner.inspect.timeline import svg_timeline, timeline

    root, plans, _done = zero_bubble
    times = json.loads((root / "full" / "stage_times_rank_0.json").read_text())
    assert [s["stage"] for s in times["stages"]] == [0, 3]
    assert all(0 < s["weight_backward_s_per_microbatch"] < s["backward_s_per_microbatch"] for s in times["stages"])
    plan = plans["zbv"].plan
    assert all(s.bwd_weight_flops > 0 for s in plan.stages)
    tl = timeline(plan)
    kinds = {(b["kind"], b["stage"]) for b in tl["bars"]}
    assert {k for k, _ in kinds} == {"F", "B", "W"} and ("W", 3) in kinds
    assert [b["rank_position"] for b in tl["bars"] if b["stage"] == 3][:1] == [0]  # stage 3 on rank 0: the V
    assert 'class="wgt"' in svg_timeline(plan, tl)
    assert main(["inspect", str(root / "zbv")]) == 0
    out = capsys.readouterr().out
    assert "rank position 0 (stages 0, 3; ranks 0)" in out and "zbv schedule" in out
