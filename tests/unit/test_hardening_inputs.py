"""Issue 14: inputs that gave a traceback or nonsense now give one line naming the value and the fix,
exit 2, before anything starts (docs/design.md §8)."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest

import partitioner
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hardening") / "prog"
    plan = partitioner.compile(gpt(layers=2, width=32, heads=2, vocab=64, seq=16),
                               cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=2,
                               microbatches=4)
    plan.save(out)
    return out


def one_line_error(capsys, argv, *needles) -> str:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, (code, captured.err)
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# --- inspect: plan.json with a wrong inner field, a missing one, binary bytes ------------------

def _edited(folder: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    body = json.loads((copy / "plan.json").read_text())
    edit(body)
    (copy / "plan.json").write_text(json.dumps(body))
    return copy


def test_inspect_names_a_wrongly_typed_inner_field(capsys, folder, tmp_path):
    copy = _edited(folder, tmp_path, lambda b: b["stages"][0].update(peak_memory_bytes="x"))
    one_line_error(capsys, ["inspect", copy], str(copy / "plan.json"), "stages[0].peak_memory_bytes",
                   '"x"', "int", "partitioner compile")


def test_inspect_names_a_missing_inner_field(capsys, folder, tmp_path):
    copy = _edited(folder, tmp_path, lambda b: b["stages"][1]["memory"].pop("grads_bytes"))
    one_line_error(capsys, ["inspect", copy], "stages[1].memory.grads_bytes is missing", "partitioner compile")


@pytest.mark.parametrize("edit, needle", [
    (lambda b: b["predicted"].pop("step_time_s"), "predicted.step_time_s is missing"),
    (lambda b: b["solver"].update(objective="x"), "solver.objective"),
    (lambda b: b["baselines"].update(uniform="x"), "baselines.uniform"),
    (lambda b: b["cut_edges"][0].update(shapes=[["a"]]), "cut_edges[0].shapes"),
    (lambda b: b.update(dp=True), "field dp is true, expected int"),
])
def test_inspect_names_the_figures_inspect_reads(capsys, folder, tmp_path, edit, needle):
    copy = _edited(folder, tmp_path, edit)
    for form in ([], ["--json"], ["--html", tmp_path / "p.html"]):
        one_line_error(capsys, ["inspect", copy, *form], str(copy / "plan.json"), needle, "partitioner compile")
    assert not (tmp_path / "p.html").exists()


def test_inspect_of_a_binary_or_non_object_plan_json(capsys, tmp_path):
    (tmp_path / "plan.json").write_bytes(bytes(range(256)))
    one_line_error(capsys, ["inspect", tmp_path / "plan.json"], str(tmp_path / "plan.json"), "not text",
                   "partitioner compile")
    (tmp_path / "plan.json").write_text("[1, 2]")
    one_line_error(capsys, ["inspect", tmp_path], "plan.json", "JSON list", "partitioner compile")


# --- built-in model arguments -----------------------------------------------------------------

@pytest.mark.parametrize("spec, needles", [
    ("gpt:layers=abc", ["layers=abc is not a whole number", "gpt:layers=4"]),
    ("gpt:layers=0", ["layers=0 must be at least 1"]),
    ("gpt:layers=2.5", ["layers=2.5 is not a whole number"]),
    ("gpt:width=100,heads=3", ["not divisible by heads=3", "heads=2"]),
    ("gpt:dropout=1.5", ["dropout=1.5 must be in [0, 1)"]),
    ("mlp:hidden=-4", ["hidden=-4 must be at least 1"]),
    ("hf-qwen2-moe:experts=2,top_k=3", ["top_k=3 is more than experts=2"]),
])
def test_builtin_arguments_are_checked_before_building(capsys, tmp_path, spec, needles):
    one_line_error(capsys, ["compile", spec, "-o", tmp_path / "out", "-q"], f"MODEL {spec!r}", *needles)
    assert not (tmp_path / "out").exists()


# --- compile: --stages / --dp beyond the devices, before tracing ------------------------------

def test_stages_beyond_the_devices_is_refused_before_tracing(capsys, tmp_path, monkeypatch):
    import partitioner.frontend.analysis

    def no_trace(*_a, **_k):
        raise AssertionError("traced before checking --stages")

    monkeypatch.setattr(partitioner.frontend.analysis, "trace", no_trace)
    monkeypatch.setattr("partitioner.compiler.trace_keyed", no_trace)
    one_line_error(capsys, ["compile", "gpt", "-o", tmp_path / "o", "--devices", "2", "--stages", "3", "-q"],
                   "num_stages=3 (--stages)", "cluster has 2", "--stages 2")
    one_line_error(capsys, ["compile", "gpt", "-o", tmp_path / "o", "--devices", "2", "--dp", "3", "-q"],
                   "dp=3 (--dp)", "--dp 2")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags, needles", [
    (["--checkpoint-every", "-1"], ["--checkpoint-every -1", ">= 0"]),
    (["--calibrate-threads", "-1"], ["--calibrate-threads -1"]),
    (["--parity-group", "3"], ["--parity-group 3", "--memory-tier parity"]),
    (["--memory-tier", "parity", "--parity-group", "1"], ["--parity-group 1", "2 or more"]),
])
def test_compile_flags_that_were_accepted_silently(capsys, tmp_path, flags, needles):
    one_line_error(capsys, ["compile", "mlp", "-o", tmp_path / "o", "-q", *flags], *needles)
    assert not (tmp_path / "o").exists()


# --- run / verify flags -----------------------------------------------------------------------

@pytest.mark.parametrize("flags, needles", [
    (["--steps", "-1"], ["--steps -1", "at least 1 step"]),
    (["--steps", "0"], ["--steps 0"]),
    (["--collective-timeout", "0"], ["--collective-timeout 0", "> 0"]),
    (["--max-restarts", "-1"], ["--max-restarts -1"]),
    (["--fail-at", "2:3"], ["--fail-at 2:3", "rank 2 does not exist", "0..1"]),
    (["--fail-at", "1:20", "--steps", "10"], ["step 20 is never reached", "0..9"]),
    (["--flip-bit", "x"], ["--flip-bit 'x'", "RANK:STEP[:TENSOR]"]),
    (["--flip-bit", "2:1"], ["--flip-bit 2:1", "never reached"]),
    (["--sdc-every", "-1"], ["--sdc-every -1", ">= 0"]),
    (["--checkpoint-full-every", "0"], ["--checkpoint-full-every 0", "1 or more"]),
])
def test_run_flags_are_checked_before_torchrun(capsys, folder, monkeypatch, flags, needles):
    import subprocess

    def no_torchrun(*_a, **_k):
        raise AssertionError("torchrun started")

    monkeypatch.setattr(subprocess, "call", no_torchrun)
    one_line_error(capsys, ["run", folder, *flags], *needles)


def test_verify_steps_zero(capsys, folder):
    one_line_error(capsys, ["verify", folder, "--steps", "0"], "--steps 0", "--steps 3")


# --- a failed trace: our line only, none of torch's graph dumps --------------------------------

def test_a_failed_trace_prints_one_line_and_restores_logging(capfd, tmp_path, monkeypatch):
    import logging

    (tmp_path / "vdmodel.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        from partitioner import Workload
        from runtime.data import synthetic as data

        class VD(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(4, 4)

            def forward(self, x):
                if x.sum() > 0:
                    return self.layer(x)
                return x

        def build():
            return Workload(model=VD(), example_args=(torch.randn(2, 4),), loss_fn=data.mse_loss)
    """))
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "vdmodel.py:build", "-o", "out", "-q"]) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot trace VD"), err
    assert "def forward" not in err
    handlers = [h for name in ("", "torch") for h in logging.getLogger(name).handlers]
    assert not any(f for h in handlers for f in h.filters if type(f).__name__ == "_DropTorchRecords")


# --- start-up: the checkpoint to resume from is past --steps ----------------------------------

@pytest.fixture()
def one_rank(tmp_path, monkeypatch):
    from runtime.launch.torchrun import free_port

    out = tmp_path / "one"
    assert main(["compile", "mlp", "-o", str(out), "--devices", "1", "-q"]) == 0
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    return out


def test_resume_beyond_steps_is_refused_at_start_up(one_rank, capsys):
    from runtime.launch import rank as launch

    launch.main(str(one_rank), 0, steps=4, exit_on_error=False, argv=["--checkpoint-every", "2"])
    metrics = (one_rank / "run" / "metrics.jsonl").read_text()
    assert len(metrics.splitlines()) == 4
    capsys.readouterr()
    with pytest.raises(launch.ResumeBeyondStepsError, match=r"--steps 2: .* at step 4.*--steps 5 or more"):
        launch.main(str(one_rank), 0, steps=2, exit_on_error=False, argv=[])
    assert (one_rank / "run" / "metrics.jsonl").read_text() == metrics  # not truncated


# --- a peer died: one line per survivor, no gloo traceback ------------------------------------

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:16042: Connection reset by peer. This is typically caused by a remote worker hanging "
        "or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")


def test_a_dead_peer_is_one_line_with_the_step_and_what_happens_next(monkeypatch, tmp_path):
    from runtime.launch import rank as launch

    assert launch.peer_lost(RuntimeError(GLOO))
    assert not launch.peer_lost(RuntimeError("shape mismatch in stage 1"))
    assert not launch.peer_lost(ValueError("Connection reset by peer"))
    monkeypatch.setitem(launch._at, "step", 12)
    monkeypatch.setitem(launch._at, "ckpt_dir", str(tmp_path / "no-checkpoints"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    line = launch.peer_lost_line(0, RuntimeError(GLOO))
    assert "\n" not in line and line.startswith("[rank 0] a peer rank died at step 12")
    assert "Connection reset by peer" in line and "pair.cc" not in line and "GLHF" not in line
    assert "torchrun restarts the job from step 0 (restart 1 of 1)" in line
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert "no restarts left (--max-restarts 1)" in launch.peer_lost_line(0, RuntimeError(GLOO))
    hung = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation")
    assert launch.peer_lost(hung) and "a peer rank stopped answering at step 12" in launch.peer_lost_line(0, hung)


def test_a_dead_peer_prints_no_traceback(monkeypatch, capfd):
    from runtime.launch import rank as launch

    def boom(*_a, **_k):
        raise RuntimeError(GLOO)

    exits = []
    monkeypatch.setattr(launch, "_main", boom)
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    monkeypatch.setitem(launch._at, "step", 3)
    monkeypatch.setitem(launch._at, "ckpt_dir", None)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    launch.main("nowhere", 1, argv=[])
    err = capfd.readouterr().err
    assert exits == [1]
    assert err.strip().splitlines() == [err.strip()] and "Traceback" not in err
    assert err.startswith("[rank 1] a peer rank died at step 3") and "no restarts left" in err


def test_run_refuses_steps_below_the_newest_checkpoint_before_torchrun(one_rank, capsys, monkeypatch):
    import subprocess

    from runtime.launch import rank as launch

    launch.main(str(one_rank), 0, steps=4, exit_on_error=False, argv=["--checkpoint-every", "2"])
    capsys.readouterr()
    monkeypatch.setattr(subprocess, "call", lambda *_a, **_k: (_ for _ in ()).throw(AssertionError("torchrun")))
    one_line_error(capsys, ["run", one_rank, "--steps", "3"], "--steps 3", "at step 4", "--steps 5 or more",
                   "--checkpoint-dir")
