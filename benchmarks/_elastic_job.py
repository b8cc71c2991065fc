"""What the elastic benchmarks share (benchmarks/elastic_recovery.py, benchmarks/canary_exclusion.py):
one `partitioner run --elastic` job on 4 ranks as two loopback hosts, and the run folder's JSONL
records are read back with _torchrun's ``rows``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_elastic(folder: str, run_dir: str, ckpt: str, *, steps: int, flags: list[str], name: str) -> float:
    """`partitioner run FOLDER --elastic --hosts 0,0,1,1` with ``flags``, in a memory-tier folder of
    its own (removed after); the wall seconds. A failed job ends the benchmark with its stderr."""
    from runtime.launch.torchrun import run_env

    shm = f"/dev/shm/partitioner-bench-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "partitioner", "run", folder, "--elastic", "--hosts", "0,0,1,1", "--steps",
           str(steps), "--run-dir", run_dir, "--checkpoint-dir", ckpt, "--memory-dir", shm, "--quiet", *flags]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=run_env(pythonpath=REPO), capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return time.perf_counter() - t0
