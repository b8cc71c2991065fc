"""Errors the runtime raises; partitioner.errors re-exports them (runtime never imports partitioner).

All derive from ValueError: they are the user's to fix (a folder edited by hand, a bad
checkpoint), and the CLI prints them as one line and exits non-zero.
"""


class PlanMismatchError(ValueError):
    """A program folder, checkpoint or plan that does not belong with the others."""


class CheckpointCorruptError(ValueError):
    """A checkpoint shard is missing, truncated or fails its checksum."""


class InputMismatchError(ValueError):
    """make_batch returned inputs the program was not compiled for (Notes [keyword inputs] and
    [constant inputs] in runtime/data/synthetic.py)."""
