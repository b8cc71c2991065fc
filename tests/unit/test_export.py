"""`partitioner export` on a model that is not a Hugging Face one (partitioner/models/export.py), in one
process: a 2-stage MLP's committed checkpoint, consolidated by original names; what TARGET may be;
refusals that leave nothing behind. (The Hugging Face round trip: tests/e2e/test_hf_in_out.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from _checkpoint_helpers import two_stage_mlp_folder
from _runtime_folders import one_thread  # noqa: F401
from partitioner.cli.commands import main as cli
from partitioner.models.export import export
from runtime.resilience import checkpoint as ck
from tests.drivers.checkpoint_drills import trainers_at
from runtime.errors import PlanMismatchError
from runtime.program.spec import load_program


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = two_stage_mlp_folder(str(tmp_path_factory.mktemp("mlp2")), model_fingerprint="mlp-export",
                                  plan_hash="plan-export")
    program = load_program(folder)
    trainers = trainers_at(folder, 2)
    ck.commit_local(f"{folder}/checkpoints", [ck.snapshot(t) for t in trainers], program)
    want = {n: p.detach().clone() for t in trainers for n, p in t.named_parameters().items()}
    return folder, want


def test_a_checkpoint_exports_whole_by_original_names(trained, tmp_path, capsys):
    folder, want = trained
    assert cli(["export", folder, "-o", str(tmp_path / "out")]) == 0
    # no transformers class fits an MLP: the report says so, and how to load the file, in one line
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no config.json: ")]
    assert len(said) == 1 and "neither a Hugging Face model nor the built-in gpt" in said[0], said
    assert f"load_state_dict(safetensors.torch.load_file('{tmp_path / 'out' / 'model.safetensors'}'))" in said[0]
    assert not (tmp_path / "out" / "config.json").exists()
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary sibling left


def test_targets_a_checkpoint_folder_or_one_step(trained, tmp_path):
    folder, want = trained
    ckpt = tmp_path / "elsewhere"
    shutil.copytree(f"{folder}/checkpoints", ckpt)
    with pytest.raises(ValueError, match="pass --program DIR"):
        export(ckpt, tmp_path / "a")
    report = export(ckpt / ck.step_dirname(2), tmp_path / "a", program_dir=folder)
    assert report.step == 2 and report.num_tensors == len(want) and report.architecture is None
    with pytest.raises(ValueError, match="it exists"):
        export(ckpt, tmp_path / "a", program_dir=folder)


def test_a_checkpoint_of_another_model_is_refused(trained, tmp_path):
    folder, _ = trained
    other = two_stage_mlp_folder(str(tmp_path / "other"), model_fingerprint="another-model", plan_hash="p2")
    with pytest.raises(PlanMismatchError, match="another-model|mlp-export"):
        export(f"{folder}/checkpoints", tmp_path / "out", program_dir=other)
    assert not (tmp_path / "out").exists()
