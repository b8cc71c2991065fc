"""Training settings: defaults < job file < training= / flags, merged key by key, every key checked
(Note [training settings merge] in partitioner/config/job.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from partitioner.config.job import DEFAULT_TRAINING, load_job, training_settings
from partitioner.config.settings import TrainingSettings
from runtime.program.parts import OptimizerSettings


def test_a_partial_optimizer_dict_keeps_the_other_defaults():
    got = training_settings({"optimizer": {"lr": 3e-4}})
    assert got.optimizer.lr == 3e-4
    defaults = OptimizerSettings()  # the one set of optimizer defaults (the runtime's too)
    for key in ("betas", "weight_decay", "lr_schedule", "warmup_steps", "total_steps", "eps"):
        assert getattr(got.optimizer, key) == getattr(defaults, key), key
        assert DEFAULT_TRAINING["optimizer"][key] == defaults.to_dict()[key], key
    assert got.seed == TrainingSettings().seed
    assert DEFAULT_TRAINING["optimizer"]["lr"] == 1e-3 == defaults.lr  # the defaults themselves are not changed


def test_later_layers_win_key_by_key():
    job = {"optimizer": {"lr": 0.01, "betas": [0.8, 0.9]}, "seed": 5}
    flags = {"optimizer": {"lr": 0.003}}
    got = training_settings(job, flags)
    assert got.optimizer.lr == 0.003 and got.optimizer.betas == (0.8, 0.9) and got.seed == 5


@pytest.mark.parametrize("settings, words", [
    ({"optimizer": {"learning_rate": 1e-3}}, r"training.optimizer has unknown key learning_rate; known keys: .*lr"),
    ({"optimiser": {}}, r"training has unknown key optimiser"),
    ({"optimizer": {"lr": "fast"}}, r"training.optimizer.lr = 'fast' must be a number"),
    ({"optimizer": {"lr": -1}}, r"training.optimizer.lr = -1 must be > 0"),
    ({"optimizer": {"betas": [0.9]}}, r"training.optimizer.betas = \[0.9\] must be two numbers"),
    ({"optimizer": {"lr_schedule": "step"}}, r"lr_schedule = 'step' must be one of 'cosine'"),
    ({"optimizer": {"warmup_steps": 2.5}}, r"warmup_steps = 2.5 must be a whole number"),
    ({"clip_grad_norm": 0}, r"clip_grad_norm = 0 must be > 0"),
    ({"optimizer": {"clip_grad_norm": 1.0}}, r"training.optimizer has unknown key clip_grad_norm"),
    ({"precision": "bf16"}, r"precision = 'bf16' must be one of"),
    ({"checkpoint_every": True}, r"checkpoint_every = True must be a whole number"),
    ({"memory_tier": "mirror"}, r"memory_tier = 'mirror' must be one of"),
    ({"sdc_every": -1}, r"training.sdc_every = -1 must be >= 0"),
    ({"sdc_every": "often"}, r"training.sdc_every = 'often' must be a whole number"),
])
def test_unknown_keys_and_wrong_types_name_the_key(settings, words):
    with pytest.raises(ValueError, match=words):
        training_settings(settings)


def test_clip_grad_norm_is_a_training_setting():
    # One place for it (like precision): training["clip_grad_norm"], which becomes the program
    # object's clip_grad_norm (runtime/program/spec.py) that runtime/execute/train.py clips with.
    assert training_settings({"clip_grad_norm": 1.0}).clip_grad_norm == 1.0
    assert training_settings().clip_grad_norm is None


JOB = """
[training]
lr = 3e-4
steps = 500
warmup_steps = 10
betas = [0.9, 0.95]
clip_grad_norm = 1.0
mtbf = "6h"

[cluster]
[[cluster.group]]
kind = "h100"
count = 16
"""


def test_a_job_file_reads_training_and_cluster(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    job = load_job(path)
    got = training_settings(job.training)
    assert got.optimizer.lr == 3e-4 and got.optimizer.total_steps == 500
    assert got.clip_grad_norm == 1.0 and got.mtbf_s == 6 * 3600
    assert got.optimizer.weight_decay == DEFAULT_TRAINING["optimizer"]["weight_decay"]
    assert job.cluster.num_devices == 16 and job.cluster.devices[0].kind == "h100"
    assert got.sdc_every is None  # left out: the compiler picks it by dp (sdc_cost.default_every)
    (tmp_path / "k.toml").write_text("[training]\nsdc_every = 0\n")
    assert training_settings(load_job(tmp_path / "k.toml").training).sdc_every == 0


def test_a_job_file_may_name_a_cluster_file(tmp_path):
    (tmp_path / "cluster.toml").write_text('[[group]]\nkind = "cpu"\ncount = 3\n')
    (tmp_path / "job.toml").write_text('cluster = "cluster.toml"\n[training]\nlr = 0.01\n')
    assert load_job(tmp_path / "job.toml").cluster.num_devices == 3


@pytest.mark.parametrize("text, words", [
    ("[training]\nlearning_rate = 1e-3\n", r"\[training\] has unknown key learning_rate; known keys: .*lr"),
    ("[training]\nsteps = 0\n", r"\[training\].steps = 0 must be >= 1"),
    ("[training]\nlr = \"0.1\"\n", r"\[training\].lr = '0.1' must be a number"),
    ("[training]\nmtbf = \"soon\"\n", r"\[training\].mtbf"),
    ("[training]\ncheckpoint_every = 5\nmtbf = \"6h\"\n", r"both checkpoint_every and mtbf"),
    ("[trainig]\nlr = 1\n", r"unknown key trainig"),
    ("[training]\nsdc_every = 2.5\n", r"\[training\].sdc_every = 2.5 must be a whole number"),
    ("[training]\nsdc_every = -3\n", r"\[training\].sdc_every = -3 must be >= 0"),
    ("[cluster]\n[[cluster.group]]\nkind = \"cpu\"\n", r"\[cluster\]: group\[0\] needs 'kind' and 'count'"),
    ("[training\n", r"not valid TOML"),
])
def test_job_file_errors_name_the_key(tmp_path, text, words):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=words):
        load_job(path)


def test_cli_refuses_a_bad_job_file_before_tracing(tmp_path):
    (tmp_path / "job.toml").write_text("[training]\nlr = 1\nwarmup = 3\n")
    done = subprocess.run([sys.executable, "-m", "partitioner", "compile", "mlp", "-o", str(tmp_path / "out"),
                           "--job", str(tmp_path / "job.toml")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "unknown key warmup" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
