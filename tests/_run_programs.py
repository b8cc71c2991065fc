"""torchrun entry for tests: trains several program folders one after another in the same workers,
which saves the seconds every worker spends importing torch.distributed.pipelining. The default
process group is created here, so runtime.launch.main reuses it (and leaves it alone).

    torchrun --nproc-per-node N tests/_run_programs.py [--steps S] FOLDER...
"""

import sys
from datetime import timedelta

import torch.distributed as dist

import runtime.launch

args = sys.argv[1:]
steps = None
if args[:1] == ["--steps"]:
    steps, args = int(args[1]), args[2:]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
for folder in args:
    runtime.launch.main(folder, steps=steps, argv=[])
dist.destroy_process_group()
