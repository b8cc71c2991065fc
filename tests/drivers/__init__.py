"""Drivers the tests and benchmarks run; never part of a program.

run_many.py         torchrun entry training several folders in the same workers (``RUN_MANY``)
checkpoint_drills.py one-process drills of the checkpoint protocol
cluster_image/      a sitecustomize.py: put first on PYTHONPATH, the process can import only what a GPU
                    cluster's image has (tests/e2e/test_runtime_needs.py)
"""

import os

# The torchrun entry that trains several folders in the same workers, by path: it imports only
# runtime (installed), so the workers need no repository root on their path.
RUN_MANY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_many.py")
