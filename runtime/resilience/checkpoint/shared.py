"""Is the checkpoint folder one folder for every node? Checked once at start-up of a multi-node run.

Note [shared checkpoint folder]: a disk checkpoint is committed by rank 0's manifest after every
rank wrote its shard into the same folder (Note [distributed commit] in persist.py), and a restart
resumes from a checkpoint only when every rank finds all of it (runtime/resilience/recovery.py). Across
nodes that needs a filesystem every node mounts (NFS, Lustre, a cloud file share). On node-local
disks each node sees only its own shards and no manifest of rank 0's, so every checkpoint is
incomplete and every restart starts again at step 0. Nothing fails, it is only lost work, which is
why the run says so at start-up: rank 0 writes a marker with a random token into the folder, every
rank looks for it, and rank 0 names the hosts that do not see it. (The in-memory tier,
runtime/resilience/memtier/, recovers across nodes without a shared folder, from host memory and peers.)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from runtime.file_trust import read_bounded
from runtime.resilience.checkpoint.durable import create_new

MARKER = ".shared-check-"


def write_marker(path: str, text: str) -> None:
    """Rank 0's marker, created new (O_EXCL | O_NOFOLLOW, owner only): a file or link planted at its
    name is removed, never written through (Note [files are not trusted])."""
    with os.fdopen(create_new(path), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sees_marker(path: str, text: str) -> bool:
    """Whether ``path`` is a regular file holding ``text``: a link, a FIFO or a larger file is not
    the marker (read without following a link, bounded)."""
    try:
        return read_bounded(path, cap=len(text)) == text.encode()
    except OSError:
        return False


def unshared_hosts(sees: list[bool], hosts: list[int] | tuple[int, ...]) -> list[int]:
    """The hosts with a rank that does not see rank 0's marker (``sees`` by rank)."""
    return sorted({hosts[r] for r, seen in enumerate(sees) if not seen})


def unshared_warning(ckpt_dir: str, hosts_missing: list[int]) -> str:
    return (f"[rank 0] warning: checkpoint folder {ckpt_dir} is not shared across nodes: host(s) "
            f"{', '.join(map(str, hosts_missing))} do not see rank 0's files in it, so no checkpoint "
            "will be complete and every restart starts again at step 0. Put --checkpoint-dir on a filesystem "
            "every node mounts (NFS, Lustre, ...); the memory tier (--memory-tier) recovers without one "
            "(docs/multi-node.md)")


def check_shared(ckpt_dir: str, rank: int, hosts, device) -> list[int]:
    """Collective over the default group (every rank calls it): the hosts that do not see the
    folder rank 0 writes to; rank 0 prints the warning. Nothing runs on a single host."""
    if len(set(hosts)) < 2:
        return []

    token = torch.zeros(16, dtype=torch.uint8, device=device)
    if rank == 0:
        token.copy_(torch.tensor(list(os.urandom(16)), dtype=torch.uint8))
    text = None
    if rank == 0:
        text = bytes(token.cpu().tolist()).hex()
        write_marker(os.path.join(ckpt_dir, MARKER + text), text)
    dist.broadcast(token, src=0)
    text = bytes(token.cpu().tolist()).hex()
    path = os.path.join(ckpt_dir, MARKER + text)
    seen = sees_marker(path, text)
    flags = [torch.zeros(1, dtype=torch.uint8, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(seen)], dtype=torch.uint8, device=device))
    missing = unshared_hosts([bool(int(f.item())) for f in flags], list(hosts))
    if rank == 0:
        os.remove(path)
        if missing:
            print(unshared_warning(ckpt_dir, missing), flush=True)
    return missing
