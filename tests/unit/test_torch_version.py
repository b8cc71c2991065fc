"""What the runtime needs (Note [what the runtime needs] in runtime/torch_version.py): torch 2.11 or
newer, refused at a rank's start in one line when older; and, at module level, nothing but the
standard library, torch, numpy and safetensors (the optional packages are imported where a run
asks for them). tests/e2e/test_runtime_needs.py trains a compiled folder where nothing else can be
imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runtime.errors import MissingPackageError
from runtime.launch.torchrun import run_env
from runtime.torch_version import check_torch, installed_torch_version, major_minor, pipeline_refusal

REPO = Path(__file__).resolve().parents[2]
# What a cluster image has (docs/gpu.md): the runtime's module-level imports need no more.
IMAGE = {"torch", "numpy", "safetensors"}


@pytest.mark.parametrize("version", ["2.10.0+cu128", "2.10.1", "2.9.0a0+git1234567", "1.13.1"])
def test_an_older_torch_is_refused_in_one_line_naming_it_and_the_fix(version):
    with pytest.raises(MissingPackageError) as caught:
        check_torch(version)
    message = str(caught.value)
    assert "\n" not in message and f"torch {version} is older" in message
    assert "pip install 'torch>=2.11'" in message


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.11.0a0+git70d99e9", "2.11.0.dev20260101", "2.12.1",
                                     "2.13.0", "3.0.0", "a build that says no number"])
def test_2_11_and_newer_pass(version):
    check_torch(version)


def test_the_installed_torch_is_read_without_importing_it_and_passes():
    assert installed_torch_version() == str(torch.__version__)
    assert major_minor(str(torch.__version__)) >= (2, 11)
    check_torch()


def test_a_rank_refuses_an_older_torch_first_in_one_line(tmp_path):
    """The check runs before anything reads the folder (here none exists) or imports torch (here a
    stand-in that says 2.10.0 and has nothing else: any use of it would be a traceback)."""
    script = textwrap.dedent(f"""
        import sys, types
        torch = types.ModuleType("torch")
        torch.__version__ = "2.10.0+cu128"
        sys.modules["torch"] = torch
        import runtime.launch.rank
        runtime.launch.rank.main({str(tmp_path / "absent")!r}, rank=0, argv=["--steps", "2"])
    """)
    done = subprocess.run([sys.executable, "-c", script], env=run_env(pythonpath=str(REPO)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "[rank 0] MissingPackageError: torch 2.10.0+cu128 is older than the oldest the runtime runs under "
        "(torch 2.11; run under 2.11 through 2.13): install a newer one here, e.g. pip install 'torch>=2.11' "
        "(a build for this machine's CUDA)"], done.stderr


def module_level_imports(source: str) -> set[str]:
    """Top-level names a module imports when it is imported: its imports outside functions (a
    function's import runs when it is called: the optional packages)."""
    names: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names.update(a.name.partition(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names.add(child.module.partition(".")[0])
            visit(child)

    visit(ast.parse(source))
    return names


def test_the_runtime_imports_only_torch_numpy_and_safetensors_at_module_level():
    allowed = IMAGE | set(sys.stdlib_module_names) | {"runtime", "__future__"}
    extra = {f"{path.relative_to(REPO)}: {name}" for path in sorted((REPO / "runtime").rglob("*.py"))
             for name in module_level_imports(path.read_text()) - allowed}
    assert not extra, sorted(extra)


def test_the_module_level_rule_sees_a_module_level_import_and_not_a_lazy_one():
    source = "import os\nimport zstandard\nfrom ortools.sat import x\ndef f():\n    import transformers\n"
    assert module_level_imports(source) == {"os", "zstandard", "ortools"}


def test_an_integer_tensor_between_stages_is_refused_before_torch_2_13(tmp_path):
    """torch 2.11 and 2.12 fail at the first step of such a plan (Note [torch 2.11's pipelining])."""
    from _runtime_folders import skip_folder  # lazy: builds stage files with torch

    _, program = skip_folder(str(tmp_path / "skip"))  # stage 0 sends stage 1 an int64 mask
    for version in ("2.11.0+cu130", "2.12.0"):
        why = pipeline_refusal(program, version)
        assert why is not None and why.startswith(f"torch {version} cannot pass 'mask' (torch.int64) from stage 0 "
                                                  "to stage 1")
        assert "pip install 'torch>=2.13'" in why and "\n" not in why
    assert pipeline_refusal(program, "2.13.0") is None


def test_two_adjacent_stages_on_one_gloo_rank_are_refused_under_torch_2_11(tmp_path):
    from _runtime_folders import mlp_folder  # lazy: builds stage files with torch

    _, program = mlp_folder(str(tmp_path / "v"), splits=[[0], [1], [2], [3]], ranks=[([0, 3], 0), ([1, 2], 0)],
                            schedule="zbv")
    why = pipeline_refusal(program, "2.11.0+cu130")
    assert why is not None and why.startswith("torch 2.11.0+cu130 cannot run stages 1 and 2 on one rank (rank 1) "
                                              "over gloo")
    assert "pip install 'torch>=2.12'" in why and "another --schedule than zbv" in why
    assert pipeline_refusal(program, "2.12.0") is None
    _, flat = mlp_folder(str(tmp_path / "flat"), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)])
    assert pipeline_refusal(flat, "2.11.0") is None  # float boundaries, one stage per rank: 2.11 runs it


def test_a_rank_refuses_the_plan_its_torch_cannot_pipeline_in_one_line_at_start(tmp_path):
    """This torch, saying it is 2.12.0: the rank refuses before its first collective."""
    from _runtime_folders import skip_folder  # lazy: builds stage files with torch

    skip_folder(str(tmp_path / "skip"))
    script = textwrap.dedent(f"""
        import torch
        torch.__version__ = "2.12.0"
        import runtime.launch.rank
        runtime.launch.rank.main({str(tmp_path / "skip")!r}, rank=0, argv=["--steps", "2"])
    """)
    env = dict(run_env(pythonpath=str(REPO)), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("[rank 0] LaunchError: torch 2.12.0 cannot pass 'mask' (torch.int64)")
