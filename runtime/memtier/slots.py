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

ROOT is --memory-dir, default /dev/shm/partitioner-<sha256(checkpoint dir, plan hash)[:12]>, so a
restarted worker of the same job finds it and another job or plan does not. A commit record is
{"format", "kind", "step", "bytes", "sha256", "plan_hash", ...}: sha256 of the slot's bytes, the
same check the disk tier makes of a shard. A slot is whole or absent: its record is removed before
its data is overwritten and written (tmp + rename) only after the data is complete and hashed; the
two slots alternate (a new snapshot goes over the older one), so the newest committed snapshot is
never the one being written. A job that finishes cleanly removes its memory tier.

An own slot holds the shard in the disk format (runtime.checkpoint: ``state_entries`` says what,
``ShardLayout`` where), so it is read back by the disk tier's reader.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import threading
import time

import torch

from runtime.checkpoint.shard import ShardLayout
from runtime.checkpoint.state import state_entries
from runtime.memtier.groups import Redundancy

FORMAT = "partitioner-memtier/1"


def default_root(ckpt_dir: str, plan_hash) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        import tempfile
        base = tempfile.gettempdir()
    key = hashlib.sha256(f"{os.path.abspath(ckpt_dir)}\0{plan_hash}".encode()).hexdigest()[:12]
    return os.path.join(base, f"partitioner-{key}")


def lost_marker(root: str, host: int) -> str:
    """The file that says host ``host`` was lost (fault injection: runtime.faults.host_hook)."""
    return os.path.join(root, f"lost_host_{host}")


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, sort_keys=True)
    os.replace(tmp, path)


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
            with open(self.record_path) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            return None
        if not isinstance(rec, dict) or rec.get("format") != FORMAT or not isinstance(rec.get("step"), int):
            return None
        try:
            if os.path.getsize(self.data_path) < int(rec.get("bytes", -1)):
                return None
        except OSError:
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
            os.makedirs(self.dir, exist_ok=True)
            fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, max(nbytes, 1))
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
        fd = os.open(self.data_path, os.O_RDWR)
        try:
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
        except (OSError, ValueError, KeyError):
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

    def __init__(self, root: str, rank: int, redundancy: Redundancy, plan_hash=None):
        self.root, self.rank, self.red, self.plan_hash = root, rank, redundancy, plan_hash
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
                    if t.numel():
                        views[name].copy_(t)

        return slot, self.layout.total_bytes, copy

    def commit_own(self, slot: Slot, step: int, nbytes: int) -> str:
        sha = slot.sha256(nbytes)
        slot.commit({"kind": "own", "rank": self.rank, "step": step, "bytes": nbytes, "sha256": sha,
                     "plan_hash": self.plan_hash})
        return sha

    # --- reading ----------------------------------------------------------------------------

    def inventory(self) -> dict:
        """Committed steps (records only, nothing hashed): own {step: bytes}, held {step: aux}
        (aux: the copy's bytes, or the parity's chunk length)."""
        own, held = {}, {}
        for s in self.own:
            rec = s.record()
            if rec and rec.get("kind") == "own" and rec.get("plan_hash") == self.plan_hash:
                own[rec["step"]] = int(rec["bytes"])
        for s in self.held:
            rec = s.record()
            if rec is None or rec.get("plan_hash") != self.plan_hash:
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

