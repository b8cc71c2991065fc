"""`pytest tests/unit`, as tests/conftest.py documents it, collects without `python -m`.

Plain `pytest` puts neither the working directory nor the repository root on sys.path, so a test
module that imports `tests.drivers` or `tests.unit...` fails to collect, and `partitioner` resolves
to whatever checkout is installed editable, not this one. pyproject's `pythonpath` fixes both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A module that imports `tests.unit.test_solver_hand` and `partitioner`, and collects without torch
# (about 2 s), so the check stays a unit test.
PROBE = REPO / "tests" / "unit" / "test_solver_schedule_choice.py"

# What the console script `pytest` does: no working directory on sys.path (an empty folder stands
# in for `-c`'s), then print where `partitioner` was imported from.
_PLAIN_PYTEST = """
import sys
if "" in sys.path:
    sys.path.remove("")
import pytest
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]])
import partitioner
print("PARTITIONER_FROM", partitioner.__file__)
sys.exit(int(rc))
"""


def test_plain_pytest_collects_the_documented_way(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_PYTEST, str(PROBE)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.lower(), done.stdout[-3000:]
    where = next(line for line in done.stdout.splitlines() if line.startswith("PARTITIONER_FROM"))
    assert where.split(" ", 1)[1].startswith(str(REPO / "partitioner")), where


def test_no_two_test_modules_share_a_name():
    """tests/unit, e2e and dist have no __init__.py, so pytest imports each test module by its bare
    name: a second file of the same name stops the whole session at collection ("import file
    mismatch"), and only in a run that collects both."""
    by_name: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
