"""Domain errors raised by the partitioner.

Every error a user can act on derives from :class:`PartitionerError`, so a caller can
catch the whole family with one ``except`` clause.
"""

from __future__ import annotations

__all__ = [
    "PartitionerError",
    "TraceError",
    "PartitionInfeasibleError",
    "PlanMismatchError",
    "CheckpointCorruptError",
    "MissingPackageError",
]


class PartitionerError(Exception):
    """Base class of every error raised by the partitioner."""


class TraceError(PartitionerError):
    """The model could not be captured as a graph (unsupported op, data-dependent control flow...)."""


class PartitionInfeasibleError(PartitionerError, ValueError):
    """No partition of the model fits the cluster's memory under the requested settings.

    ``timed_out``: some candidate was left at the solver's time limit, so this is no proof that
    nothing fits (a caller weighing several searches must not count it as one)."""

    def __init__(self, *args, timed_out: bool = False):
        super().__init__(*args)
        self.timed_out = timed_out


# Raised by generated programs too, so they live in runtime (which never imports partitioner).
# They are ValueErrors rather than PartitionerErrors for that reason.
from runtime.errors import CheckpointCorruptError, MissingPackageError, PlanMismatchError  # noqa: E402
