"""A non-tensor input (Note [constant inputs] in runtime/data/synthetic.py): `forward(self, x, pool="mean")`
fed {"x": tensor, "pool": "first"} by make_batch. The trace bakes "first" into the graph; the
program takes only the tensor, records the constant, and refuses a make_batch that later returns
another value. Trained 2 steps on 2 ranks in the session's shared launch (Note [shared launches]
in tests/_shared_launch.py) and verified against the one-process oracle (the user's module called
with pool="first"); the refusal through `partitioner run` on one rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _programs import compile_to
from _shared_launch import Job, prepare
from partitioner.models.builtin import load_workload
from partitioner.cli.verify import check_run

OWN = Path(__file__).resolve().parent.parent / "own_model"
MODEL = f"{OWN / 'constant_kwarg.py'}:build"


@prepare
def _constant_program(root: Path):
    compile_to(root / "pool", load_workload(MODEL), devices=2, num_stages=2, dp=1, global_batch=8, microbatches=2)
    return root, [Job(2, [root / "pool", "--steps", "2", "--run-dir", root / "run", "--checkpoint-dir", root / "ck"])]


@pytest.fixture(scope="module")
def constant(shared_launches):
    return shared_launches.result(_constant_program)[0]


def test_a_non_tensor_keyword_input_compiles_runs_and_verifies(constant):
    program = json.loads((constant / "pool" / "plan.json").read_text())["program"]
    assert program["data"]["keywords"] == ["x"] and program["data"]["constants"] == [["pool", "first"]]
    assert [v["name"] for v in program["stages"][0]["inputs"]] == ["x"]  # the constant never crosses
    report = check_run(constant / "pool", constant / "run", workload=load_workload(MODEL))
    assert report.ok, report.text()


def test_another_value_at_run_time_is_refused_in_one_line(tmp_path):
    """make_batch gives pool="mean" at step 1: the program was specialised to "first", so the
    step is refused before it runs, on every rank, in one line naming both values."""
    compile_to(tmp_path / "prog", load_workload(f"{OWN / 'constant_kwarg.py'}:build_switching"), devices=1,
               global_batch=4)
    done = subprocess.run([sys.executable, "-m", "partitioner", "run", str(tmp_path / "prog"), "--steps", "2",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "Error" in line]
    assert done.returncode != 0 and errors, done.stdout + done.stderr
    assert errors[0].startswith("[rank 0] InputMismatchError: make_batch returned pool='mean' at step 1, but the "
                                "program was specialised to pool='first'"), errors
    assert "recompile" in errors[0], errors
    assert "runtime/data/synthetic.py\", line" not in done.stderr, done.stderr  # no traceback from the rank
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0]  # step 0 ran as traced; step 1 never did
