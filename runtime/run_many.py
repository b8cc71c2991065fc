"""torchrun entry that trains several program folders one after another in the same workers, each
with its own train.py flags: tests and benchmarks use it to save the seconds every worker spends
importing torch.distributed.pipelining::

    torchrun --nproc-per-node N -m runtime.run_many FOLDER [FLAGS...] [-- FOLDER [FLAGS...]]...

The default process group is created here, so runtime.launch.main reuses it (and leaves it alone).
Every folder must be compiled for N ranks.
"""

import os
import sys
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


if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # loopback store on one host
    dist.init_process_group("gloo", timeout=timedelta(seconds=60), rank=rank, world_size=world,
                            store=runtime.launch._worker_store(rank, world, timedelta(seconds=60)))
    for folder, *flags in jobs_of(sys.argv[1:]):
        runtime.launch.main(folder, argv=flags)
    dist.destroy_process_group()
