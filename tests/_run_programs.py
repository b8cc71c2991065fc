"""torchrun entry for tests: trains several program folders one after another in the same workers,
which saves the seconds every worker spends importing torch.distributed.pipelining. The default
process group is created here, so runtime.launch.main reuses it (and leaves it alone)."""

import sys
from datetime import timedelta

import torch.distributed as dist

import runtime.launch

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
for folder in sys.argv[1:]:
    runtime.launch.main(folder)
dist.destroy_process_group()
