"""What README says a user can copy is what the code takes: the own-model example is the file the
e2e test runs, the job and cluster examples parse, the Python floor is stated and checked."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from partitioner.cluster import ClusterSpec
from partitioner.job import load_job, training_settings
from runtime.python_version import check_python

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _block(after_heading: str, lang: str) -> str:
    section = README[README.index(after_heading):]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def test_use_it_opens_with_the_own_model_file_the_tests_run():
    use_it = README[README.index("## Use it"):]
    assert use_it.index("```python\n" + (REPO / "tests/own_model/my_model.py").read_text()) < use_it.index("from partitioner.models")


def test_the_job_file_example_loads(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(_block("### Job file", "toml"))
    job = load_job(path)
    got = training_settings(job.training)
    assert got.optimizer.lr == 3e-4 and got.clip_grad_norm == 1.0
    assert job.cluster.num_devices == 16


def test_the_cluster_file_example_loads():
    cluster = ClusterSpec.from_dict(tomllib.loads(_block("### Cluster file", "toml")))
    assert cluster.num_devices == 16 and {d.node for d in cluster.devices} == {0, 1}


def test_python_floor_is_stated_and_checked():
    assert "Python 3.11 or newer" in README
    assert 'requires-python = ">=3.11"' in (REPO / "pyproject.toml").read_text()
    with pytest.raises(ImportError, match=r"needs Python 3.11 or newer.*this is Python 3.10.12.*python3.11 -m venv"):
        check_python((3, 10, 12))
    check_python((3, 11, 0))
