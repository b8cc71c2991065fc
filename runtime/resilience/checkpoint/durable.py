"""Durable file operations: a file is written to "<name>.tmp", fsync'd, renamed over its final name,
and its directory fsync'd, so a crash leaves the old file or the new one, never half of one. Every
operation passes a ``runtime.resilience.faults.FaultPoint`` (Note [crash consistency] in
runtime/resilience/checkpoint/manifest.py says in which order the checkpoint's files go)."""

from __future__ import annotations

import hashlib
import os
import queue
import sys
import threading

from runtime.errors import DiskFullError, is_no_space
from runtime.file_trust import UntrustedFile, check_folder, is_real_dir
from runtime.resilience.faults import FaultPoint, armed

CHUNK_BYTES = 1 << 22  # per os.write: large enough that a syscall costs nothing, small enough to hash in step
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str, fault: FaultPoint | None = None) -> None:
    armed(fault).op(f"fsync dir {path}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str, fault: FaultPoint | None = None) -> None:
    """mkdir -p, fsync'ing each parent whose entries changed."""
    path = os.path.abspath(path)
    if is_real_dir(path):
        return
    if os.path.islink(path) and os.path.basename(path).startswith("step_"):
        # a planted link in place of a step folder would be written through (Note [files are not trusted])
        raise UntrustedFile(f"{path} is a symbolic link, not a step folder: refusing to write through it "
                            "(remove it)")
    if os.path.isdir(path):  # a folder above the checkpoint folder reached through a link: the user's
        return
    parent = os.path.dirname(path)
    makedirs_durable(parent, fault)
    armed(fault).op(f"mkdir {path}")
    try:
        os.mkdir(path, 0o700)  # checkpoints hold the model: owner only
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    fsync_dir(parent, fault)


def write_file_atomic(path: str, data: bytes | memoryview, fault: FaultPoint | None = None) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one (tmp, fsync,
    rename, fsync directory)."""
    write_pieces_atomic(path, [data], fault, digest=False)


def write_pieces_atomic(path: str, pieces, fault: FaultPoint | None = None, *,
                        digest: bool = True) -> tuple[int, str | None]:
    """Write the concatenation of ``pieces`` (buffers: bytes, memoryviews of tensors) to ``path``
    like ``write_file_atomic``, straight from the buffers (no joined copy), and hash what was
    written while writing: (bytes written, sha256 hex, or None without ``digest``).

    The sha256 runs in a thread of its own one chunk behind the writes (hashlib and os.write both
    release the GIL), so a persist costs the slower of the two, not their sum."""
    f = armed(fault)
    tmp = path + ".tmp"
    hasher = _Hasher() if digest else None
    f.op(f"open {tmp}")
    fd = create_new(tmp)
    done, total = False, 0
    try:
        for piece in pieces:
            view = memoryview(piece).cast("B")
            offset = 0
            while offset < len(view):
                n = f.allow_bytes(min(CHUNK_BYTES, len(view) - offset))
                written = os.write(fd, view[offset:offset + n]) if n else 0
                if hasher is not None and written:
                    hasher.feed(view[offset:offset + written])
                offset += written
                total += written
                f.wrote(written, f"{os.path.basename(tmp)} at byte {total}")
        f.op(f"fsync {tmp}")
        os.fsync(fd)
        done = True
    except OSError as exc:
        if is_no_space(exc):  # one line naming the folder, not a traceback per rank
            raise DiskFullError(f"No space left on device writing {tmp} ({total} bytes written): free space on the "
                                f"disk of {os.path.dirname(path)}, or pass --checkpoint-dir on a disk with room") from exc
        raise
    finally:
        os.close(fd)
        sha = hasher.finish() if hasher is not None else None
        if not done and sys.exc_info()[0] is not None and issubclass(sys.exc_info()[0], OSError):
            _unlink_quietly(tmp)  # a full disk or an I/O error: no debris (a simulated kill keeps it)
    f.op(f"rename {tmp}")
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path), fault)
    return total, sha


def create_new(tmp: str) -> int:
    """A new owner-only file at ``tmp``: O_EXCL | O_NOFOLLOW, so a planted file or link there is
    never written through (Note [files are not trusted]); a stale one (a crash's, or a planted
    link) is unlinked first: unlinking a link removes the link, never its target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    try:
        return os.open(tmp, flags, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        return os.open(tmp, flags, 0o600)


class _Hasher:
    """sha256 of the chunks fed to it, in order, computed by a thread of its own."""

    def __init__(self):
        self._h = hashlib.sha256()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-sha256")
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._h.update(chunk)

    def feed(self, chunk: memoryview) -> None:
        self._queue.put(chunk)

    def finish(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._h.hexdigest()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_writable(ckpt_dir: str) -> None:
    """Create ``ckpt_dir`` if needed and prove a file can be written, fsync'd and removed there;
    raises ValueError naming the directory and the fix."""
    try:
        os.makedirs(ckpt_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"checkpoint directory {ckpt_dir} is not writable ({exc.strerror or exc}): "
                         "pass --checkpoint-dir with a writable folder") from None
    try:
        check_folder(ckpt_dir, "checkpoint directory", "pass --checkpoint-dir with a folder of your own")
    except UntrustedFile as exc:
        raise ValueError(str(exc)) from None
    try:
        probe = os.path.join(ckpt_dir, f".write_probe_{os.getpid()}")
        with os.fdopen(create_new(probe), "wb") as fh:
            fh.write(b"ok")
            fh.flush()
            os.fsync(fh.fileno())
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"checkpoint directory {ckpt_dir} is not writable ({exc.strerror or exc}): "
                         "pass --checkpoint-dir with a writable folder") from None
