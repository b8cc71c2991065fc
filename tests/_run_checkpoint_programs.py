"""torchrun entry for checkpoint tests: several program folders, each with its own train.py flags,
one after another in the same workers (saves the seconds each worker spends importing
torch.distributed.pipelining)::

    torchrun --nproc-per-node N tests/_run_checkpoint_programs.py FOLDER [FLAGS...] -- FOLDER [FLAGS...]
"""

import sys
from datetime import timedelta

import torch.distributed as dist

import runtime.launch

jobs, current = [], []
for arg in sys.argv[1:] + ["--"]:
    if arg == "--":
        if current:
            jobs.append(current)
        current = []
    else:
        current.append(arg)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
for folder, *flags in jobs:
    runtime.launch.main(folder, argv=flags)
dist.destroy_process_group()
