"""The memory tier the trainer drives: in-memory checkpoints in host shared memory every few steps,
copied in the background, protected by a peer copy or XOR parity across hosts (``MemoryTier``),
and its settings (``settings_from``). Its recovery, with the disk tier underneath, is
runtime/resilience/recovery.py (Note [memory recovery]).

Note [memory snapshot]: the layout of a rank's shard (tensor names, shapes, dtypes, the offsets of
a safetensors file with a header padded to a fixed capacity: runtime.resilience.checkpoint.ShardLayout) is
fixed at the first snapshot, so a snapshot is one copy of each state tensor into the preallocated
shared-memory file. At the step boundary only the RNG states, the mutable buffers (the forward
changes them) and the JSON state are captured (runtime.resilience.checkpoint.state_entries); the copy runs in
a background thread while the next step's forward and backward run (they only read the
parameters), and the optimizer waits for it in a step pre-hook before it changes anything
(CheckFreq's pipelined snapshot). Then, in the same thread, the sha256, the commit record and the
redundancy exchange (Note [redundancy] in runtime/resilience/memtier/groups.py). The next snapshot first
joins the previous background work. The stall (recorded per snapshot in
RUN_DIR/memory_stats_rank_<r>.jsonl) is the boundary work plus any wait, at the boundary or
before the optimizer step.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.resilience import faults
from runtime.resilience.faults import say
from runtime.resilience.memtier.groups import MODES, chunk_bytes, hosts_of_ranks, plan_redundancy
from runtime.resilience.memtier.parity import chunk_for, other_members, xor_all
from runtime.resilience.memtier.slots import (LocalStore, Slot, clear_stale, default_base, default_root, free_bytes, host_need,
                                   lost_marker, mark_owner, pick_slot, prepare_base, run_id_for, secure_dir, used_bytes)
from runtime.program.parts import MemoryTierPlan


@dataclass(frozen=True)
class Settings:
    mode: str                  # "auto", "none", "copy", "parity"
    every: int = 1
    group_size: int | None = None
    hosts: str | None = None   # --hosts
    root: str | None = None    # --memory-dir
    fail_hosts: tuple[tuple[int, int, int], ...] = ()  # (host, step, attempt)


def settings_from(plan: MemoryTierPlan | None, options) -> Settings | None:
    """The memory tier's settings from the plan's choice (``Program.memory_tier``) and the run's
    ``RunOptions`` (runtime/launch/run_options.py, which checked their values); None when it is off
    (neither asks for it, or --memory-tier off)."""
    plan = plan or MemoryTierPlan(mode="off")
    mode = options.memory_tier or plan.mode
    if mode is None or mode == "off":
        return None
    if mode not in ("auto",) + MODES:
        raise ValueError(f"--memory-tier {mode!r}: write off, auto, none, copy or parity")
    every = plan.every if options.memory_every is None else options.memory_every
    group = options.parity_group
    if group is None:  # the plan's: a one-host plan says 1 (no groups), which means none
        group = plan.group_size if plan.group_size is not None and plan.group_size >= 2 else None
    fails = [faults.parse_fail_host(text) for text in options.fail_host]
    return Settings(mode, every, group, options.hosts, options.memory_dir, tuple(fails))


class MemoryTier:
    """Memory snapshots every ``every`` steps (``after_step``), the background redundancy
    exchange and clean-up (``finish``); runtime.resilience.recovery.recover_memory restores from it. Create it
    on every rank in the same order as the other groups (it creates a gloo group)."""

    def __init__(self, trainer, settings: Settings, *, ckpt_dir: str, timeout=None, run_dir: str | None = None):
        self.trainer, self.settings, self.run_dir = trainer, settings, run_dir
        program = trainer.program
        self.rank, self.world = trainer.rank, dist.get_world_size()
        self.timeout = timeout
        hosts = hosts_of_ranks(self.world, settings.hosts)
        keys = [(tuple(sorted(e.stages)), e.replica) for e in sorted(program.ranks, key=lambda e: e.rank)]
        self.red = plan_redundancy(hosts, keys, mode=settings.mode, group_size=settings.group_size)
        self.every = settings.every
        self.group = dist.new_group(list(range(self.world)), timeout=timeout, backend="gloo")
        # the run id (rank 0's), the tier's own folder, stale folders cleared: Note [memory tier trust] in slots.py
        rid = torch.zeros(8, dtype=torch.uint8)
        if self.rank == 0:
            rid.copy_(torch.tensor(list(bytes.fromhex(run_id_for(ckpt_dir))), dtype=torch.uint8))
        dist.broadcast(rid, src=0, group=self.group)
        self.run_id = bytes(rid.tolist()).hex()
        self.base = prepare_base(settings.root or default_base())
        self.root = default_root(ckpt_dir, program.plan_hash, self.run_id, base=self.base)
        first_of_host = self.rank == min(r for r, h in enumerate(self.red.hosts) if h == self.red.hosts[self.rank])
        if first_of_host:
            for path in clear_stale(self.base, self.root):
                say(self.rank, f"memory tier: removed stale {path}")
        secure_dir(self.root)
        mark_owner(self.root)
        self.store = LocalStore(self.root, self.rank, self.red, program.plan_hash, self.run_id)
        self.enabled = self._fits(trainer)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stats: list[dict] = []
        self._copied: threading.Event | None = None
        self._stat: dict = {}
        trainer.optimizer.register_step_pre_hook(self._before_optimizer_step)
        self.recovery = None  # runtime.resilience.recovery.RecoveryResult, once recover_memory restored from it
        marker = lost_marker(self.root, self.red.hosts[self.rank])
        # fault injection: this host was lost; its memory goes with it (recovery removes the marker)
        self.lost_marker = marker if os.path.exists(marker) else None
        if self.lost_marker:
            shutil.rmtree(self.store.host_dir, ignore_errors=True)
        if self.rank == 0 and self.enabled:
            cost = self.red.to_dict()
            say(0, f"memory tier every {self.every} step(s) in {self.root}: redundancy {self.red.mode}"
                   + (f", groups {cost['groups']}" if self.red.mode != "none" else "")
                   + f" (hosts {','.join(map(str, hosts))})")

    def _fits(self, trainer) -> bool:
        """Whether every host's shared memory holds what the tier will write there (a full tmpfs
        kills a writer with SIGBUS); agreed by all ranks. When not, the run goes on from disk only
        (one warning) and the caller drops the tier (``enabled`` False)."""
        est = sum(p.numel() * p.element_size() for p in trainer.named_parameters().values()) * 3 + (1 << 20)
        mine = torch.tensor([est], dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        need = host_need([int(r) for r in rows], list(self.red.hosts), self.red.mode, self.red.hosts[self.rank])
        free = free_bytes(self.root) + used_bytes(self.root)
        ok = torch.tensor([1 if free >= need else 0], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if int(ok) == 1:
            return True
        if free < need:
            say(self.rank, f"warning: memory tier off: {self.base} has {free / 2**20:.0f} MiB free, the tier needs "
                           f"{need / 2**20:.0f} MiB on this host (enlarge it, e.g. docker --shm-size, or pass "
                           "--memory-dir): checkpoints go to disk only")
        shutil.rmtree(self.root, ignore_errors=True)
        return False

    # --- snapshots ----------------------------------------------------------------------------

    def after_step(self, step: int, loss: float, step_time_s: float) -> None:
        done = step + 1
        if done % self.every == 0:
            self.snapshot(done)

    def snapshot(self, done: int) -> float:
        """At the step boundary (Note [memory snapshot]), join the previous background work and
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

    def settle(self) -> None:
        """Wait for the background copy and exchange (a rollback, runtime/resilience/sdc.py, starts after it)."""
        self._join()

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
        """All-gather (step, bytes, sha256), then copy or parity (Note [redundancy])."""
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
                         "sha256": shas[owner], "plan_hash": self.store.plan_hash,
                         "run_id": self.store.run_id})
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
        psha = held.sha256(c)
        held.commit({"kind": "parity", "group": list(g), "index": i, "step": step, "chunk_bytes": c,
                     "bytes": c, "sha256": psha, "plan_hash": self.store.plan_hash, "run_id": self.store.run_id,
                     "members": [{"rank": m, "bytes": sizes[m], "sha256": shas[m]} for m in g]})

    def finish(self, *, cleanup: bool = True) -> None:
        """Join the background work, write the stats; after a clean run remove the memory tier (its
        own folder; never --memory-dir itself)."""
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
        """before_step(step) for --fail-host HOST:STEP[:ATTEMPT] (runtime.resilience.faults.host_hook): every
        rank of HOST marks the host lost and SIGKILLs itself; the restarted workers of HOST wipe
        its memory before anything reads it."""
        host = self.red.hosts[self.rank]
        return faults.host_hook(self.settings.fail_hosts, host=host, rank=self.rank,
                                marker=lost_marker(self.root, host), run_dir=self.run_dir)
