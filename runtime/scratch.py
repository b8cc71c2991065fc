"""Scratch folders beside an output (`data prepare`'s corpus, `export`'s weights): made and held
while their maker lives, swept by the next maker once abandoned.

Note [abandoned scratch folders]: an output is written into a scratch folder beside it and renamed
into place, so a failure leaves no half-written output; but a process killed (SIGKILL, the OOM
killer, a lost node) runs no cleanup, and its scratch folder, possibly gigabytes, stays beside the
output forever. So the maker holds an exclusive ``flock`` on the folder for as long as it lives (the
kernel drops it when the process dies, however it dies), and the next maker of the same output
removes every folder of the same prefix whose lock it can take: nobody alive holds it. A folder
younger than ``SWEEP_AGE_S`` is left alone (its maker may not have locked it yet), and so is one that
is a link, is not this user's, or sits on a filesystem without flock (no way to tell it is dead).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

SWEEP_AGE_S = 10.0  # far longer than mkdtemp -> flock takes; a killed run's folder is swept by the run after
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def make_scratch(parent: str, prefix: str) -> tuple[str, int]:
    """A new folder ``parent/prefix*`` and the descriptor holding its lock (``release`` it when
    done, after the folder is renamed or removed). OSError as mkdtemp raises it."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    fd = os.open(path, _DIR_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a filesystem without flock: the folder is never swept, as before
        pass
    return path, fd


def release(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def sweep_abandoned(parent: str, prefix: str, *, older_than_s: float = SWEEP_AGE_S) -> list[str]:
    """Remove this user's folders ``parent/prefix*`` that no living process holds (Note [abandoned
    scratch folders]); returns the paths removed."""
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    except OSError:
        return []
    swept = []
    for name in names:
        path = os.path.join(parent, name)
        try:
            fd = os.open(path, _DIR_FLAGS)  # a link or a file is refused here: never followed, never removed
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or time.time() - st.st_mtime < older_than_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by a living maker, or no flock here: cannot tell it is abandoned
                continue
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
        finally:
            os.close(fd)
    return swept
