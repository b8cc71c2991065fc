"""The memory handover: the survivors' memory-tier slots of a lost layout made a checkpoint of that
layout, for the re-planned program to read (runtime/launch/elastic.py).

Note [memory handover]: after a host is lost for good, the survivors run a new plan (Note [re-plan
on the same cuts] in partitioner/replan.py) whose memory tier is a new one (its folder is keyed by
the plan hash). The old tier still holds, on the surviving hosts, every surviving rank's own slots
and (mode copy) the peer copies of the lost ranks. Each new rank lists what its old rank holds
there (its own slot when its host is alive, the copy it holds for a rank of a lost host), the ranks
all-gather it and choose the newest step every old rank is covered at; when the disk holds that
step or a newer one, the disk serves (nothing is handed over). Otherwise each slot becomes shard
file ``shard_rank_<old>.safetensors`` of a checkpoint folder of the old layout in the same shared
memory (a hard link: no byte is copied; a copy only where the slot file is longer than its
record), rank 0 writes its manifest from the slots' commit records (their sha256), and the
existing resharding load (runtime/resilience/recovery.py ``recover``) verifies every shard it reads
against those hashes and lays the state out for the new plan, exactly as it reads a disk checkpoint
of another plan. The old tier and the handover folder are removed once every rank has restored.
A lost host's own folder is never read: its memory went with it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.exchange import all_gather_json
from runtime.program.spec import Program
from runtime.resilience.checkpoint.manifest import ShardInfo, manifest_for, newest_committed, write_manifest
from runtime.resilience.checkpoint.shard import shard_filename, step_dirname
from runtime.resilience.memtier.groups import Redundancy, plan_redundancy
from runtime.resilience.memtier.slots import LocalStore, default_base, default_root, run_id_for, secure_dir

HANDOVER_PREFIX = "partitioner-handover-"


@dataclass(frozen=True)
class Handover:
    folder: str | None         # the old layout's checkpoint folder in shared memory; None: the disk serves
    step: int                  # the step it holds (-1: none)
    tiers: dict[int, str]      # old rank -> "memory" (its own slot) | "peer" (the copy a survivor held)
    old_root: str
    why: str = ""              # when the disk serves: why


def old_redundancy(program: Program, hosts: list[int], mode: str, group_size: int | None) -> Redundancy:
    """The old run's redundancy, as its MemoryTier built it."""
    keys = [(tuple(sorted(e.stages)), e.replica) for e in sorted(program.ranks, key=lambda e: e.rank)]
    return plan_redundancy(hosts, keys, mode=mode, group_size=group_size)


def _held(old_rank: int, store: LocalStore, red: Redundancy, alive: set[int]) -> dict[int, dict]:
    """{old rank: {step: (path, bytes, sha256, kind)}} this old rank can hand over."""
    out: dict[int, dict] = {}
    if red.hosts[old_rank] in alive:
        for slot in store.own:
            rec = slot.record()
            if rec and rec.get("kind") == "own" and store.ours(rec) and rec.get("rank") == old_rank:
                out.setdefault(old_rank, {})[int(rec["step"])] = (slot.data_path, int(rec["bytes"]), rec["sha256"],
                                                                  "memory")
    owner = red.owner_held_by(old_rank) if red.mode == "copy" else None
    if owner is not None and red.hosts[owner] not in alive:
        for slot in store.held:
            rec = slot.record()
            if rec and rec.get("kind") == "copy" and store.ours(rec) and rec.get("owner") == owner:
                out.setdefault(owner, {})[int(rec["step"])] = (slot.data_path, int(rec["bytes"]), rec["sha256"], "peer")
    return out


def hand_over(program: Program, *, old_rank: int, hosts: list[int], alive: set[int], mode: str,
              group_size: int | None, ckpt_dir: str, memory_dir: str | None) -> Handover:
    """Collective over the (new) world: the old layout's newest covered memory step as a checkpoint
    folder (Note [memory handover])."""
    base = memory_dir or default_base()
    run_id = run_id_for(ckpt_dir)
    old_root = default_root(ckpt_dir, program.plan_hash, run_id, base=base)
    red = old_redundancy(program, hosts, mode, group_size)
    mine = _held(old_rank, LocalStore(old_root, old_rank, red, program.plan_hash, run_id), red, alive) \
        if os.path.isdir(old_root) else {}
    device = torch.device(program.device)  # Note [no pickle between ranks] in runtime/exchange.py
    rows = all_gather_json([[r, s, *item] for r, steps in sorted(mine.items()) for s, item in sorted(steps.items())],
                           device)
    offers: dict[int, dict] = {}
    for row in rows:
        for r, s, *item in row:
            offers.setdefault(int(r), {}).setdefault(int(s), tuple(item))
    covered = set.intersection(*(set(offers.get(r, {})) for r in range(program.world_size)))
    disk = newest_committed(ckpt_dir)
    if not covered:
        lost = [r for r in range(program.world_size) if not offers.get(r)]
        return Handover(None, -1, {}, old_root, f"no memory snapshot covers old ranks {lost}")
    step = max(covered)
    if disk >= step:
        return Handover(None, -1, {}, old_root, f"the disk holds step {disk}, as new as memory's newest ({step})")
    folder = os.path.join(base, f"{HANDOVER_PREFIX}{os.path.basename(old_root)[len('partitioner-memtier-'):]}")
    step_dir = os.path.join(folder, step_dirname(step))
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        secure_dir(folder)
        secure_dir(step_dir)
    dist.barrier()
    infos = []
    for r, steps in sorted(mine.items()):
        if step in steps and offers[r][step] == steps[step]:  # the one offer chosen for r
            path, nbytes, sha, _ = steps[step]
            dst = os.path.join(step_dir, shard_filename(r))
            if os.path.getsize(path) == nbytes:
                os.link(path, dst)  # same tmpfs: no byte copied
            else:
                with open(path, "rb") as src, open(dst, "wb") as out:
                    out.write(src.read(nbytes))
            infos.append(ShardInfo(shard_filename(r), r, nbytes, sha))
    gathered = all_gather_json([dataclasses.asdict(i) for i in infos], device)
    if dist.get_rank() == 0:
        shards = [ShardInfo(**i) for part in gathered for i in part]
        write_manifest(folder, manifest_for(step, shards, program))
    dist.barrier()
    return Handover(folder, step, {r: offers[r][step][3] for r in range(program.world_size)}, old_root)


def remove(handover: Handover) -> None:
    """The old tier and the handover folder, once every rank has restored (rank 0 calls it)."""
    for path in (handover.folder, handover.old_root):
        if path:
            shutil.rmtree(path, ignore_errors=True)
