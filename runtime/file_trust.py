"""Reading and writing files in folders someone else may have prepared: the one place that opens
them without following links, refuses what is not a regular file, and bounds what it reads.

Note [files are not trusted]: a checkpoint folder, a program folder or a Hugging Face folder may
hold a planted link, a FIFO, a device or a file far larger than any real one. A FIFO blocks a plain
open() forever, /dev/zero reads until memory runs out, a link written through overwrites a file
elsewhere. So every read of such a file goes through ``open_regular``: O_NOFOLLOW (a link in the
last component is refused, never followed), O_NONBLOCK (a FIFO opens at once instead of waiting for
a writer), then fstat on the open descriptor (no race with a swap after a check): a regular file
only, and no larger than the cap its kind allows (``read_bounded``; JSON_CAP for manifests, plan.json
and other JSON, far above any real one). A folder is trusted only when ``check_folder`` passes: this
user's, and not writable by everyone unless sticky (the rule /tmp lives by), so nobody else can plant a
link in it. Every refusal is an ``UntrustedFile``: one line naming the file and what to do, an
OSError, so the callers' existing "unreadable" paths take it.
"""

from __future__ import annotations

import os
import stat

JSON_CAP = 64 << 20  # bytes: a manifest or plan.json is kilobytes; a million-parameter model's is a few MiB
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UntrustedFile(OSError):
    """A file or folder refused by Note [files are not trusted] (a one-line message)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "untrusted file"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, *, follow: bool = False, cap: int | None = None) -> int:
    """A read-only descriptor of ``path``, a regular file (of at most ``cap`` bytes). ``follow``:
    a link in the last component is followed (a user's own file named on the command line); the
    type and size are checked on what was opened either way."""
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise UntrustedFile(f"{path} is a symbolic link: refusing to follow it (remove the link, "
                                "put the real file there)") from None
        raise exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile(f"{path} is {_kind(st.st_mode)}, not a regular file: refusing to read it "
                                "(remove it, put the real file there)")
        if cap is not None and st.st_size > cap:
            raise UntrustedFile(f"{path} is {st.st_size} bytes, more than the {cap >> 20} MiB a file of its kind "
                                "can be: refusing to read it (is it the right file?)")
        if _NONBLOCK:
            os.set_blocking(fd, True)  # a regular file: O_NONBLOCK only kept a FIFO from hanging the open
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str, *, cap: int = JSON_CAP, follow: bool = False) -> bytes:
    """The bytes of regular file ``path`` (``open_regular``), at most ``cap`` of them (a file that
    grows past it while read is refused too)."""
    fd = open_regular(path, follow=follow, cap=cap)
    with os.fdopen(fd, "rb") as fh:
        # read(n) allocates n bytes before it reads: the file's size (one more, to see it grow),
        # not the cap, or every 2 KiB manifest read allocated 64 MiB
        size = os.fstat(fd).st_size  # at most the cap: open_regular checked
        data = fh.read(size + 1)
        if len(data) > size:  # it grew while read: the rest, up to one byte past the cap
            data += fh.read(cap + 1 - len(data))
    if len(data) > cap:
        raise UntrustedFile(f"{path} grew past {cap >> 20} MiB while read: refusing it")
    return data


def check_folder(path: str, what: str, fix: str) -> None:
    """Refuse a folder someone else could plant files in: owned by another user, or writable by
    everyone without the sticky bit (Note [files are not trusted]). A group-writable one is the
    user's choice of collaborators, and is accepted."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise UntrustedFile(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
                            f"refusing to use it; {fix}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise UntrustedFile(f"{what} {path} has mode {oct(mode)}: others can write in it (and plant links): "
                            f"refusing to use it; chmod go-w {path} or {fix}")


def lexists_as_link(path: str) -> bool:
    """Whether ``path`` itself is a symbolic link (not followed)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_dir(path: str) -> bool:
    """A folder, and not a link to one (lstat)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
