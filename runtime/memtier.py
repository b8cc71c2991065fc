"""The memory tier: in-memory checkpoints in host shared memory, with peer redundancy across hosts
(a full copy or XOR parity), recovered from the fastest tier that survived. The disk tier
(runtime.checkpoint, runtime.recovery) keeps running at its own, slower interval underneath.

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

Note [memory snapshot]: the layout of a rank's shard (tensor names, shapes, dtypes, the offsets of
a safetensors file with a header padded to a fixed capacity) is fixed at the first snapshot, so a
snapshot is one copy of each state tensor into the preallocated shared-memory file. At the step
boundary only the RNG states, the mutable buffers (the forward changes them) and the JSON state
are captured (``ck.state_entries``); the copy runs in a background thread while the next step's
forward and backward run (they only read the parameters), and the optimizer waits for it in a step pre-hook before it changes anything (CheckFreq's pipelined snapshot). Then,
in the same thread, the sha256, the commit record and the redundancy exchange. The next snapshot
first joins the previous background work. The stall (recorded per snapshot in
RUN_DIR/memory_stats_rank_<r>.jsonl) is the boundary work plus any wait, at the boundary or
before the optimizer step.

Note [redundancy]: ranks are grouped one per host (``plan_redundancy``: hosts in groups of g, the
i-th rank of each host by (stages, replica), so group members hold the same stage and equal-sized
shards where the layout allows). Mode copy: each member sends its shard to the next member of the
group (a ring), which holds it; memory per rank: one shard. Mode parity (RAID-5 style): member i's
shard is cut into g - 1 chunks of C bytes, one for each other member k; member k holds the XOR of
the chunks addressed to it; memory per rank: C = shard / (g - 1). Losing one member of a group is
repaired by XOR of the others' chunks and the parity; losing two is not (disk). The exchange runs
on a gloo group of its own (created at start-up with the collective timeout): an all-gather of
(step, bytes, sha256) of every rank, then point-to-point sends; the received copy or parity is
hashed and committed like an own slot, with the sha256 of every shard it covers.

Note [memory recovery]: each rank lists the committed slots of its host folder (records only, no
hashing yet) and the newest committed disk manifest; all-gather. Every rank then computes the same
choice: the newest step s for which every rank r has a tier, in order own memory, then the peer
copy (mode copy) or a reconstruction from parity (every other member of r's group holds own slot s
and parity s), and no older than the newest disk checkpoint. The ranks verify what they use
(sha256 of the own slot, of the received copy, of the reconstruction, of the parity), all-reduce
the failures, and on any failure exclude that (rank, step, tier) and choose again; no rank restores
before every rank has verified. With no such step the disk tier recovers (runtime.recovery). Slots
newer than the resumed step are then invalidated. Every rank logs "recovered step N from tier=T in
X ms" and appends it to RUN_DIR/recovery.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from runtime import checkpoint as ck

FORMAT = "partitioner-memtier/1"
HOSTS_ENV = "PARTITIONER_HOSTS"
MODES = ("none", "copy", "parity")
TIERS = ("memory", "peer", "parity", "disk")
DEFAULT_PARITY_GROUP = 4
_MAX_ROUNDS = 6


def _say(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Hosts and redundancy groups (Note [redundancy])


def parse_hosts(text: str, world: int) -> tuple[int, ...]:
    """"0,0,1,1" -> host of each rank."""
    try:
        hosts = tuple(int(x) for x in str(text).replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"hosts {text!r}: write one host number per rank, e.g. 0,0,1,1") from None
    if len(hosts) != world or min(hosts) < 0:
        raise ValueError(f"hosts {text!r} names {len(hosts)} ranks, the program has {world}: "
                         "write one host number (>= 0) per rank, e.g. " + ",".join(str(r // 2) for r in range(world)))
    return hosts


def hosts_of_ranks(world: int, flag: str | None = None) -> tuple[int, ...]:
    """Which host each rank sits on: --hosts, else $PARTITIONER_HOSTS, else torchrun's layout
    (ranks are placed LOCAL_WORLD_SIZE to a node, in order)."""
    text = flag or os.environ.get(HOSTS_ENV)
    if text:
        return parse_hosts(text, world)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world) or world))
    return tuple(r // local for r in range(world))


@dataclass(frozen=True)
class Redundancy:
    mode: str                               # "none", "copy" or "parity"
    hosts: tuple[int, ...]                  # rank -> host
    groups: tuple[tuple[int, ...], ...]     # ranks, one per host (a group of one is unprotected)

    def group_of(self, rank: int) -> tuple[int, ...]:
        return next((g for g in self.groups if rank in g), (rank,))

    def holder_of(self, rank: int) -> int | None:
        """Mode copy: the rank that holds ``rank``'s copy (the next member of its ring)."""
        g = self.group_of(rank)
        if self.mode != "copy" or len(g) < 2:
            return None
        return g[(g.index(rank) + 1) % len(g)]

    def owner_held_by(self, rank: int) -> int | None:
        """Mode copy: whose copy ``rank`` holds (the previous member of its ring)."""
        g = self.group_of(rank)
        if self.mode != "copy" or len(g) < 2:
            return None
        return g[(g.index(rank) - 1) % len(g)]

    def protected(self, rank: int) -> bool:
        return self.mode != "none" and len(self.group_of(rank)) >= 2

    def to_dict(self) -> dict:
        return {"mode": self.mode, "hosts": list(self.hosts), "groups": [list(g) for g in self.groups],
                "group_size": max((len(g) for g in self.groups), default=1)}


def plan_redundancy(hosts, rank_keys=None, *, mode: str = "auto", group_size: int | None = None) -> Redundancy:
    """Group the ranks one per host (Note [redundancy]). ``rank_keys[r]`` orders a host's ranks
    (the plan passes (stages, replica)), so that the i-th rank of every host holds the same stage.
    mode "auto": none on one host, copy on two, parity over groups of ``group_size`` (default
    min(hosts, 4)) hosts on three or more."""
    hosts = tuple(int(h) for h in hosts)
    world = len(hosts)
    keys = list(rank_keys) if rank_keys is not None else [()] * world
    distinct = sorted(set(hosts))
    if mode not in ("auto",) + MODES:
        raise ValueError(f"memory tier mode {mode!r} is not one of auto, none, copy, parity")
    if mode == "auto":
        mode = "none" if len(distinct) == 1 else "copy" if len(distinct) == 2 else "parity"
    if mode == "none" or len(distinct) == 1:
        return Redundancy("none" if len(distinct) == 1 else mode, hosts, tuple((r,) for r in range(world)))
    if mode == "copy":
        host_groups = [distinct]
    else:
        g = max(2, min(len(distinct), int(group_size or DEFAULT_PARITY_GROUP)))
        host_groups = [distinct[i:i + g] for i in range(0, len(distinct), g)]
        if len(host_groups) > 1 and len(host_groups[-1]) == 1:  # a lone host joins the previous group
            lone = host_groups.pop()
            host_groups[-1] = host_groups[-1] + lone
    ranks_of = {h: sorted((r for r in range(world) if hosts[r] == h), key=lambda r: (tuple(keys[r]), r))
                for h in distinct}
    groups = []
    for hg in host_groups:
        for i in range(max(len(ranks_of[h]) for h in hg)):
            groups.append(tuple(ranks_of[h][i] for h in hg if i < len(ranks_of[h])))
    return Redundancy(mode, hosts, tuple(sorted(groups)))


def chunk_bytes(sizes: list[int]) -> int:
    """Parity chunk length C for a group with shards of ``sizes`` bytes: ceil(max / (g - 1)),
    rounded up to 8 bytes (the XOR runs on int64)."""
    g = len(sizes)
    c = -(-max(sizes) // max(1, g - 1))
    return -(-c // 8) * 8


def memory_cost(red: Redundancy, shard_bytes: list[int], *, slots: int = 2) -> dict:
    """Host memory the tier takes, per rank and per host, for shards of ``shard_bytes``:
    own snapshots plus what it holds for the others (a copy or a parity stripe), each kept in
    ``slots`` alternating slots."""
    own = [slots * b for b in shard_bytes]
    held = [0] * len(shard_bytes)
    for g in red.groups:
        if len(g) < 2 or red.mode == "none":
            continue
        if red.mode == "copy":
            for r in g:
                held[r] = slots * shard_bytes[red.owner_held_by(r)]
        else:
            c = chunk_bytes([shard_bytes[r] for r in g])
            for r in g:
                held[r] = slots * c
    per_host: dict[int, int] = {}
    for r, h in enumerate(red.hosts):
        per_host[h] = per_host.get(h, 0) + own[r] + held[r]
    return {"own_bytes": own, "redundancy_bytes": held, "per_host_bytes": [per_host[h] for h in sorted(per_host)],
            "redundancy_over_shard": [held[r] / (slots * shard_bytes[r]) if shard_bytes[r] else 0.0
                                      for r in range(len(shard_bytes))]}


# ---------------------------------------------------------------------------------------------
# Parity arithmetic (pure; the distributed exchange and the unit tests both use it)


def other_members(g: int, i: int) -> list[int]:
    return [k for k in range(g) if k != i]


def chunk_for(shard: torch.Tensor, i: int, k: int, c: int) -> torch.Tensor:
    """Member i's chunk addressed to member k (C bytes, zero-padded past the shard's end)."""
    idx = k if k < i else k - 1
    lo, hi = idx * c, min((idx + 1) * c, shard.numel())
    if hi - lo == c:
        return shard[lo:hi]
    out = torch.zeros(c, dtype=torch.uint8)
    if hi > lo:
        out[:hi - lo] = shard[lo:hi]
    return out


def xor_all(buffers: list[torch.Tensor]) -> torch.Tensor:
    """XOR of equal-length uint8 buffers (length a multiple of 8), as a new uint8 tensor."""
    acc = buffers[0].clone()
    view = acc.view(torch.int64)
    for b in buffers[1:]:
        view.bitwise_xor_(b.contiguous().view(torch.int64))
    return acc


def encode_parity(shards: list[bytes]) -> tuple[int, list[bytes]]:
    """(C, stripe held by each member) for one group's shards."""
    tensors = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in shards]
    c = chunk_bytes([len(s) for s in shards])
    g = len(shards)
    return c, [bytes(xor_all([chunk_for(tensors[i], i, k, c) for i in other_members(g, k)]).numpy())
               for k in range(g)]


def survivor_piece(shard: torch.Tensor, parity: torch.Tensor, i: int, lost: int, g: int, c: int) -> torch.Tensor:
    """What survivor i sends to rebuild member ``lost``: for every k != lost in order, its parity
    when k == i, else its own chunk addressed to k."""
    return torch.cat([parity if k == i else chunk_for(shard, i, k, c) for k in other_members(g, lost)])


def reconstruct(pieces: list[torch.Tensor], nbytes: int) -> bytearray:
    """Member ``lost``'s shard from every survivor's ``survivor_piece``."""
    return bytearray(xor_all(pieces)[:nbytes].numpy().tobytes())


# ---------------------------------------------------------------------------------------------
# Shared-memory slots (Note [memory tier layout])


def default_root(ckpt_dir: str, plan_hash) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        import tempfile
        base = tempfile.gettempdir()
    key = hashlib.sha256(f"{os.path.abspath(ckpt_dir)}\0{plan_hash}".encode()).hexdigest()[:12]
    return os.path.join(base, f"partitioner-{key}")


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


# ---------------------------------------------------------------------------------------------
# The shard layout and the snapshot (Note [memory snapshot])

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def state_tensors(trainer) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """What runtime.checkpoint.snapshot copies (same names, same meta): parameters and Adam state
    not yet copied, mutable buffers and RNG states already copied (``ck.state_entries``)."""
    return ck.state_entries(trainer)


class ShardLayout:
    """Byte offsets of every tensor in a safetensors file whose header is padded to a fixed
    capacity: the same tensors always land at the same place, so a snapshot is a copy into a
    preallocated buffer. Tensors are ordered by element size, largest first (every offset stays
    aligned to its element size); the header is padded with spaces (valid JSON whitespace)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], meta_capacity: int):
        self.signature = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
        order = sorted(self.signature, key=lambda e: (-torch.empty((), dtype=e[2]).element_size(), e[0]))
        entries, offset = {}, 0
        self.offsets: dict[str, tuple[int, int]] = {}
        for name, shape, dtype in order:
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            entries[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.offsets[name] = (offset, nbytes)
            offset += nbytes
        self.data_bytes = offset
        self._tensor_json = json.dumps(entries, separators=(",", ":"))
        need = len(self._tensor_json) + meta_capacity + 64
        self.header_len = -(-(8 + need) // 64) * 64 - 8  # data starts 64-byte aligned
        self.total_bytes = 8 + self.header_len + self.data_bytes

    def matches(self, tensors: list[tuple[str, torch.Tensor]]) -> bool:
        return len(tensors) == len(self.signature) and all(
            (n, tuple(t.shape), t.dtype) == s for (n, t), s in zip(tensors, self.signature))

    def header(self, meta: dict) -> bytes | None:
        """The 8-byte length and the padded JSON header; None when ``meta`` outgrew the capacity."""
        meta_text = json.dumps({"meta": json.dumps(meta, sort_keys=True)}, separators=(",", ":"))
        text = '{"__metadata__":' + meta_text + "," + self._tensor_json[1:]
        raw = text.encode()
        if len(raw) > self.header_len:
            return None
        return self.header_len.to_bytes(8, "little") + raw + b" " * (self.header_len - len(raw))

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        start = 8 + self.header_len
        out = {}
        for name, shape, dtype in self.signature:
            off, nbytes = self.offsets[name]
            out[name] = buf[start + off:start + off + nbytes].view(dtype).view(shape)
        return out


_ST_BY_NAME = {v: k for k, v in _ST_DTYPES.items()}


def parse_shard(data) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of a safetensors shard held in a writable buffer, without copying: the
    tensors are views of ``data`` (restore copies them into the trainer). JSON only, never pickle;
    offsets are checked like safetensors does (contiguous, inside the buffer, sizes match)."""
    view = memoryview(data).cast("B")
    header_len = int.from_bytes(view[:8], "little")
    if not 0 < header_len <= len(view) - 8:
        raise ValueError(f"header length {header_len} does not fit {len(view)} bytes")
    header = json.loads(bytes(view[8:8 + header_len]))
    meta = json.loads(header.pop("__metadata__")["meta"])
    start, end = 8 + header_len, 0
    raw = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.zeros(0, dtype=torch.uint8)
    tensors = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        lo, hi = info["data_offsets"]
        dtype = _ST_BY_NAME[info["dtype"]]
        shape = [int(x) for x in info["shape"]]
        if lo != end or hi < lo or start + hi > len(view) or (hi - lo) != torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"tensor {name!r} has offsets {lo}..{hi} after {end}")
        end = hi
        piece = raw[start + lo:start + hi]
        if (start + lo) % piece.element_size() == 0 and piece.numel():
            tensors[name] = piece.view(dtype).view(shape)
        elif not piece.numel():
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:  # not aligned to its element size: a copy
            tensors[name] = torch.frombuffer(bytearray(piece.numpy().tobytes()), dtype=dtype).view(shape)
    if start + end != len(view):
        raise ValueError(f"the tensors end at byte {start + end}, the buffer has {len(view)}")
    return tensors, meta


def loaded_from_bytes(data, *, step: int, program: dict, rank: int, needed: list[str],
                      where: str) -> ck.LoadedCheckpoint:
    """A verified own shard (memory tier bytes) as runtime.checkpoint's LoadedCheckpoint."""
    try:
        tensors, meta = parse_shard(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure is corruption
        raise ck.CheckpointCorruptError(f"{where} does not parse ({exc})") from None
    if meta.get("step") != step or meta.get("rank") != rank or meta.get("plan_hash") != program.get("plan_hash"):
        raise ck.CheckpointCorruptError(f"{where} is step {meta.get('step')} of rank {meta.get('rank')} "
                                        f"(plan {meta.get('plan_hash')}), wanted step {step} of rank {rank}")
    rng = {k: v.clone() for k, v in tensors.items() if k.startswith("rng/")}  # set_rng_state wants its own
    manifest = {"step": step, "plan_hash": program.get("plan_hash"), "world_size": program["world_size"],
                "num_stages": program["num_stages"], "dp": program["dp"]}
    loaded = ck.LoadedCheckpoint(step, manifest, {}, {}, {}, meta.get("lr_scheduler") or {}, rng, meta)
    for name in needed:
        ck.take_state(loaded, name, tensors, meta, where)
    return loaded


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
        tensors, meta = state_tensors(trainer)
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
        sha = hashlib.sha256(memoryview(slot._map)[:nbytes]).hexdigest()
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


# ---------------------------------------------------------------------------------------------
# The recovery choice (Note [memory recovery]); pure


def choose_step(own: list[dict], held: list[dict], red: Redundancy, excluded: set, *,
                not_before: int = -1) -> tuple[int, dict[int, str]] | None:
    """The newest step every rank can restore from memory (own slot, else peer copy, else parity),
    skipping (rank, step, tier) in ``excluded``; (step, {rank: tier}) or None."""
    world = len(own)
    steps = sorted({s for o in own for s in o}, reverse=True)
    for s in steps:
        if s < not_before:
            break
        tiers: dict[int, str] = {}
        for r in range(world):
            if s in own[r] and (r, s, "memory") not in excluded:
                tiers[r] = "memory"
                continue
            if red.mode == "copy":
                h = red.holder_of(r)
                if h is not None and s in held[h] and (r, s, "peer") not in excluded:
                    tiers[r] = "peer"
                    continue
            if red.mode == "parity" and red.protected(r) and (r, s, "parity") not in excluded:
                others = [m for m in red.group_of(r) if m != r]
                if all(s in own[m] and s in held[m] and (m, s, "memory") not in excluded for m in others) \
                        and len({held[m][s] for m in others}) == 1:
                    tiers[r] = "parity"
                    continue
            break
        else:
            return s, tiers
    return None


def why_not(own: list[dict], held: list[dict], red: Redundancy, newest: int | None) -> str:
    """Why no memory step was chosen, for the log line."""
    if not any(own) and not any(held):
        return "no committed memory snapshot on any host"
    if newest is None:
        return "no step every rank can restore from memory"
    lost = [r for r in range(len(own)) if newest not in own[r]]
    parts = []
    for r in lost:
        if red.mode == "copy":
            h = red.holder_of(r)
            parts.append(f"rank {r}: no own snapshot of step {newest}, "
                         + (f"no peer copy on rank {h}" if h is not None else "no peer (one host)"))
        elif red.mode == "parity" and red.protected(r):
            g = red.group_of(r)
            missing = [m for m in g if newest not in own[m]]
            parts.append(f"rank {r}: parity group {list(g)} lost {len(missing)} members ({missing}) at step {newest}"
                         if len(missing) > 1 else f"rank {r}: parity of step {newest} incomplete")
        else:
            parts.append(f"rank {r}: no own snapshot of step {newest} and no redundancy")
    return f"no step every rank can restore from memory ({'; '.join(parts) or 'slots failed verification'})"


# ---------------------------------------------------------------------------------------------
# Settings, fault injection


@dataclass(frozen=True)
class Settings:
    mode: str                  # "auto", "none", "copy", "parity"
    every: int = 1
    group_size: int | None = None
    hosts: str | None = None   # --hosts
    root: str | None = None    # --memory-dir
    fail_hosts: tuple[tuple[int, int, int], ...] = ()  # (host, step, attempt)


def settings_from(program: dict, flags: dict) -> Settings | None:
    """The memory tier's settings from the program (the plan's choice) and the flags; None when
    it is off (neither asks for it, or --memory-tier off)."""
    plan = program.get("memory_tier") or {}
    mode = flags.get("memory_tier") or plan.get("mode")
    if mode is None or mode == "off":
        return None
    if mode not in ("auto",) + MODES:
        raise ValueError(f"--memory-tier {mode!r}: write off, auto, none, copy or parity")
    every = flags.get("memory_every", plan.get("every", 1))
    if every < 1:
        raise ValueError(f"--memory-every {every}: must be a positive number of steps")
    group = flags.get("parity_group", plan.get("group_size"))
    if group is not None and group < 2:
        raise ValueError(f"--parity-group {group}: a parity group needs at least 2 hosts")
    fails = []
    for text in flags.get("fail_host", []):
        try:
            parts = [int(x) for x in text.split(":")]
            if len(parts) not in (2, 3):
                raise ValueError
        except ValueError:
            raise ValueError(f"--fail-host {text!r}: write HOST:STEP[:ATTEMPT], e.g. 1:3") from None
        fails.append((parts[0], parts[1], parts[2] if len(parts) == 3 else 0))
    return Settings(mode, every, group, flags.get("hosts"), flags.get("memory_dir"), tuple(fails))


# ---------------------------------------------------------------------------------------------
# The distributed memory tier


@dataclass
class RecoveryResult:
    step: int
    tier: str                   # this rank's tier
    tiers: dict[int, str]
    seconds: float
    rounds: int
    failures: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)  # milliseconds per phase (what the time went to)


class MemoryTier:
    """Memory snapshots every ``every`` steps (``after_step``), the background redundancy
    exchange, recovery (``recover``) and clean-up (``finish``). Create it on every rank in the same
    order as the other groups (it creates a gloo group)."""

    def __init__(self, trainer, settings: Settings, *, ckpt_dir: str, timeout=None, run_dir: str | None = None):
        import torch.distributed as dist

        self.trainer, self.settings, self.run_dir = trainer, settings, run_dir
        program = trainer.program
        self.rank, self.world = trainer.rank, dist.get_world_size()
        self.timeout = timeout
        hosts = hosts_of_ranks(self.world, settings.hosts)
        keys = [(tuple(sorted(e["stages"])), e["replica"]) for e in sorted(program["ranks"], key=lambda e: e["rank"])]
        self.red = plan_redundancy(hosts, keys, mode=settings.mode, group_size=settings.group_size)
        self.every = settings.every
        self.root = settings.root or default_root(ckpt_dir, program.get("plan_hash"))
        self.store = LocalStore(self.root, self.rank, self.red, program.get("plan_hash"))
        self.group = dist.new_group(list(range(self.world)), timeout=timeout, backend="gloo")
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stats: list[dict] = []
        self._copied: threading.Event | None = None
        self._stat: dict = {}
        trainer.optimizer.register_step_pre_hook(self._before_optimizer_step)
        self.recovery: RecoveryResult | None = None
        marker = os.path.join(self.root, f"lost_host_{self.red.hosts[self.rank]}")
        if os.path.exists(marker):  # fault injection: this host was lost; its memory goes with it
            shutil.rmtree(self.store.host_dir, ignore_errors=True)
            self._lost_marker = marker
        else:
            self._lost_marker = None
        if self.rank == 0:
            cost = self.red.to_dict()
            _say(0, f"memory tier every {self.every} step(s) in {self.root}: redundancy {self.red.mode}"
                    + (f", groups {cost['groups']}" if self.red.mode != "none" else "")
                    + f" (hosts {','.join(map(str, hosts))})")

    # --- snapshots ----------------------------------------------------------------------------

    def after_step(self, step: int, loss: float, step_time_s: float) -> None:
        done = step + 1
        if done % self.every == 0:
            self.snapshot(done)

    def snapshot(self, done: int) -> float:
        """Note [memory snapshot]: at the step boundary, join the previous background work and
        capture what is not a tensor; the copy into shared memory runs in the background thread,
        overlapping the next step's forward and backward, and the optimizer's next step waits for
        it (a step pre-hook) before it changes a parameter. Returns the stall so far."""
        t0 = time.perf_counter()
        self._join()
        waited = time.perf_counter() - t0
        slot, nbytes, copy = self.store.prepare(self.trainer)
        stat = {"step": done, "rank": self.rank, "join_wait_s": waited, "boundary_s": time.perf_counter() - t0 - waited,
                "optimizer_wait_s": 0.0, "bytes": nbytes}
        stat["stall_s"] = waited + stat["boundary_s"]
        self._copied = threading.Event()
        self._stat = stat
        self.thread = threading.Thread(target=self._background, args=(slot, done, nbytes, copy, stat, self._copied),
                                       daemon=True, name=f"memory-tier-{done}")
        self.thread.start()
        return stat["stall_s"]

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizer changes parameters and Adam state in place: the copy must be done."""
        copied = self._copied
        if copied is None or copied.is_set():
            return
        t0 = time.perf_counter()
        if not copied.wait(timeout=self.timeout.total_seconds() if self.timeout else 600):
            raise RuntimeError(f"rank {self.rank}: the memory snapshot's copy did not finish")
        waited = time.perf_counter() - t0
        self._stat["optimizer_wait_s"] += waited
        self._stat["stall_s"] += waited

    def _join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"rank {self.rank}: memory tier snapshot failed: {err}") from err

    def _background(self, slot: Slot, step: int, nbytes: int, copy, stat: dict, copied: threading.Event) -> None:
        try:
            t0 = time.perf_counter()
            try:
                copy()
            finally:
                copied.set()
                stat["copy_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            sha = self.store.commit_own(slot, step, nbytes)
            stat["hash_s"] = time.perf_counter() - t0
            if self.red.mode != "none":
                t1 = time.perf_counter()
                self._exchange(slot, step, nbytes, sha)
                stat["exchange_s"] = time.perf_counter() - t1
            self.stats.append(stat)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next _join
            traceback.print_exc()
            self.error = exc

    def _exchange(self, slot: Slot, step: int, nbytes: int, sha: str) -> None:
        """Note [redundancy]: all-gather (step, bytes, sha256), then copy or parity."""
        import torch.distributed as dist

        row = torch.zeros(34, dtype=torch.int64)
        row[0], row[1] = step, nbytes
        row[2:] = torch.tensor(list(bytes.fromhex(sha)), dtype=torch.int64)
        rows = [torch.zeros_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        steps = {int(t[0]) for t in rows}
        if steps != {step}:
            raise RuntimeError(f"memory tier out of step: ranks snapshotted steps {sorted(steps)}")
        sizes = [int(t[1]) for t in rows]
        shas = [bytes(int(x) for x in t[2:].tolist()).hex() for t in rows]
        own = slot.tensor[:nbytes]
        red, me = self.red, self.rank
        if not red.protected(me):
            return
        held = pick_slot(self.store.held)
        held.invalidate()
        works = []
        if red.mode == "copy":
            owner, holder = red.owner_held_by(me), red.holder_of(me)
            works.append(dist.isend(own, dst=holder, group=self.group, tag=1))
            buf = held.writable(sizes[owner])
            works.append(dist.irecv(buf, src=owner, group=self.group, tag=1))
            for w in works:
                w.wait()
            # committed under the owner's sha256 (not hashed again here): a recovery that uses the
            # copy hashes what it received against it, as every tier is checked
            held.commit({"kind": "copy", "owner": owner, "step": step, "bytes": sizes[owner],
                         "sha256": shas[owner], "plan_hash": self.store.plan_hash})
            return
        g = red.group_of(me)
        i = g.index(me)
        c = chunk_bytes([sizes[m] for m in g])
        recv = torch.empty((len(g) - 1, c), dtype=torch.uint8)
        for j, k in enumerate(other_members(len(g), i)):
            works.append(dist.isend(chunk_for(own, i, k, c).contiguous(), dst=g[k], group=self.group, tag=2))
            works.append(dist.irecv(recv[j], src=g[k], group=self.group, tag=2))
        for w in works:
            w.wait()
        parity = xor_all(list(recv))
        buf = held.writable(c)
        buf.copy_(parity)
        psha = hashlib.sha256(memoryview(held._map)[:c]).hexdigest()
        held.commit({"kind": "parity", "group": list(g), "index": i, "step": step, "chunk_bytes": c,
                     "bytes": c, "sha256": psha, "plan_hash": self.store.plan_hash,
                     "members": [{"rank": m, "bytes": sizes[m], "sha256": shas[m]} for m in g]})

    def finish(self, *, cleanup: bool = True) -> None:
        """Join the background work, write the stats; after a clean run remove the memory tier."""
        import torch.distributed as dist

        self._join()
        if self.run_dir and self.stats:
            os.makedirs(self.run_dir, exist_ok=True)
            held = sum(os.path.getsize(s.data_path) for s in self.store.held if os.path.exists(s.data_path))
            own = sum(os.path.getsize(s.data_path) for s in self.store.own if os.path.exists(s.data_path))
            with open(os.path.join(self.run_dir, f"memory_stats_rank_{self.rank}.jsonl"), "a") as fh:
                for row in self.stats:
                    fh.write(json.dumps({**row, "own_shm_bytes": own, "held_shm_bytes": held,
                                         "mode": self.red.mode}) + "\n")
        if cleanup:
            dist.barrier(group=self.group)  # nobody sends into a slot about to go
            self.store.remove()
            dist.barrier(group=self.group)
            if self.rank == min(r for r, h in enumerate(self.red.hosts) if h == self.red.hosts[self.rank]):
                shutil.rmtree(self.store.host_dir, ignore_errors=True)
            dist.barrier(group=self.group)
            if self.rank == 0:
                shutil.rmtree(self.root, ignore_errors=True)

    # --- fault injection --------------------------------------------------------------------

    def fault_hook(self):
        """before_step(step) for --fail-host HOST:STEP[:ATTEMPT] (in that attempt of the torchrun
        job only, default the first): every rank of HOST marks the host lost and SIGKILLs itself;
        the restarted workers of HOST wipe its memory before anything reads it."""
        from runtime import faults

        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        mine = {s for h, s, a in self.settings.fail_hosts if h == self.red.hosts[self.rank] and a == attempt}
        if not mine:
            return None
        marker = os.path.join(self.root, f"lost_host_{self.red.hosts[self.rank]}")

        def before_step(step: int) -> None:
            if step in mine:
                os.makedirs(self.root, exist_ok=True)
                with open(marker, "w") as fh:
                    fh.write(f"{step}\n")
                faults.record(self.run_dir, self.rank, step, "host")
                _say(self.rank, f"fault injection: host {self.red.hosts[self.rank]} lost before step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)

        return before_step

    # --- recovery (Note [memory recovery]) ----------------------------------------------------

    def recover(self, ckpt_dir: str) -> RecoveryResult | None:
        """Restore the newest step every rank can restore from memory; None (nothing restored)
        when there is none, or when the disk holds a newer checkpoint."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        inv = self.store.inventory()
        disk_newest = _newest_committed(ckpt_dir)
        row = torch.full((9,), -1, dtype=torch.int64)
        for j, (s, b) in enumerate(sorted(inv["own"].items())[-2:]):
            row[2 * j], row[2 * j + 1] = s, b
        for j, (s, a) in enumerate(sorted(inv["held"].items())[-2:]):
            row[4 + 2 * j], row[5 + 2 * j] = s, a
        row[8] = disk_newest
        rows = [torch.zeros_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        phases = {"inventory_ms": (time.perf_counter() - t0) * 1e3}
        if self._lost_marker and self.rank == min(r for r, h in enumerate(self.red.hosts)
                                                  if h == self.red.hosts[self.rank]):
            # every rank of this host has wiped before the gather above: the marker has done its job
            try:
                os.unlink(self._lost_marker)
            except FileNotFoundError:
                pass
        own = [{int(t[2 * j]): int(t[2 * j + 1]) for j in range(2) if int(t[2 * j]) >= 0} for t in rows]
        held = [{int(t[4 + 2 * j]): int(t[5 + 2 * j]) for j in range(2) if int(t[4 + 2 * j]) >= 0} for t in rows]
        disk = max(int(t[8]) for t in rows)
        excluded: set = set()
        failures: list = []
        for rounds in range(1, _MAX_ROUNDS + 1):
            choice = choose_step(own, held, self.red, excluded, not_before=max(disk, 1))
            if choice is None:
                newest = max((s for o in own for s in o), default=None)
                if self.rank == 0 and (any(own) or any(held)):
                    reason = why_not(own, held, self.red, newest)
                    if newest is not None and disk >= newest and not failures:
                        reason = f"the disk holds step {disk}, as new as memory's newest ({newest})"
                    if failures:
                        reason += "; failed verification: " + ", ".join(f"rank {r} step {s} tier {t}"
                                                                      for r, s, t in failures)
                    _say(0, f"memory tier: {reason}: recovering from disk")
                return None
            step, tiers = choice
            t1 = time.perf_counter()
            data, bad = self._fetch(step, tiers, own, held)
            phases["fetch_verify_ms"] = phases.get("fetch_verify_ms", 0.0) + (time.perf_counter() - t1) * 1e3
            t1 = time.perf_counter()
            flags = torch.zeros(self.world, dtype=torch.int64)
            for r in bad:
                flags[r] = 1
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            phases["agree_ms"] = phases.get("agree_ms", 0.0) + (time.perf_counter() - t1) * 1e3
            failed = [r for r in range(self.world) if int(flags[r])]
            if not failed:
                break
            for r in failed:
                excluded.add((r, step, tiers[r]))
                failures.append((r, step, tiers[r]))
                if self.rank == 0:
                    _say(0, f"memory tier: rank {r}'s step {step} from tier={tiers[r]} failed verification; "
                            "trying the next tier")
        else:
            return None
        from runtime.recovery import needed_names

        where = f"memory tier ({tiers[self.rank]}) step {step} of rank {self.rank}"
        t1 = time.perf_counter()
        loaded = loaded_from_bytes(data, step=step, program=self.trainer.program, rank=self.rank,
                                   needed=needed_names(self.trainer), where=where)
        ck.restore(self.trainer, loaded)
        phases["restore_ms"] = (time.perf_counter() - t1) * 1e3
        self.store.invalidate_newer(step)
        dist.barrier(group=self.group)
        self.recovery = RecoveryResult(step, tiers[self.rank], tiers, time.perf_counter() - t0, rounds, failures,
                                       {k: round(v, 2) for k, v in phases.items()})
        return self.recovery

    def _fetch(self, step: int, tiers: dict[int, str], own: list[dict], held: list[dict]):
        """This rank's shard bytes of ``step`` by its tier, and the ranks whose tier failed here
        (every rank takes part in every transfer the choice implies, in one fixed order)."""
        import torch.distributed as dist

        red, me = self.red, self.rank
        bad: set[int] = set()
        mine = None
        if tiers[me] == "memory":
            found = find_slot(self.store.own, step)
            mine = found[0].verify(found[1]) if found else None
            if mine is None:
                bad.add(me)
        sends, recvs = [], []
        # copies: holder -> owner (a 33-int64 header: bytes, sha256; then the bytes)
        for r in sorted(t for t, tier in tiers.items() if tier == "peer"):
            h = red.holder_of(r)
            if me == h:
                found = find_slot(self.store.held, step)
                rec = found[1] if found else {"bytes": held[h].get(step, 0), "sha256": "00" * 32}
                n = int(rec["bytes"])
                data = found[0].read(n) if found else memoryview(bytearray(n))
                head = torch.tensor([n] + list(bytes.fromhex(rec["sha256"])), dtype=torch.int64)
                sends.append(dist.isend(head, dst=r, group=self.group, tag=11))
                sends.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8)
                                        if n else torch.zeros(0, dtype=torch.uint8), dst=r, group=self.group, tag=12))
            if me == r:
                n = held[h][step]
                head = torch.zeros(33, dtype=torch.int64)
                buf = torch.empty(n, dtype=torch.uint8)
                recvs.append(("peer", dist.irecv(head, src=h, group=self.group, tag=11), head, buf))
                recvs.append(("peer-data", dist.irecv(buf, src=h, group=self.group, tag=12), head, buf))
        # parity: every survivor -> the lost member (33-int64 header from its parity record, then its piece)
        pieces: list = []
        for r in sorted(t for t, tier in tiers.items() if tier == "parity"):
            g = red.group_of(r)
            lost = g.index(r)
            survivors = [m for m in g if m != r]
            c = held[survivors[0]][step]
            if me in survivors:
                i = g.index(me)
                piece, head_vals = self._survivor_piece(step, g, i, lost, c, r, bad)
                sends.append(dist.isend(torch.tensor(head_vals, dtype=torch.int64), dst=r, group=self.group, tag=21))
                sends.append(dist.isend(piece, dst=r, group=self.group, tag=22))
            if me == r:
                for m in survivors:
                    head = torch.zeros(33, dtype=torch.int64)
                    buf = torch.empty((len(g) - 1) * c, dtype=torch.uint8)
                    w1 = dist.irecv(head, src=m, group=self.group, tag=21)
                    w2 = dist.irecv(buf, src=m, group=self.group, tag=22)
                    pieces.append((w1, w2, head, buf))
        for w in sends:
            w.wait()
        for kind, w, head, buf in recvs:
            w.wait()
        if tiers[me] == "peer":
            head, buf = recvs[0][2], recvs[0][3]
            sha = bytes(int(x) for x in head[1:].tolist()).hex()
            data = memoryview(buf.numpy())
            if int(head[0]) != len(data) or hashlib.sha256(data).hexdigest() != sha:
                bad.add(me)
            else:
                mine = data
        if tiers[me] == "parity":
            heads = []
            bufs = []
            for w1, w2, head, buf in pieces:
                w1.wait()
                w2.wait()
                heads.append(tuple(int(x) for x in head.tolist()))
                bufs.append(buf)
            if len(set(heads)) != 1 or heads[0][0] < 0:
                bad.add(me)
            else:
                n = heads[0][0]
                sha = bytes(heads[0][1:]).hex()
                data = reconstruct(bufs, n)
                if hashlib.sha256(data).hexdigest() != sha:
                    bad.add(me)
                else:
                    mine = data
        return mine, bad

    def _survivor_piece(self, step, g, i, lost, c, lost_rank, bad) -> tuple[torch.Tensor, list[int]]:
        """Survivor i's piece for rebuilding member ``lost`` (its own slot and parity of ``step``,
        both verified; a failed one is sent as zeros and reported)."""
        zeros = torch.zeros((len(g) - 1) * c, dtype=torch.uint8)
        own = find_slot(self.store.own, step)
        par = find_slot(self.store.held, step)
        own_data = own[0].verify(own[1]) if own else None
        par_data = par[0].verify(par[1]) if par else None
        if own_data is None:
            bad.add(self.rank)
        if par_data is None or own_data is None:
            bad.add(lost_rank)
            return zeros, [-1] + [0] * 32
        member = next((m for m in par[1].get("members", []) if m["rank"] == lost_rank), None)
        if member is None or int(par[1]["chunk_bytes"]) != c:
            bad.add(lost_rank)
            return zeros, [-1] + [0] * 32
        shard = torch.frombuffer(own_data, dtype=torch.uint8)
        parity = torch.frombuffer(par_data, dtype=torch.uint8)
        piece = survivor_piece(shard, parity, i, lost, len(g), c)
        return piece.contiguous(), [int(member["bytes"])] + list(bytes.fromhex(member["sha256"]))


def _newest_committed(ckpt_dir: str) -> int:
    """The newest disk checkpoint with a valid manifest (manifests only, no shard read); -1."""
    for step in ck.list_step_dirs(ckpt_dir):
        try:
            ck.read_manifest(ckpt_dir, step)
            return step
        except ck.CheckpointCorruptError:
            continue
    return -1


def preallocate_optimizer_state(trainer) -> list:
    """Allocate (and touch) the Adam state a restore fills, for every parameter that has none,
    before the recovery is timed: a fresh process pays for first-touch page faults here, in
    start-up, for whichever tier then restores (runtime.checkpoint.restore fills tensors it finds).
    Returns the parameters given state; ``recover_any`` removes it again where nothing filled it."""
    made = []
    with torch.no_grad():
        for p in trainer.named_parameters().values():
            if not trainer.optimizer.state.get(p):
                trainer.optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                made.append(p)
    return made


def recover_any(trainer, ckpt_dir: str, tier: MemoryTier | None, *, run_dir: str | None = None) -> int:
    """Recovery from the fastest tier that survived: the memory tier, else the disk
    (runtime.recovery.recover). Logs "recovered step N from tier=T in X ms" and appends it to
    RUN_DIR/recovery.jsonl."""
    from runtime.recovery import recover

    import torch.distributed as dist

    made = preallocate_optimizer_state(trainer)
    dist.barrier()  # the ranks come up at different times: time the recovery, not the start-up skew
    t0 = time.perf_counter()
    reads0 = ck.READS["shards"]
    result = tier.recover(ckpt_dir) if tier is not None else None
    if result is not None:
        step, mine, tiers, rounds = result.step, result.tier, result.tiers, result.rounds
    else:
        step = recover(trainer, ckpt_dir)
        mine, tiers, rounds = ("disk" if step > 0 else "none"), {}, 0
        if tier is not None:
            tier.store.invalidate_newer(step)  # what the memory held past the resume step is void
    seconds = time.perf_counter() - t0
    for p in made:  # what no checkpoint filled goes again: AdamW creates its state at the first step
        if "step" not in trainer.optimizer.state.get(p, {}):
            trainer.optimizer.state.pop(p, None)
    if step > 0:
        _say(trainer.rank, f"recovered step {step} from tier={mine} in {seconds * 1e3:.1f} ms")
        if trainer.rank == 0 and tiers:
            by = {}
            for r, t in sorted(tiers.items()):
                by.setdefault(t, []).append(r)
            _say(0, f"recovered step {step}: " + ", ".join(f"tier={t} (ranks {','.join(map(str, rs))})"
                                                           for t, rs in by.items()))
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            row = {"rank": trainer.rank, "step": step, "tier": mine, "ms": seconds * 1e3, "rounds": rounds,
                   "tiers": {str(r): t for r, t in tiers.items()}, "disk_shards_read": ck.READS["shards"] - reads0,
                   "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                   "failures": [list(f) for f in (result.failures if result else [])],
                   "phases": result.phases if result else {}, "time_unix": time.time()}
            with open(os.path.join(run_dir, "recovery.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
    return step
