"""User code travels with the program folder (Note [user code travels] in partitioner/frontend/user_source.py):
a model file that imports its sibling modules (and a package of the same folder), and a model file
that defines a torch.library custom op with its own backward, and one applying a custom
torch.autograd.Function (tests/own_model/straight_through.py), each compiled with the `partitioner`
command in the user's folder, trained 2 steps on 2 ranks in the session's shared launch (Note
[shared launches] in tests/_shared_launch.py) and verified against the one-process oracle. The
first two model files are called my_model.py, with a sibling my_blocks.py each: the two programs train one after
the other in the same workers, each importing its own copies (Note [one user root] in
runtime/program/user_code.py). What cannot travel is refused at compile time in one line with the fix.

The model files are tests/own_model/siblings/, tests/own_model/custom_op/ and straight_through.py, copied into temporary
folders that are no package and not on sys.path, as a user's would be.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _shared_launch import Job, prepare
from partitioner.cli.verify import check_run, read_program_run

OWN = Path(__file__).resolve().parent.parent / "own_model"
# The command a user types (its sys.path holds neither the current directory nor the model's folder);
# where this interpreter has no console script, the same entry point without the current directory.
PARTITIONER = ([str(Path(sys.executable).with_name("partitioner"))] if Path(sys.executable).with_name("partitioner").is_file()
               else [sys.executable, "-P", "-m", "partitioner"])
COPIED = {"siblings": ["user/my_model.py", "user/my_blocks.py", "user/layers/__init__.py", "user/layers/mix.py"],
          "custom_op": ["user/my_model.py", "user/my_blocks.py"]}


def compile_cli(cwd: Path, *args, check: bool = True, module: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "partitioner"] if module else PARTITIONER
    done = subprocess.run(command + ["compile", *map(str, args), "--devices", "2", "--stages", "2",
                                     "--global-batch", "8", "-q"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, f"compile {args} failed:\n{done.stdout}\n{done.stderr}"
    return done


def error_lines(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if line.strip())


@prepare
def _travelling_programs(root: Path):
    for name in COPIED:
        home = root / name
        shutil.copytree(OWN / name, home, ignore=shutil.ignore_patterns("__pycache__"))
        compile_cli(home, "my_model.py:build", "-o", "out")
    (root / "function").mkdir()  # Note [autograd Functions run as themselves]
    shutil.copy(OWN / "straight_through.py", root / "function")
    compile_cli(root / "function", "straight_through.py:build", "-o", "out")
    jobs = [Job(2, [root / name / "out", "--steps", "2", "--run-dir", root / f"run_{name}", "--checkpoint-dir",
                    root / f"ck_{name}"]) for name in (*COPIED, "function")]
    return root, jobs


@pytest.fixture(scope="module")
def travelled(shared_launches):
    return shared_launches.result(_travelling_programs)[0]


def test_a_model_file_importing_its_siblings_compiles_runs_and_verifies(travelled):
    folder = travelled / "siblings" / "out"
    plan = json.loads((folder / "plan.json").read_text())
    assert set(COPIED["siblings"]) <= set(plan["files"])  # every copied file hashed (Note [folder integrity])
    assert plan["program"]["data"]["make_batch"][0] == "user/my_model.py:make_batch"
    report = check_run(folder, travelled / "run_siblings")  # the oracle rebuilds the model from the user's file
    assert report.ok, report.text()


def test_a_custom_op_defined_in_the_model_file_is_imported_from_the_copy_and_trains(travelled):
    """Note [custom ops travel] holds: the stage file calling torch.ops.own_model.round_ste imports the
    copied model file by its name; the op's registered backward (straight-through) is what the
    ranks train with, as the oracle does (round's own gradient is zero: a dropped backward would
    leave `inp` untrained and fail the comparison)."""
    folder = travelled / "custom_op" / "out"
    stages = [(folder / f"stage_{k}.py").read_text() for k in (0, 1)]
    calling = [text for text in stages if "torch.ops.own_model.round_ste" in text]
    assert len(calling) == 1 and "\nimport my_model  # its torch.ops" in calling[0], calling
    assert set(COPIED["custom_op"]) <= set(json.loads((folder / "plan.json").read_text())["files"])
    report = check_run(folder, travelled / "run_custom_op")
    assert report.ok, report.text()


def test_a_custom_autograd_function_runs_as_itself_in_the_stage_and_trains_bit_for_bit(travelled):
    """Note [autograd Functions run as themselves] holds: the stage file calls RoundSTE.apply from the copied
    model file, so the ranks train with its straight-through backward, exactly as the oracle (the
    user's module) does; traced through, round's zero gradient would leave `inp` where it started."""
    folder = travelled / "function" / "out"
    stages = [(folder / f"stage_{k}.py").read_text() for k in (0, 1)]
    calling = [text for text in stages if "straight_through.RoundSTE.apply(" in text]
    assert len(calling) == 1 and "\nimport straight_through  #" in calling[0], calling
    assert "user/straight_through.py" in json.loads((folder / "plan.json").read_text())["files"]
    report = check_run(folder, travelled / "run_function")
    assert report.ok and report.max_loss_diff == 0 and report.max_param_diff == 0, report.text()
    trained = read_program_run(travelled / "run_function")[1]["inp.weight"]
    torch.manual_seed(0)  # build()'s first layer, as it started
    assert not torch.equal(trained, torch.nn.Linear(8, 16).weight.detach())


def test_an_edited_copied_sibling_is_refused(travelled, tmp_path):
    from partitioner.errors import PlanMismatchError
    from runtime.program.spec import load_program

    folder = tmp_path / "prog"
    shutil.copytree(travelled / "siblings" / "out", folder)
    sibling = folder / "user" / "my_blocks.py"
    sibling.write_text(sibling.read_text().replace("torch.tanh", "torch.relu"))
    with pytest.raises(PlanMismatchError, match=r"user/my_blocks\.py \(changed\)"):
        load_program(str(folder))


def test_a_sibling_that_reads_a_file_next_to_itself_is_refused_at_compile_time(tmp_path):
    shutil.copy(OWN / "siblings" / "my_model.py", tmp_path / "my_model.py")
    (tmp_path / "my_blocks.py").write_text(
        "from pathlib import Path\n"
        "import torch.nn as nn\n"
        "SCALE = float((Path(__file__).parent / 'scale.txt').read_text())\n"
        "class Block(nn.Linear):\n"
        "    def __init__(self, width):\n"
        "        super().__init__(width, width)\n")
    (tmp_path / "scale.txt").write_text("0.5\n")
    done = compile_cli(tmp_path, "my_model.py:build", "-o", "out", check=False)
    err = error_lines(done.stderr)
    assert done.returncode == 2 and len(err.splitlines()) == 1, done.stderr
    assert err.startswith("error: ") and "my_blocks.py:3" in err and "scale.txt" in err, err
    assert "FileNotFoundError" in err and "pip install -e" in err and "PYTHONPATH" in err, err
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no half-written folder


def test_a_module_outside_the_model_folder_that_is_not_installed_is_refused_at_compile_time(tmp_path):
    """`python -m partitioner` run from the project folder finds common.py there (the current
    directory is on its sys.path); the ranks would not: refused before the trace, naming it."""
    (tmp_path / "models").mkdir()
    text = (OWN / "siblings" / "my_model.py").read_text().replace("from my_blocks import Block",
                                                                   "from common import Block")
    (tmp_path / "models" / "my_model.py").write_text(text)
    shutil.copy(OWN / "siblings" / "layers" / "mix.py", tmp_path / "common.py")
    with open(tmp_path / "common.py", "a") as f:
        f.write("\n\nBlock = Mix\n")
    done = compile_cli(tmp_path, "models/my_model.py:build", "-o", "out", check=False, module=True)
    err = error_lines(done.stderr)
    assert done.returncode == 2 and len(err.splitlines()) == 1, done.stderr
    assert "common" in err and str(tmp_path / "common.py") in err and str(tmp_path / "models") in err, err
    assert "pip install -e" in err and "PYTHONPATH" in err, err
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
