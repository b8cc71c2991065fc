"""Golden files (tests/golden/): compare generated text byte for byte; UPDATE_GOLDEN=1 rewrites them
after a deliberate change (then review the diff)."""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"


def check_golden(name: str, text: str, test_file: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    how = f"if the change is intended, regenerate with: UPDATE_GOLDEN=1 pytest {test_file}"
    assert path.is_file(), f"missing {path}: {how}"
    assert text == path.read_text(), f"{name} differs from tests/golden/{name}; {how}, and review the diff"
