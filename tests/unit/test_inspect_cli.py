"""`partitioner inspect` on a real program folder: every format, --node, and every error path
(one or two lines naming the value and the fix, non-zero exit)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import partitioner
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from partitioner.solver.plan import Plan


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inspect") / "prog"
    plan = partitioner.compile(gpt(layers=4, width=32, heads=2, vocab=64, seq=16),
                               cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=2,
                               microbatches=4)
    plan.save(out)
    return out


def inspect(capsys, *argv):
    rc = main(["inspect", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_short_error(rc, out, err, *needles):
    assert rc != 0 and out == ""
    lines = err.strip().splitlines()
    assert lines and len(lines) <= 2 and lines[0].startswith("error: "), err
    for needle in needles:
        assert re.search(needle, err), (needle, err)


def test_table_from_folder_and_from_plan_json(capsys, folder):
    rc, out, _ = inspect(capsys, folder)
    assert rc == 0
    plan = Plan.load(folder)
    assert out.startswith(f"plan {plan.content_hash()}")
    for needle in ("regions held", "ms/mb", "weights", "grads", "optim", "activ", "buffers", "capacity", "send",
                   "balance", "bubble", "samples/s", "solver", "uniform", "param_balanced", "cut edges"):
        assert needle in out, needle
    assert re.search(r"^\s+0\s+0\s+cpu\s+embed \.\. block\.1 \(3\)", out, re.M)
    rc, out_json_path, _ = inspect(capsys, folder / "plan.json")
    assert rc == 0 and out_json_path == out


def test_json_matches_the_plan(capsys, folder):
    rc, out, _ = inspect(capsys, folder, "--json")
    body = json.loads(out)
    plan = Plan.load(folder)
    assert rc == 0 and body["plan_hash"] == plan.content_hash()
    assert (body["num_stages"], body["dp"], body["microbatches"], body["schedule"]) == (2, 1, 4, "1f1b")
    assert body["predicted"]["step_time_s"] == plan.predicted["step_time_s"]
    assert [s["regions"] for s in body["stages"]] == [list(s.region_names) for s in plan.stages]
    assert body["cut_edges"][0]["tensors"] and body["cut_edges"][0]["boundaries"] == [0]


def test_dot_and_html(capsys, folder, tmp_path):
    rc, out, _ = inspect(capsys, folder, "--dot")
    assert rc == 0 and out.lstrip().startswith("//") and "digraph plan {" in out and out.rstrip().endswith("}")
    assert out.count("subgraph cluster_stage") == 2
    page = tmp_path / "r.html"
    rc, out, err = inspect(capsys, folder, "--html", page)
    assert rc == 0 and out == "" and "wrote" in err
    text = page.read_text()
    assert '<svg id="timeline"' in text and "http://" not in text and "https://" not in text


def test_node_explains_and_prices_moves(capsys, folder):
    rc, out, _ = inspect(capsys, folder, "--node", "linear_3")
    assert rc == 0
    assert "node linear_3 is in region block.0" in out and "on stage 0" in out
    assert "neighbours      before embed (stage 0), after block.1 (stage 0)" in out
    assert re.search(r"move to stage 1 \(block\.0 \.\. block\.1 \(2\)\): step [\d.]+ ms \(\+", out)
    rc, out, _ = inspect(capsys, folder, "--node", "block.1", "--json")
    info = json.loads(out)
    # The solver's problem stored in plan.json reprices the plan to its own step time.
    assert info["repriced_error"] < 1e-6
    (move,) = info["moves"]
    assert move["to_stage"] == 1 and move["possible"] and move["change"] > 0  # the solver proved optimality
    assert info["verdict"].startswith("stays on stage 0")


def test_node_on_a_plan_without_the_solver_problem_says_recompile(capsys, folder, tmp_path):
    body = json.loads((folder / "plan.json").read_text())
    del body["problem"], body["assignment"]  # what compilers before the problem was kept wrote
    (tmp_path / "plan.json").write_text(json.dumps(body))
    assert_short_error(*inspect(capsys, tmp_path, "--node", "linear_3"), r"plan\.json has no problem or assignment",
                       "recompile it with `partitioner compile`")
    rc, out, _ = inspect(capsys, tmp_path)  # every other view still reads it
    assert rc == 0 and out.startswith("plan ")


def test_plan_json_is_byte_deterministic(folder, tmp_path):
    again = tmp_path / "again"
    partitioner.compile(gpt(layers=4, width=32, heads=2, vocab=64, seq=16), cluster=ClusterSpec.homogeneous(2, "cpu"),
                        global_batch=8, num_stages=2, microbatches=4).save(again)
    assert (again / "plan.json").read_bytes() == (folder / "plan.json").read_bytes()


def test_missing_path(capsys, tmp_path):
    assert_short_error(*inspect(capsys, tmp_path / "nope"), r"nope: no such file or folder", "program folder")


def test_folder_without_plan(capsys, tmp_path):
    assert_short_error(*inspect(capsys, tmp_path), r"has no plan\.json", "partitioner compile")


def test_invalid_json(capsys, tmp_path):
    (tmp_path / "plan.json").write_text("{not json")
    assert_short_error(*inspect(capsys, tmp_path), r"plan\.json is not valid JSON", "recompile")


def test_json_that_is_not_a_plan(capsys, tmp_path):
    (tmp_path / "plan.json").write_text('{"version": 1}')
    assert_short_error(*inspect(capsys, tmp_path / "plan.json"), r"is not a plan", "recompile")


def test_plan_edited_by_hand(capsys, folder, tmp_path):
    body = json.loads((folder / "plan.json").read_text())
    body["stages"][0]["predicted_time_s"] *= 0.5
    (tmp_path / "plan.json").write_text(json.dumps(body))
    assert_short_error(*inspect(capsys, tmp_path), r"states hash \w+ but its content hashes to \w+",
                       "edited by hand", "partitioner compile")


def test_unknown_node(capsys, folder):
    assert_short_error(*inspect(capsys, folder, "--node", "lnear_3"), r"--node 'lnear_3' is not a node",
                       r"close matches: linear_3")


def test_html_into_missing_folder(capsys, folder, tmp_path):
    assert_short_error(*inspect(capsys, folder, "--html", tmp_path / "no" / "r.html"), r"folder .*no does not exist")
    assert not (tmp_path / "no").exists()


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for example in ("--json", "--dot", "--html report.html", "--node"):
        assert "partitioner inspect out" in out and example in out


def test_console_script_exit_status(folder):
    """The installed entry point (one subprocess: it imports torch, seconds on two cores): a bad
    target exits 2 with one line on stderr and nothing on stdout."""
    script = Path(sys.executable).with_name("partitioner")
    bad = subprocess.run([str(script), "inspect", str(folder / "missing.json")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "missing.json: no such file or folder" in bad.stderr


def test_python_dash_m_partitioner_is_the_partitioner_command(folder):
    """Where the console script is not on PATH (a bare venv, a cluster image), `python -m partitioner`."""
    done = subprocess.run([sys.executable, "-m", "partitioner", "inspect", str(folder)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"plan {Plan.load(folder).content_hash()}")
