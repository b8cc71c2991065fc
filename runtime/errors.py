"""Errors the runtime raises; partitioner.errors re-exports them (runtime never imports partitioner).

All derive from ValueError (DiskFullError: from OSError): they are the user's to fix (a folder
edited by hand, a bad checkpoint, a full disk), and the CLI prints them as one line and exits
non-zero.
"""

import errno


class PlanMismatchError(ValueError):
    """A program folder, checkpoint or plan that does not belong with the others."""


class CheckpointCorruptError(ValueError):
    """A checkpoint shard is missing, truncated or fails its checksum."""


class FlagError(ValueError):
    """A run flag the table does not know, or a value it refuses: the message names both and the fix
    (Note [one flag table] in runtime/launch/run_options.py). Here, not there, so that the parsers of
    the values (runtime/resilience/faults.py, the --mtbf duration) raise it from their own rooms."""


class InputMismatchError(ValueError):
    """make_batch returned inputs the program was not compiled for (Notes [keyword inputs] and
    [constant inputs] in runtime/data/synthetic.py)."""


class MissingPackageError(ValueError):
    """A package this run needs is not installed, or is older than the runtime supports: one line
    naming the package, what needs it and the pip command (Note [what the runtime needs] in
    runtime/torch_version.py). A ValueError, not an ImportError: the user's to fix, printed as one
    line by the CLI and by each rank; and not corruption: a checkpoint that needs zstandard to be
    read is not skipped as a bad one when zstandard is missing."""


class DiskFullError(OSError):
    """A write ran out of room (ENOSPC, EDQUOT): one line naming the folder and the fix, never a
    traceback (the CLI and each rank print it as it is)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no space left on device"


NO_SPACE_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name))


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that ran out of room (a full disk or quota)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


class CommitRefused(RuntimeError):
    """Rank 0 did not commit a checkpoint because other ranks failed to write their shards (each
    of them says why): a consequence, printed as one line."""


def one_line_error(exc: BaseException) -> "DiskFullError | CommitRefused | None":
    """The DiskFullError or CommitRefused in ``exc`` or in the exceptions it was raised from, if
    any: what a rank prints as its one line instead of a traceback."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, (DiskFullError, CommitRefused)):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None
