"""The CLI's progress and listings: `partitioner inspect` of checkpoint folders (valid, partial,
corrupt: each named, and what a resume picks), compile progress on stderr (and none with -q),
the solver's progress events, and `run --quiet` reaching train.py."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from _checkpoint_helpers import set_plan_fields
from _runtime_folders import mlp_folder
from partitioner.cli import build_parser, main
from runtime.resilience import checkpoint as ck
from tests.drivers.checkpoint_drills import trainers_at
from runtime.program.spec import load_program

FINGERPRINT = "mlp-8-32-32-32-4"


@pytest.fixture(scope="module")
def with_checkpoints(tmp_path_factory):
    """A 2-rank program folder whose checkpoints/ holds step 2 (valid), step 4 (its shard of rank
    1 has one bit flipped) and step 6 (partial: shards written, no manifest)."""
    folder = str(tmp_path_factory.mktemp("ckpt") / "prog")
    mlp_folder(folder, splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    set_plan_fields(folder, model_fingerprint=FINGERPRINT, plan_hash="plan-two-stages", workload="mlp")
    program = load_program(folder)
    ckpt_dir = os.path.join(folder, "checkpoints")
    trainers = trainers_at(folder, 0)
    for step in (2, 4, 6):
        for t in trainers:
            while t.steps_done < step:
                t.fake_step(t.steps_done)
        ck.commit_local(ckpt_dir, [ck.snapshot(t) for t in trainers], program, keep=10)
    shard = os.path.join(ckpt_dir, ck.step_dirname(4), ck.shard_filename(1))
    with open(shard, "r+b") as fh:
        fh.seek(os.path.getsize(shard) - 3)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))
    os.unlink(os.path.join(ckpt_dir, ck.step_dirname(6), ck.MANIFEST))
    return folder


def run_cli(capsys, *argv):
    rc = main([*map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_listing_names_each_checkpoint_and_the_resume_pick(capsys, with_checkpoints):
    ckpt_dir = os.path.join(with_checkpoints, "checkpoints")
    rc, out, _ = run_cli(capsys, "inspect", ckpt_dir)
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(f"checkpoints in {ckpt_dir}") and "3 step dirs, 1 valid, newest first" in lines[0]
    rows = {int(m.group(1)): line for line in lines if (m := re.match(r"^\s*(?:> )?(\d+)\s+(valid|partial|corrupt)", line))}
    assert list(rows) == [6, 4, 2]  # newest first
    assert "partial" in rows[6] and "corrupt" in rows[4] and "valid" in rows[2]
    assert re.match(r"^\s*> 2\s+valid", rows[2])  # the resume marker
    assert "plan-two-stages" in rows[2] and "mlp" in rows[2] and "2 x 1" in rows[2] and "KiB" in rows[2]
    assert re.search(r"no manifest\.json: never committed \(2 shard files", out)
    assert re.search(r"shard_rank_00001\.safetensors fails its sha256", out)
    assert f"a resume picks step 2 ({ckpt_dir}{os.sep}step_000000002)" in out
    assert "sets aside the 2 newer invalid ones" in out
    # The program folder with --checkpoints: the same listing, checked against the program's plan.
    rc, out2, _ = run_cli(capsys, "inspect", with_checkpoints, "--checkpoints")
    assert rc == 0 and "(program plan plan-two-stages)" in out2 and out2.count("\n") == out.count("\n")
    # One step directory.
    rc, out3, _ = run_cli(capsys, "inspect", os.path.join(ckpt_dir, ck.step_dirname(4)))
    assert rc == 0 and "1 step dir, 0 valid" in out3 and "corrupt" in out3 and "resume" not in out3


def test_listing_as_json(capsys, with_checkpoints):
    rc, out, _ = run_cli(capsys, "inspect", with_checkpoints, "--checkpoints", "--json")
    body = json.loads(out)
    assert rc == 0 and body["resume"]["step"] == 2 and body["resume"]["skipped"] == [6, 4]
    by_step = {c["step"]: c for c in body["checkpoints"]}
    assert [c["step"] for c in body["checkpoints"]] == [6, 4, 2]
    assert (by_step[2]["status"], by_step[2]["valid"], by_step[2]["resume"]) == ("valid", True, True)
    assert by_step[2]["world_size"] == 2 and by_step[2]["same_plan"] and by_step[2]["same_model"]
    assert by_step[2]["bytes"] > 0 and by_step[2]["created_unix"] > 0 and by_step[2]["shards"] == 2
    assert by_step[4]["status"] == "corrupt" and "shard_rank_00001" in by_step[4]["reason"]
    assert by_step[6]["status"] == "partial" and by_step[6]["plan_hash"] == "plan-two-stages"


def test_listing_refuses_plan_formats(capsys, with_checkpoints):
    rc, out, err = run_cli(capsys, "inspect", os.path.join(with_checkpoints, "checkpoints"), "--dot")
    assert rc == 2 and out == "" and "--dot shows a plan" in err


def test_empty_folder_is_still_an_error(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "inspect", tmp_path)
    assert rc == 2 and "has no plan.json" in err and "checkpoint folder" in err


# --- compile progress ----------------------------------------------------------------------------

TINY = "gpt:layers=2,width=32,heads=2,vocab=64,seq=16"


def test_compile_progress_on_stderr_and_none_with_quiet(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "compile", TINY, "-o", tmp_path / "a", "--devices", "2", "--stages", "2")
    assert rc == 0 and "wrote" in out
    lines = err.splitlines()
    assert all(line.startswith("[compile] ") for line in lines), err
    for step in ("model", "trace", "passes", "solve", "write"):  # each named step ends with its time
        assert any(re.match(rf"\[compile\] {step}\b.* \.\.\. \d+\.\d\d s", line) for line in lines), (step, err)
    assert re.search(r"\[compile\] solve: 0/\d+ candidates", err)  # the total, before any candidate
    assert re.search(r"solve: .* \.\.\. \d+\.\d\d s; (\d+)/\1 candidates, best [\d.]+ ms \(2 stages x dp 1, "
                     r"\d+ microbatch(es)?\), bound [\d.]+ ms \(gap [\d.]+%\), OPTIMAL", err)
    assert re.search(r"\[compile\] done in [\d.]+ s \(model [\d.]+, trace [\d.]+, passes [\d.]+, solve [\d.]+, "
                     r"write [\d.]+\)$", err.strip())
    assert "\r" not in err and "candidate 2 stages" not in err  # not a terminal; per-candidate lines need -v
    rc, out, err = run_cli(capsys, "compile", TINY, "-o", tmp_path / "b", "--devices", "2", "--stages", "2", "-q", "-v")
    assert rc == 0 and out == "" and err == ""


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_progress_overwrites_one_line_per_step(monkeypatch):
    from partitioner.cli.progress import CompileProgress
    from partitioner.solver.solve import CandidateRecord, SolveProgress

    monkeypatch.setenv("COLUMNS", "300")  # status lines are cut to the terminal's width
    term = FakeTerminal()
    say = CompileProgress(term, verbose=True, tty_every_s=0.0)
    say("trace")
    say("solve: 4 regions on 2 devices")
    record = CandidateRecord(2, 1, 4, 2, "OPTIMAL", 0.002, 0.0015, 0.01)
    say(SolveProgress(0, 3, None, None, 0.0015, 0.0))
    say(SolveProgress(1, 3, 0.002, (2, 1, 4), 0.0018, 0.1, candidate=record))
    say(SolveProgress(3, 3, 0.002, (2, 1, 4), 0.002, 0.2, finished=True, status="OPTIMAL"))
    say("write out")
    say.close()
    screen = term.getvalue()
    finished = screen.split("\n")  # what stays on screen: the last state of each line
    final = [line.rsplit("\r\x1b[K", 1)[-1] for line in finished if line]
    assert re.fullmatch(r"\[compile\] trace \.\.\. \d+\.\d\d s", final[0])
    assert final[1] == "[compile] candidate 2 stages x dp 1, 4 microbatches of 2: OPTIMAL, step 2 ms, bound 1.5 ms, 0.01 s"
    assert re.fullmatch(r"\[compile\] solve: 4 regions on 2 devices \.\.\. \d+\.\d\d s; 3/3 candidates, best 2 ms "
                        r"\(2 stages x dp 1, 4 microbatches\), bound 2 ms \(gap 0\.0%\), OPTIMAL", final[2])
    assert final[3].startswith("[compile] write out ... ") and final[4].startswith("[compile] done in")
    assert "solve: 1/3 candidates, best 2 ms" in screen and "bound 1.8 ms (gap 10.0%)" in screen  # overwritten


def test_solver_reports_candidates_incumbent_and_bound():
    from partitioner.config.cluster import ClusterSpec
    from partitioner.solver import Edge, PartitionProblem, RegionCost, SolverConfig, solve

    regions = tuple(RegionCost(f"r{i}", 1e9, 2e9, 1000, 1000, 6000, 100, 10) for i in range(4))
    problem = PartitionProblem(regions, tuple(Edge(i, i + 1, 100) for i in range(3)), ())
    events = []
    sol = solve(problem, ClusterSpec.homogeneous(2), 8, config=SolverConfig(time_limit_s=5), progress=events.append)
    assert events[0].done == 0 and events[0].incumbent_s is None and events[0].total == len(sol.candidates) > 1
    assert events[-1].finished and events[-1].done == events[-1].total and events[-1].status == sol.status
    assert events[-1].incumbent_s == sol.step_time_s
    incumbents = [e.incumbent_s for e in events if e.incumbent_s is not None]
    assert incumbents == sorted(incumbents, reverse=True)
    assert all(e.bound_s <= e.incumbent_s * (1 + 1e-9) for e in events if e.incumbent_s is not None)
    assert [e.done for e in events] == sorted(e.done for e in events)
    assert any(e.candidate is not None and e.candidate_line().startswith("candidate ") for e in events)


# --- run --quiet -----------------------------------------------------------------------------------

def test_run_quiet_reaches_train_py():
    from runtime.launch.rank import parse_args
    from runtime.launch.run_options import RunOptions

    args = build_parser().parse_args(["run", "out", "--quiet", "--log-every", "5"])
    options = RunOptions.from_namespace(args)
    assert options.quiet and options.log_every == 5
    # what `partitioner run` hands every rank is what the rank reads back
    assert options.to_argv() == ["--quiet", "--log-every", "5"]
    assert parse_args(["--steps", "3", *options.to_argv()]) == RunOptions(steps=3, quiet=True, log_every=5)
    assert not parse_args(["--steps", "3"]).quiet
