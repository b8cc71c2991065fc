"""Launching a program under torchrun on this host: the command line, its environment, a free port.

The one place that builds torchrun commands: `partitioner run`, `partitioner verify`, the tests and
the benchmarks all launch through here, so a fix to how we launch (docs/design.md §2: the shared
rendezvous store) lands everywhere at once. Standard library only: generated programs and the
compiler both import it.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (single-host runs bind loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: str | Path, nproc: int, *, args: Sequence[str] = (),
                     max_restarts: int = 0) -> list[str]:
    """``torchrun`` of ``script`` (a .py path, or ``-m package.module``) with ``nproc`` workers on
    this host; everything binds to 127.0.0.1 (docs/design.md §7)."""
    target = ["-m", str(script)[3:]] if str(script).startswith("-m ") else [str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--max-restarts", str(max_restarts), *target, *map(str, args)]


# The entry that trains several folders in the same workers (runtime/run_many.py).
RUN_MANY = "-m runtime.run_many"


def command_text(nproc: int, script: str) -> str:
    """The torchrun line a person types, for messages and generated files' headers."""
    return f"torchrun --nproc-per-node {nproc} --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 {script}"


def run_env(*, pythonpath: str | None = None) -> dict:
    """The environment for torchrun: this process's, plus what makes restarts work.

    ``pythonpath`` goes first on PYTHONPATH, so workers import the same checkout as the caller
    (tests and benchmarks pass the repository root)."""
    env = dict(os.environ)
    # torchrun restarts with gloo hang on a stale shared store unless this is set (docs/design.md §2).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Ranks share this host's cores: torch's default of one thread per core oversubscribes them.
    env.setdefault("OMP_NUM_THREADS", "1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return env
