"""The generated stage file is code a person reads (Note [stage code] in partitioner/codegen/stage_code.py):
golden copies of a small program's files, and the same bytes from any checkout path.

After a deliberate change to the generated code, regenerate the golden files and review the diff:

    UPDATE_GOLDEN=1 pytest tests/unit/test_stage_code.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import gpt
from _golden import check_golden

TEST_FILE = "tests/unit/test_stage_code.py"

REPO = Path(__file__).resolve().parents[2]
# The plan hash covers the solver's figures: a change to the cost model must not look like a
# change to the generated code.
HASH = re.compile(r"plan [0-9a-f]{16}")


def tiny_gpt():
    return gpt(layers=2, width=32, heads=2, vocab=64, seq=16, dropout=0.1)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stage_code") / "prog"
    plan = partitioner.compile(tiny_gpt(), cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8,
                               num_stages=2, microbatches=4)
    plan.save(folder)
    return folder


@pytest.mark.parametrize("name", ["stage_0.py", "stage_1.py"])
def test_generated_files_match_their_golden_copies(program, name):
    check_golden(f"program_{name}", HASH.sub("plan <hash>", (program / name).read_text()), TEST_FILE)


def test_the_entry_point_and_a_ranks_role_match_their_golden_copies(program):
    """One train.py whose training loop a person reads, and rank 1's role as `inspect --rank 1`
    prints it, what rank_1.py used to state (Note [roles from the plan] in runtime/launch/entry_files.py)."""
    from partitioner.cli import main as cli_main

    check_golden("program_train.py", (program / "train.py").read_text(), TEST_FILE)
    assert not list(program.glob("rank_*.py"))
    proc = subprocess.run([sys.executable, "-m", "partitioner", "inspect", str(program), "--rank", "1"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    check_golden("program_rank_1_role.txt", proc.stdout, TEST_FILE)
    assert cli_main(["inspect", str(program), "--rank", "2"]) == 2  # a 2-rank program: one line, the ranks there are
    assert cli_main(["inspect", str(program), "--rank", "1", "--dot"]) == 2  # one view at a time


# A command a person types, as the README and train.py's docstring indent it: env settings, torchrun, train.py.
_TYPED_LAUNCH = re.compile(r"^[ \t]+((?:[A-Z_]+=\S+ )*torchrun [^\n]*?train\.py)", re.M)


def _constant(source: str, name: str):
    import ast

    return next(ast.literal_eval(node.value) for node in ast.parse(source).body
                if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name])


def test_one_launch_line_in_the_readme_and_train_py(program):
    """Issue 43: the folder's README and train.py said two different torchrun lines."""
    readme, train = (program / "README.md").read_text(), (program / "train.py").read_text()
    said = {"README.md": set(_TYPED_LAUNCH.findall(readme)), "train.py": set(_TYPED_LAUNCH.findall(train))}
    assert len(said["README.md"]) == 1 and said["README.md"] == said["train.py"], said
    (line,) = said["README.md"]
    assert "--rdzv-conf store_type=file" in line  # the private rendezvous file, not a TCP store
    assert _constant(train, "LAUNCH") == line


def test_the_program_object_round_trips_through_its_dataclass(program):
    """plan.json's "program" is Program.to_dict(): reading it back gives the same JSON."""
    import json

    from runtime.program.spec import Program, load_program

    data = json.loads((program / "plan.json").read_text())["program"]
    assert Program.from_dict(data).to_dict() == data
    loaded = load_program(str(program))
    assert Program.from_dict(loaded.to_dict()) == loaded and loaded.plan_hash


def test_stage_files_carry_no_fx_noise_and_name_what_crosses(program):
    import json

    for k in (0, 1):
        text = (program / f"stage_{k}.py").read_text()
        assert "; " not in text.split("class Stage")[1]  # no `;  x = None` deletions
        assert "No stacktrace found" not in text and str(REPO) not in text and "site-packages" not in text
        assert "# blocks.0.attn (partitioner/models/builtin.py:" in text or k == 1
        assert "randomness.dropout(" in text
    stages = json.loads((program / "plan.json").read_text())["program"]["stages"]
    assert [v["name"] for v in stages[0]["outputs"]] == [v["name"] for v in stages[1]["inputs"]] == ["blocks_0_out"]
    assert 'OUTPUTS = ["blocks_0_out"]' in (program / "stage_0.py").read_text()
    assert "def forward(self, blocks_0_out):" in (program / "stage_1.py").read_text()


def _copy_checkout(root: Path) -> Path:
    for package in ("partitioner", "passes", "runtime"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_same_inputs_give_the_same_bytes_from_two_checkout_paths(tmp_path):
    """Nothing in a program folder depends on where the compiler lives (source comments name
    files by import path, Note [stage code])."""
    model = "gpt:layers=2,width=32,heads=2,vocab=64,seq=16"
    folders, compiles = [], []
    for checkout in (tmp_path / "a", tmp_path / "b" / "a" / "much" / "deeper" / "checkout"):
        _copy_checkout(checkout)
        env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
        script = ("import sys, partitioner, passes, runtime; "
                  "assert all(m.__file__.startswith(sys.argv[1]) for m in (partitioner, passes, runtime)); "
                  "from partitioner.cli import main; "
                  "sys.exit(main(sys.argv[2:]))")
        # the two compiles side by side, one core each (single-threaded: neither oversubscribes)
        compiles.append(subprocess.Popen(
            [sys.executable, "-c", script, str(checkout), "compile", model, "-o", "out", "--devices", "2",
             "--stages", "2", "--microbatches", "4", "--global-batch", "8"],
            cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        folders.append(checkout / "out")
    try:
        for done in compiles:
            out, _ = done.communicate(timeout=180)
            assert done.returncode == 0, out
    finally:
        for done in compiles:
            if done.poll() is None:
                done.kill()
                done.wait()
    files = [sorted(str(p.relative_to(f)) for p in f.rglob("*") if p.is_file()) for f in folders]
    assert files[0] == files[1]
    differing = [name for name in files[0] if name != "compile_stats.json"
                 and (folders[0] / name).read_bytes() != (folders[1] / name).read_bytes()]
    assert differing == [], differing
    stage_0 = (folders[0] / "stage_0.py").read_text()
    assert "partitioner/models/builtin.py:" in stage_0 and str(tmp_path) not in stage_0
