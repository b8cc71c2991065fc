"""What the torchrun-driven benchmarks share: a free port, the environment, a launch, JSONL rows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(REPO, "tests", "_run_checkpoint_programs.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env() -> dict:
    """One thread per process, a fresh rendezvous store per job, this checkout importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def torchrun(nproc: int, args: list[str], *, max_restarts: int = 0, timeout: int = 900):
    """Run a job of ``nproc`` workers; exit with its output's tail if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--max-restarts", str(max_restarts), *args]
    result = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"torchrun failed:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}")
    return result


def rows(path: str) -> list[dict]:
    """The JSON lines of ``path`` ([] when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
