"""Each training feature declared once (Note [one feature, one module] in runtime/features/__init__.py):
the shared files name no feature, the list names every feature module, a plan.json of an older
compile still reads, and a program folder of the older format is refused (Note [program format])."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from _runtime_folders import mlp_folder
from partitioner.cli import main
from partitioner.config.settings import Decisions, TrainingSettings
from runtime.errors import PlanMismatchError
from runtime.features import registry
from runtime.launch import rank
from runtime.program.spec import PROGRAM_FORMAT, load_program, seal_folder

REPO = Path(__file__).resolve().parents[2]
SHARED = ("partitioner/compiler.py", "partitioner/config/settings.py", "partitioner/config/job.py",
          "partitioner/codegen/lower.py", "runtime/program/spec.py", "runtime/launch/run_options.py",
          "runtime/launch/rank.py")


def test_the_shared_files_name_no_feature():
    names = {s.key for f in registry.FEATURES for s in f.settings} | {s.flag for f in registry.FEATURES
                                                                      for s in f.settings}
    named = {(path, name) for path in SHARED for name in names if name in (REPO / path).read_text()}
    assert not named, f"a shared file names a feature's setting (declare it in runtime/features/): {sorted(named)}"


def test_the_list_names_every_feature_module_and_main_keeps_the_core():
    modules = {p.stem for p in (REPO / "runtime/features").glob("*.py")} - {"__init__", "base", "registry"}
    assert {type(f).__module__.rsplit(".", 1)[1] for f in registry.FEATURES} == modules
    keys = [s.key for f in registry.FEATURES for s in f.settings]
    assert len(keys) == len(set(keys))
    assert len(inspect.getsource(rank._main).splitlines()) < 80


def test_a_plan_json_of_an_older_compile_reads_its_features_flat():
    decisions = Decisions.from_dict({"precision": "fp32", "shard_optimizer": False, "sdc_every": 0,
                                     "no_decay": [], **{s.key: 3 for s in registry.settings(side="compile")}})
    assert dict(decisions.features) == {s.key: 3 for s in registry.settings(side="compile")}
    assert Decisions.from_dict(decisions.to_dict()) == decisions
    settings = TrainingSettings.from_dict({s.key: 2 for s in registry.settings(side="compile")})
    assert TrainingSettings.from_dict(settings.to_dict()) == settings


@pytest.mark.parametrize("old", ["no version", "a feature's key of format 1"])
def test_a_program_folder_of_the_older_format_is_refused_with_the_reason(tmp_path, old, capsys):
    mlp_folder(tmp_path, splits=[[0, 1, 2, 3]], ranks=[([0], 0)])
    assert load_program(str(tmp_path)).format_version == PROGRAM_FORMAT
    plan = json.loads((tmp_path / "plan.json").read_text())
    del plan["program"]["format_version"]
    if old != "no version":
        plan["program"][registry.settings(side="compile")[0].key] = 2
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    seal_folder(str(tmp_path))
    with pytest.raises(PlanMismatchError, match=f"program format 1, and this runtime reads format {PROGRAM_FORMAT}.*"
                                                "recompile"):
        load_program(str(tmp_path))
    assert main(["run", str(tmp_path)]) == 2  # `partitioner run` says it before any worker starts
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "recompile" in err and not (tmp_path / "run").exists(), err
