"""The program does only the per-step work its plan prices (docs/design.md §12): a run counted from
inside, one rank in this process (world of one, gloo), as `python rank_0.py` runs it.

- clipping off and fp32: no global-norm pass or collective (Note [global gradient norm] in
  runtime/grad_norm.py), metrics.jsonl without ``grad_norm``, no autocast context entered (Note
  [mixed precision] in runtime/precision.py);
- clipping on under bf16-mixed: the norm's all-reduce every step and autocast around the forward,
  so the counters above are seen to count.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import runtime.grad_norm as grad_norm
from _runtime_folders import mlp_folder, one_thread, read_metrics  # noqa: F401
from runtime.launch import main

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
