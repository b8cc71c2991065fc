"""Drivers the tests and benchmarks run; never part of a program.

run_many.py         torchrun entry training several folders in the same workers (``RUN_MANY``)
checkpoint_drills.py one-process drills of the checkpoint protocol
"""

RUN_MANY = "-m tests.drivers.run_many"  # the torchrun entry: several folders in the same workers
