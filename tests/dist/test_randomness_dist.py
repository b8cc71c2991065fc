"""Programs with dropout train like the unpartitioned model (Note [randomness keyed by meaning] in
runtime/execute/randomness.py): gpt, hf-gpt2 and hf-llama (attention dropout through SDPA's dropout_p)
with dropout 0.1, compiled to 2 stages, and gpt as 2 data-parallel replicas of one stage with a
microbatch twice as large, all trained in the session's 2-worker shared launch (tests/_shared_launch.py), each against verify's
one-process oracle (the unpartitioned traced graph with keyed random ops). The 3-stage plan and the
resharded resume are in test_checkpoint_dist.py (test_reshard_two_stages_to_three_with_dropout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from partitioner.models.builtin import gpt, hf_gpt2, hf_llama
from partitioner.cli.verify import read_program_run, train_oracle
from runtime.program.spec import Program
from runtime.execute.reference import train_reference
from _programs import compile_to
from _shared_launch import Job, prepare

STEPS = 3
TINY = dict(layers=2, width=32, heads=2, vocab=64, seq=16, dropout=0.1)
BUILDERS = {"gpt_2stage": (gpt, dict(num_stages=2, dp=1, microbatches=4)),
            "gpt_dp2": (gpt, dict(num_stages=1, dp=2, microbatches=1)),
            "hf_gpt2_2stage": (hf_gpt2, dict(num_stages=2, dp=1, microbatches=4)),
            "hf_llama_2stage": (hf_llama, dict(num_stages=2, dp=1, microbatches=4))}


@prepare
def _dropout_programs(root: Path):
    workloads = {}
    for name, (builder, options) in BUILDERS.items():
        workloads[name] = builder(**TINY)
        compile_to(root / name, workloads[name], devices=2, **options)
    return (root, workloads), [Job(2, [root / name, "--steps", str(STEPS)]) for name in BUILDERS]


@pytest.fixture(scope="module")
def trained(shared_launches):
    """Trained in the session's 2-worker shared launch (tests/_shared_launch.py)."""
    return shared_launches.result(_dropout_programs)[0]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_dropout_program_trains_like_the_keyed_unpartitioned_graph(trained, name):
    root, workloads = trained
    folder = root / name
    program = Program.from_dict(json.loads((folder / "plan.json").read_text())["program"])
    assert program.randomness.keyed_ops, "the lowering keyed no random op"
    losses, params, replica_diff = read_program_run(folder / "run")
    want, state, oracle = train_oracle(folder, program, workloads[name], STEPS)
    assert oracle == "unpartitioned traced graph (keyed randomness)"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=0, atol=1e-5)
    assert replica_diff == 0.0
    for param, tensor in params.items():
        torch.testing.assert_close(tensor, state[param], rtol=1e-4, atol=1e-4, msg=param)


def test_stages_replicas_and_microbatch_size_draw_the_same_masks(trained):
    """2 stages x 4 microbatches of 2 samples and 2 replicas x 1 microbatch of 4: the same losses,
    which dropout did change (the model without dropout gives others)."""
    root, workloads = trained
    two_stages, _, _ = read_program_run(root / "gpt_2stage" / "run")
    replicas, _, _ = read_program_run(root / "gpt_dp2" / "run")
    torch.testing.assert_close(torch.tensor(two_stages), torch.tensor(replicas), rtol=0, atol=1e-5)
    plain = gpt(**{**TINY, "dropout": 0.0})
    program = Program.from_dict(json.loads((root / "gpt_2stage" / "plan.json").read_text())["program"])
    without, _, _ = train_reference(plain.model, plain.make_batch, plain.loss_fn, program.optimizer,
                                    program.global_batch, 4, STEPS, program.seed)
    assert max(abs(a - b) for a, b in zip(two_stages, without)) > 1e-3
