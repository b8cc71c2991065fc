"""Shared-memory slots: where a rank's memory snapshots live on its host, each slot whole or absent,
and one rank's set of them (``LocalStore``: its own slots and those it holds for its group). No
process group (the unit tests drive it directly).

Note [memory tier layout]: every rank keeps its snapshots in files under a shared-memory folder
that outlives the worker process (tmpfs: /dev/shm), one subfolder per host::

    ROOT/host-<h>/rank_<r>/slot_<k>.bin     rank r's own snapshot (k = 0, 1): a safetensors file in
    ROOT/host-<h>/rank_<r>/slot_<k>.json    the disk shard format, and its commit record
    ROOT/host-<h>/copy_of_rank_<o>/...      (mode copy) rank o's snapshot, held for it on this host
    ROOT/host-<h>/parity_rank_<r>/...       (mode parity) the parity stripe rank r holds for its group
    ROOT/lost_host_<h>                      fault injection: host h was lost (wiped at the restart)

ROOT is a folder the tier creates itself, inside --memory-dir (default /dev/shm, else the temporary
folder): ``partitioner-memtier-u<uid>-<sha256(checkpoint dir, plan hash)[:12]>-<run id>``, so a
restarted worker of the same job finds it and another job or plan does not; only ROOT is ever
removed, never the folder the user named.

Note [memory tier trust]: /dev/shm is shared by every user of the host, so ROOT and every folder in
it are 0700 and checked with lstat (a folder, not a link, owned by this user, no group/other bits:
else the tier refuses, naming the folder), and files are opened with O_NOFOLLOW (O_EXCL where
created), so a planted link is never written through. The run id (``run_id_for``, kept in the
checkpoint directory) is in ROOT's name and every commit record; a record of another run or plan is
ignored. This user's folders whose owner process (the torchrun agent) is gone, or superseded by a
new run id of the same checkpoint directory, are removed at start-up (``clear_stale``).

A commit record ({"format", "kind", "step", "bytes", "sha256", "plan_hash", "run_id", ...}) holds
the sha256 of the slot's bytes, the check the disk tier makes of a shard. A slot is whole or absent:
its record is removed before its data is overwritten and written (tmp + rename) only after the data
is complete and hashed; the two slots alternate, so the newest committed snapshot is never the one
being written. A job that finishes cleanly removes its memory tier. An own slot holds the shard in
the disk format (runtime.resilience.checkpoint's ``state_entries`` and ``ShardLayout``), so the disk
tier's reader reads it back.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import torch

from runtime.resilience.checkpoint.shard import ShardLayout
from runtime.resilience.checkpoint.state import state_entries
from runtime.resilience.memtier.groups import Redundancy
from runtime.resilience.memtier.staging import GpuCopy

FORMAT = "partitioner-memtier/1"


MEMDIR_PREFIX = "partitioner-memtier-"
RUN_ID_FILE = "memory_tier_run_id"  # in the checkpoint directory
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeMemoryDir(RuntimeError):
    """A memory-tier folder that is not this user's private folder (Note [memory tier trust])."""


def default_base() -> str:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _key(ckpt_dir: str, plan_hash) -> str:
    return hashlib.sha256(f"{os.path.abspath(ckpt_dir)}\0{plan_hash}".encode()).hexdigest()[:12]


def default_root(ckpt_dir: str, plan_hash, run_id: str = "0", base: str | None = None) -> str:
    """The tier's own folder inside ``base`` (--memory-dir; default ``default_base()``)."""
    return os.path.join(base or default_base(), f"{MEMDIR_PREFIX}u{os.getuid()}-{_key(ckpt_dir, plan_hash)}-{run_id}")


def secure_dir(path: str) -> str:
    """Create ``path`` (0700) if absent; refuse it unless it is a folder (not a link) owned by this
    user with no group/other permissions (Note [memory tier trust])."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, 0o700, exist_ok=True)  # a --memory-dir that does not exist yet
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeMemoryDir(f"memory tier: {path} is not a folder (a link or file is in its place): refusing "
                              "to use it; remove it or pass another --memory-dir")
    if st.st_uid != os.getuid():
        raise UnsafeMemoryDir(f"memory tier: {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
                              "refusing to use it; remove it or pass another --memory-dir")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeMemoryDir(f"memory tier: {path} has mode {oct(stat.S_IMODE(st.st_mode))}, not 0o700: "
                              "refusing to use it; remove it or pass another --memory-dir")
    return path


def prepare_base(base: str) -> str:
    """The folder the tier's ROOT goes in: created (0700) if absent, never removed by the tier."""
    if not os.path.exists(base):
        os.makedirs(base, mode=0o700, exist_ok=True)
    if not os.path.isdir(base):
        raise UnsafeMemoryDir(f"memory tier: --memory-dir {base} is not a folder")
    return base


def open_private(path: str, flags: int, *, create: bool = False) -> int:
    """os.open with O_NOFOLLOW; the file must be a regular file of this user (else OSError).
    ``create``: O_CREAT | O_EXCL (a new file), falling back to opening an existing one."""
    if create:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
        except FileExistsError:
            fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC)
    else:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise OSError(f"{path}: not a regular file of this user")
    return fd


def run_id_for(ckpt_dir: str) -> str:
    """This run's id, kept in CKPT_DIR/memory_tier_run_id (created on first use): the restarts of
    a job share it; a new (or emptied) checkpoint directory starts a new run (rank 0 calls it and
    broadcasts it)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, RUN_ID_FILE)
    for _ in range(2):
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            new = os.urandom(8).hex()
            tmp = f"{path}.tmp{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(new + "\n")
            os.replace(tmp, path)
            continue
        with os.fdopen(fd) as fh:
            text = fh.read(64).strip()
        if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
            return text
        os.unlink(path)  # unreadable: a new run
    raise RuntimeError(f"memory tier: cannot keep a run id in {path}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_tag() -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname())[:64] or "host"


def mark_owner(root: str) -> None:
    """Record this worker's agent (torchrun's process, alive across restarts) as an owner of ROOT:
    ``owner_<hostname>_<pid>`` (a pid is judged only where the hostname is this one: another
    container sharing /dev/shm has its own pids)."""
    fd = open_private(os.path.join(root, f"owner_{_host_tag()}_{os.getppid()}"), os.O_WRONLY, create=True)
    os.close(fd)


def _newest_mtime(path: str) -> float:
    newest = os.lstat(path).st_mtime
    for d, _, files in os.walk(path):
        for name in [d] + [os.path.join(d, f) for f in files]:
            try:
                newest = max(newest, os.lstat(name).st_mtime)
            except OSError:
                pass
    return newest


def clear_stale(base: str, root: str, *, quiet_s: float = 600.0) -> list[str]:
    """Remove this user's memory-tier folders in ``base`` other than ``root`` that are stale: of the
    same checkpoint directory and plan but another run id (superseded: that directory started
    over), or whose recorded owners on this host (agent pids) are all gone; a folder with no owner
    this host can judge only once nothing in it changed for ``quiet_s``. Returns what it removed."""
    mine = os.path.basename(root)
    prefix = f"{MEMDIR_PREFIX}u{os.getuid()}-"
    same_key = mine[:len(mine) - mine[::-1].index("-")]  # up to and with the last "-"
    here = f"owner_{_host_tag()}_"
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix) or name == mine:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            entries = os.listdir(path)
            owners = [n for n in entries if n.startswith("owner_")]
            local = [int(n[len(here):]) for n in owners if n.startswith(here) and n[len(here):].isdigit()]
            if name.startswith(same_key):
                stale = True
            elif local and len(local) == len(owners):
                stale = not any(_pid_alive(p) for p in local)
            else:
                stale = time.time() - _newest_mtime(path) > quiet_s
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def used_bytes(root: str) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def host_need(own_bytes: list[int], hosts: list[int], mode: str, host: int) -> int:
    """Bytes host ``host`` needs: two slots of each of its ranks' shards, and as much again held
    for peers (a copy, or parity no larger than a shard) unless the mode is none."""
    mine = sum(b for b, h in zip(own_bytes, hosts) if h == host)
    return 2 * mine * (1 if mode == "none" else 2)


def lost_marker(root: str, host: int) -> str:
    """The file that says host ``host`` was lost (fault injection: runtime.resilience.faults.host_hook)."""
    return os.path.join(root, f"lost_host_{host}")


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, sort_keys=True)
    os.replace(tmp, path)


def _is_sha(x) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def valid_record(rec) -> bool:
    """A commit record well formed enough to act on (a malformed one counts as absent)."""
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        return False
    if not (_is_count(rec.get("step")) and _is_count(rec.get("bytes")) and _is_sha(rec.get("sha256"))):
        return False
    kind = rec.get("kind")
    if kind in ("own", "copy"):
        return True
    if kind == "parity":
        group, members = rec.get("group", []), rec.get("members", [])
        return (_is_count(rec.get("chunk_bytes")) and isinstance(group, list) and all(_is_count(m) for m in group)
                and isinstance(members, list)
                and all(isinstance(m, dict) and _is_count(m.get("rank")) and _is_count(m.get("bytes"))
                        and _is_sha(m.get("sha256")) for m in members))
    return False


class Slot:
    """One whole-or-absent buffer: DIR/NAME.bin (preallocated, memory-mapped) and DIR/NAME.json,
    its commit record."""

    def __init__(self, directory: str, name: str):
        self.dir = directory
        self.data_path = os.path.join(directory, name + ".bin")
        self.record_path = os.path.join(directory, name + ".json")
        self._map: mmap.mmap | None = None
        self._size = -1
        self.tensor: torch.Tensor | None = None  # uint8 view of the whole mapping (for writing)

    def record(self) -> dict | None:
        try:
            with os.fdopen(open_private(self.record_path, os.O_RDONLY)) as fh:
                rec = json.loads(fh.read(1 << 20))
        except (OSError, ValueError):
            return None
        if not valid_record(rec):
            return None
        try:
            st = os.lstat(self.data_path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size < rec["bytes"]:
            return None
        return rec

    def invalidate(self) -> None:
        try:
            os.unlink(self.record_path)
        except FileNotFoundError:
            pass

    def commit(self, record: dict) -> None:
        _write_json_atomic(self.record_path, {"format": FORMAT, **record})

    def writable(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over the slot's shared memory, ``nbytes`` long (resized if needed)."""
        if self._size != nbytes:
            secure_dir(os.path.dirname(self.dir))
            secure_dir(self.dir)
            fd = open_private(self.data_path, os.O_RDWR, create=True)
            try:
                os.ftruncate(fd, max(nbytes, 1))
                if hasattr(os, "posix_fallocate"):  # a full tmpfs: ENOSPC here, not SIGBUS in a copy
                    os.posix_fallocate(fd, 0, max(nbytes, 1))
                # populated now (pages allocated and mapped), not page by page during a snapshot
                self._map = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            self._size = nbytes
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
        return self.tensor

    def read(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the data file, mapped (no copy; the caller only reads it: it is
        writable only because torch.frombuffer wants a writable buffer)."""
        fd = open_private(self.data_path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise OSError(f"{self.data_path}: shorter than its record")
            m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return memoryview(m)[:nbytes]

    def sha256(self, nbytes: int) -> str:
        """sha256 of the first ``nbytes`` of what ``writable`` mapped (a commit hashes what it wrote)."""
        return hashlib.sha256(memoryview(self._map)[:nbytes]).hexdigest()

    def verify(self, rec: dict) -> memoryview | None:
        """The slot's bytes when they match ``rec``'s sha256, else None."""
        try:
            data = self.read(int(rec["bytes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return data if hashlib.sha256(data).hexdigest() == rec.get("sha256") else None


def pick_slot(slots: list[Slot]) -> Slot:
    """The slot a new snapshot goes into: an empty one, else the one with the older step."""
    return min(slots, key=lambda s: (s.record() or {"step": -1})["step"])


def find_slot(slots: list[Slot], step: int) -> tuple[Slot, dict] | None:
    for s in slots:
        rec = s.record()
        if rec is not None and rec["step"] == step:
            return s, rec
    return None



class LocalStore:
    """One rank's part of the memory tier on its host: its own slots and the slots it holds for
    others. No process group (the unit tests drive it directly)."""

    def __init__(self, root: str, rank: int, redundancy: Redundancy, plan_hash=None, run_id=None):
        self.root, self.rank, self.red, self.plan_hash, self.run_id = root, rank, redundancy, plan_hash, run_id
        self.host = redundancy.hosts[rank]
        self.host_dir = os.path.join(root, f"host-{self.host}")
        own_dir = os.path.join(self.host_dir, f"rank_{rank}")
        self.own = [Slot(own_dir, f"slot_{k}") for k in range(2)]
        held_dir = None
        if redundancy.mode == "copy" and redundancy.owner_held_by(rank) is not None:
            held_dir = os.path.join(self.host_dir, f"copy_of_rank_{redundancy.owner_held_by(rank)}")
        elif redundancy.mode == "parity" and redundancy.protected(rank):
            held_dir = os.path.join(self.host_dir, f"parity_rank_{rank}")
        self.held = [Slot(held_dir, f"slot_{k}") for k in range(2)] if held_dir else []
        self.layout: ShardLayout | None = None
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._from_gpu: GpuCopy | None = None  # Note [memory tier copy on a GPU]

    # --- writing ----------------------------------------------------------------------------

    def snapshot(self, trainer) -> tuple[Slot, int, float]:
        """Copy the trainer's state into the older own slot (invalidated first). Returns (slot,
        bytes, seconds). ``commit_own`` hashes and commits it."""
        t0 = time.perf_counter()
        slot, nbytes, copy = self.prepare(trainer)
        copy()
        return slot, nbytes, time.perf_counter() - t0

    def prepare(self, trainer):
        """Everything of a snapshot that must happen at the step boundary: the RNG states and the
        JSON state captured, the older slot invalidated. Returns (slot, bytes, copy), where
        ``copy()`` copies the tensors into the slot; it may run later, in another thread, as long
        as it is done before the optimizer next changes them (Note [memory snapshot])."""
        tensors, meta = state_entries(trainer)
        header = self.layout.header(meta) if self.layout is not None and self.layout.matches(tensors) else None
        if header is None:  # first snapshot, or the state changed shape / outgrew the header
            self.layout = ShardLayout(tensors, 2 * len(json.dumps(meta)) + 4096)
            self._views = {}
            header = self.layout.header(meta)
        slot = pick_slot(self.own)
        slot.invalidate()
        layout = self.layout
        device = next((t.device for _, t in tensors if t.device.type == "cuda"), None)
        ready = None
        if device is not None:  # after everything the step wrote: Note [memory tier copy on a GPU]
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))

        def copy() -> None:
            buf = slot.writable(layout.total_bytes)  # allocated (and populated) on first use
            key = (self.own.index(slot), buf.data_ptr())
            if key not in self._views:  # (re)built when the layout or the mapping changed
                self._views = {k: v for k, v in self._views.items() if k[0] != key[0]}
                self._views[key] = layout.views(buf)
            views = self._views[key]
            buf[:len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            with torch.no_grad():
                for name, t in tensors:
                    if t.numel() and t.device.type != "cuda":
                        views[name].copy_(t)
                if device is not None:
                    self._from_gpu = self._from_gpu or GpuCopy(device)
                    self._from_gpu.copy([(t, views[name]) for name, t in tensors
                                         if t.numel() and t.device.type == "cuda"], ready)

        return slot, self.layout.total_bytes, copy

    def commit_own(self, slot: Slot, step: int, nbytes: int) -> str:
        sha = slot.sha256(nbytes)
        slot.commit({"kind": "own", "rank": self.rank, "step": step, "bytes": nbytes, "sha256": sha,
                     "plan_hash": self.plan_hash, "run_id": self.run_id})
        return sha

    # --- reading ----------------------------------------------------------------------------

    def ours(self, rec: dict | None) -> bool:
        """A record of this plan and this run (Note [memory tier trust])."""
        return rec is not None and rec.get("plan_hash") == self.plan_hash and rec.get("run_id") == self.run_id

    def find(self, slots: list[Slot], step: int) -> tuple[Slot, dict] | None:
        """The slot of ``slots`` holding ``step``, committed by this plan and run."""
        found = find_slot(slots, step)
        return found if found is not None and self.ours(found[1]) else None

    def inventory(self) -> dict:
        """Committed steps (records only, nothing hashed): own {step: bytes}, held {step: aux}
        (aux: the copy's bytes, or the parity's chunk length)."""
        own, held = {}, {}
        for s in self.own:
            rec = s.record()
            if rec and rec.get("kind") == "own" and self.ours(rec) and rec.get("rank") == self.rank:
                own[rec["step"]] = int(rec["bytes"])
        for s in self.held:
            rec = s.record()
            if not self.ours(rec):
                continue
            if rec.get("kind") == "copy" and rec.get("owner") == self.red.owner_held_by(self.rank):
                held[rec["step"]] = int(rec["bytes"])
            elif rec.get("kind") == "parity" and tuple(rec.get("group", ())) == self.red.group_of(self.rank):
                held[rec["step"]] = int(rec["chunk_bytes"])
        return {"own": own, "held": held}

    def invalidate_newer(self, step: int) -> None:
        for s in self.own + self.held:
            rec = s.record()
            if rec is not None and rec["step"] > step:
                s.invalidate()

    def remove(self) -> None:
        for slots in (self.own, self.held):
            if slots:
                shutil.rmtree(slots[0].dir, ignore_errors=True)

