"""Sequence parallelism in the generated program (Note [sequence parallelism] in
runtime/parallel/tensor_parallel.py), trained under torchrun (gloo) against the one-process oracle
with keyed dropout on (attention and hidden): tp 2 (2 ranks) in fp32 and bf16-mixed, the built-in
GPT at tp 2 under full recompute, tp 2 x pp 2 (4 ranks); a checkpoint of step 2 resumed with it (bit for bit the uninterrupted run), resumed
without it (tp 2, sequence parallelism off), and one written without it resumed with it.

Every job joins the session's shared launches (Note [shared launches] in tests/_shared_launch.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _programs import compile_to, tiny_gpt as builtin_gpt, tiny_llama as llama
from _shared_launch import Job, prepare
from partitioner.cli.verify import check_run, read_program_run, train_oracle
from runtime.program.spec import load_program


@prepare
def _sp_programs(root: Path):
    options = dict(global_batch=4, microbatches=2, tensor_parallel=2)
    plans = {name: compile_to(root / name, llama(), devices=devices, num_stages=stages, sequence_parallel=sp,
                              **options, **extra)
             for name, devices, stages, sp, extra in (
                 ("sp", 2, 1, "on", {}), ("tp", 2, 1, "off", {}), ("sp_pp", 4, 2, "on", {}),
                 ("sp_bf16", 2, 1, "on", {"precision": "bf16-mixed"}))}
    plans["sp_gpt"] = compile_to(root / "sp_gpt", builtin_gpt(), devices=2, num_stages=1, sequence_parallel="on",
                                 training={"recompute": "full"}, **options)

    def job(name, steps, ckpt, run):
        return Job(2 if name != "sp_pp" else 4, [str(root / name), "--steps", str(steps), "--checkpoint-dir",
                                                 str(root / ckpt), "--run-dir", str(root / run)])

    # a resumed job writes its own checkpoints where it resumed from: one step-2 checkpoint per resume
    jobs = [job("sp", 4, "ck_full", "run_full"),            # the uninterrupted run
            job("sp", 2, "ck_sp", "run_sp2"),                # step 2's checkpoint, with sequence parallelism
            job("sp", 2, "ck_sp_b", "run_sp2_b"),
            job("tp", 2, "ck_tp", "run_tp2"),                # and without
            job("sp", 4, "ck_sp", "run_resumed"),
            job("tp", 4, "ck_sp_b", "run_sp_to_tp"),
            job("sp", 4, "ck_tp", "run_tp_to_sp"),
            job("sp_bf16", 2, "ck_bf16", "run_bf16"),
            job("sp_pp", 3, "ck_pp", "run_pp"),
            job("sp_gpt", 3, "ck_gpt", "run_gpt")]
    return (root, plans), jobs


@pytest.fixture(scope="module")
def runs(shared_launches):
    """Trained in the session's shared launches (Note [shared launches] in tests/_shared_launch.py)."""
    return shared_launches.result(_sp_programs)[0]


def test_the_decision_is_in_the_plan_and_the_stage_reduce_scatters(runs):
    root, plans = runs
    assert plans["sp"].decisions.sequence_parallel and not plans["tp"].decisions.sequence_parallel
    sp, tp = ((root / name / "stage_0.py").read_text() for name in ("sp", "tp"))
    assert sp.count("tensor_parallel.row_linear_scatter(") == 4 and "tensor_parallel.row_linear(" not in sp
    assert "row_linear_scatter" not in tp


@pytest.mark.parametrize("name, run", [("sp", "run_full"), ("sp_bf16", "run_bf16"), ("sp_pp", "run_pp"),
                                       ("sp_gpt", "run_gpt")])
def test_sequence_parallel_trains_like_one_process(runs, name, run):
    """verify's verdict (losses, every parameter, the gradient norm) under the tolerance tp has."""
    root, plans = runs
    if name == "sp_gpt":
        assert all(r.recompute for r in plans[name].regions if r.name.startswith("blocks."))
    report = check_run(root / name, root / run, workload=builtin_gpt() if name == "sp_gpt" else llama())
    assert report.oracle == "unpartitioned traced graph (keyed randomness)"
    assert report.ok, report.text()


def test_a_resumed_sequence_parallel_run_is_the_uninterrupted_one_bit_for_bit(runs):
    root, _ = runs
    losses, params, _ = read_program_run(root / "run_resumed")
    full_losses, full_params, _ = read_program_run(root / "run_full")
    assert losses == full_losses[2:]
    assert sorted(params) == sorted(full_params)
    assert all(torch.equal(params[k], full_params[k]) for k in params)


@pytest.mark.parametrize("name, run", [("tp", "run_sp_to_tp"), ("sp", "run_tp_to_sp")])
def test_a_checkpoint_resumes_with_sequence_parallelism_switched(runs, name, run):
    """Parameters keep their placements under sequence parallelism: a checkpoint of either resumes
    in the other; steps 2 and 3 and the final parameters match the oracle's four steps."""
    root, _ = runs
    folder = root / name
    losses, params, replica_diff = read_program_run(root / run)
    assert len(losses) == 2 and replica_diff == 0.0
    ref_losses, ref_state, _ = train_oracle(folder, load_program(str(folder)), llama(), 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[2:]), rtol=0, atol=1e-5)
    for param, tensor in params.items():
        torch.testing.assert_close(tensor, ref_state[param], rtol=0, atol=1e-4, msg=param)
