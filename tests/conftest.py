"""Tests sit in three folders, one marker each, so a developer can run the fast ones alone:

    unit/   one process each (the launch checks of test_hardening_integrity.py, test_hardening_rendezvous.py
            and test_run_options.py start torchrun)
                                                    pytest -m unit      (or pytest tests/unit)
    dist/   real torchrun process groups (gloo)     pytest -m dist
    e2e/    compile, run the program, compare with the one-process oracle   pytest -m e2e

The helpers the folders share (_programs.py, _runtime_folders.py, _checkpoint_helpers.py,
_bn_workload.py) and the golden files live here, in tests/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Every compile in the suite (and in the processes it starts) prices cpu devices with the cpu
# preset, not this machine's profile, so no golden figure depends on the machine (Note [machine
# profile cache] in partitioner/calibrate/machine.py); the tests of the profile unset it.
os.environ["PARTITIONER_NO_CALIBRATE"] = "1"
sys.path.insert(0, str(HERE))  # the shared helpers import as `_programs`, `_runtime_folders`, ...

FOLDERS = ("unit", "dist", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).resolve().parent.name
        if folder in FOLDERS:
            item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture(scope="session")
def shared_launches(request, tmp_path_factory):
    """One torchrun launch per world size for every module that registered a preparer
    (Note [shared launches] in tests/_shared_launch.py)."""
    from _shared_launch import SharedLaunches

    modules = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    return SharedLaunches(tmp_path_factory.mktemp("shared"), modules)
