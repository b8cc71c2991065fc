"""What the torchrun-driven benchmarks share: a launch that stops the benchmark on failure, JSONL rows.

The command, its environment and the port come from runtime/launch/torchrun.py, like every launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.drivers import RUN_MANY
from runtime.launch.torchrun import run_env, torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = RUN_MANY  # several program folders in the same workers


def torchrun(nproc: int, args: list[str], *, max_restarts: int = 0, timeout: int = 900):
    """Run a job of ``nproc`` workers (``args``: the script, then its flags); exit with its
    output's tail if it fails."""
    script, *flags = args
    cmd = torchrun_command(script, nproc, args=flags, max_restarts=max_restarts)
    result = subprocess.run(cmd, env=run_env(pythonpath=REPO), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"torchrun failed:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}")
    return result


def rows(path: str) -> list[dict]:
    """The JSON lines of ``path`` ([] when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
