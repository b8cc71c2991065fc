"""torchrun entry that trains several program folders one after another in the same workers, each
with its own train.py flags: tests and benchmarks use it to save the seconds every worker spends
importing torch.distributed.pipelining::

    torchrun --nproc-per-node N -m runtime.run_many [--job-logs DIR] FOLDER [FLAGS...] [-- FOLDER [FLAGS...]]...

The default process group is created here, so runtime.launch.main reuses it (and leaves it alone).
Every folder must be compiled for N ranks. ``--job-logs DIR``: what each rank prints while it trains
job i goes to DIR/job_<i>.rank_<r>.out and .err instead of the shared streams, so a caller that
put many jobs in one launch can tell whose line is whose (tests/_shared_launch.py).
"""

import os
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

import runtime.launch


def jobs_of(argv: list[str]) -> list[list[str]]:
    """``FOLDER FLAGS... -- FOLDER FLAGS...`` -> [[FOLDER, FLAGS...], ...]."""
    jobs, current = [], []
    for arg in argv + ["--"]:
        if arg == "--":
            if current:
                jobs.append(current)
            current = []
        else:
            current.append(arg)
    return jobs


@contextmanager
def _output_to(prefix: str | None):
    """fds 1 and 2 into PREFIX.out / PREFIX.err for the block (child processes included)."""
    if prefix is None:
        yield
        return
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            with open(prefix + suffix, "a") as f:
                os.dup2(f.fileno(), fd)
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


if __name__ == "__main__":
    argv = sys.argv[1:]
    logs = None
    if argv[:1] == ["--job-logs"]:
        logs, argv = argv[1], argv[2:]
        os.makedirs(logs, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # loopback store on one host
    dist.init_process_group("gloo", timeout=timedelta(seconds=60), rank=rank, world_size=world,
                            store=runtime.launch._worker_store(rank, world, timedelta(seconds=60)))
    for i, (folder, *flags) in enumerate(jobs_of(argv)):
        with _output_to(None if logs is None else os.path.join(logs, f"job_{i}.rank_{rank}")):
            runtime.launch.main(folder, argv=flags)
    dist.destroy_process_group()
