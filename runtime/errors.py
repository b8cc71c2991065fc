"""Errors the runtime raises; partitioner.errors re-exports them (runtime never imports partitioner).

All derive from ValueError (DiskFullError: from OSError): they are the user's to fix (a folder
edited by hand, a bad checkpoint, a full disk), and the CLI prints them as one line and exits
non-zero.
"""

import errno
import importlib.metadata
import traceback


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


# Note [the real import error]: a module that fails to import is reported by what wraps it, not
# by what broke. transformers' lazy modules turn any failure importing a model class's module (a
# torchvision wheel built for another torch raising RuntimeError at `import torchvision`, deep in
# transformers.image_utils) into ModuleNotFoundError("Could not import module 'GPT2LMHeadModel'.
# Are this object's requirements defined correctly?") raised from the real one, and the CLI then
# printed a 40-line traceback. The user needs the real error, the module whose top level raised
# it, who imported that module and, for an installed package, what to do: ``import_failure``
# says that in one line, for `partitioner compile` (a MODEL file, a module:function, an hf:
# config) and for the ranks that build an hf: model.


def import_failure(exc: BaseException) -> str:
    """The error at the bottom of ``exc``'s chain in one line, with the module whose import raised
    it, the module that imported that one and, where it is an installed package, the fix (Note
    [the real import error])."""
    root, seen = exc, 0
    while seen < 16:
        below = root.__cause__ or (None if root.__suppress_context__ else root.__context__)
        if below is None:
            break
        root, seen = below, seen + 1
    text = str(root).strip().splitlines()
    line = f"{type(root).__name__}: {text[0]}" if text else type(root).__name__
    tops = [(frame.f_globals.get("__name__", "?"), frame.f_code.co_filename, lineno)
            for frame, lineno in traceback.walk_tb(root.__traceback__) if frame.f_code.co_name == "<module>"]
    if not tops:
        return line
    name, path, lineno = tops[-1]
    line += f", at {path}:{lineno} (importing {name}" + (f", which {tops[-2][0]} imports)" if len(tops) > 1 else ")")
    package = name.partition(".")[0]
    try:  # the distribution that installed it: a package, not a file of the user's
        dist = (importlib.metadata.packages_distributions().get(package) or [None])[0]
        version = importlib.metadata.version(dist) if dist else ""
    except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
        dist, version = None, ""
    if isinstance(root, ModuleNotFoundError) and root.name:
        line += f": install the package that provides {root.name.partition('.')[0]}"
    elif dist:
        line += (f": the installed {dist} {version} does not import: install the {dist} build made for this "
                 f"Python and torch, or pip uninstall {dist}")
    return line
