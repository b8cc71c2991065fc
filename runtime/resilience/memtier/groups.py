"""Which host each rank sits on and how the memory tier protects it: redundancy groups (one rank
per host), the mode (none, copy, parity) and what it costs in host memory. Plain numbers, no torch:
the compiler imports this room to plan the tier (partitioner/compiler.py), the runtime to run it.

Note [redundancy]: ranks are grouped one per host (``plan_redundancy``: hosts in groups of g, the
i-th rank of each host by (stages, replica), so group members hold the same stage and equal-sized
shards where the layout allows). Mode copy: each member sends its shard to the next member of the
group (a ring), which holds it; memory per rank: one shard. Mode parity (RAID-5 style): member i's
shard is cut into g - 1 chunks of C bytes, one for each other member k; member k holds the XOR of
the chunks addressed to it (runtime/resilience/memtier/parity.py); memory per rank: C = shard / (g - 1).
Losing one member of a group is repaired by XOR of the others' chunks and the parity; losing two
is not (disk). The exchange (runtime/resilience/memtier/tier.py) runs on a gloo group of its own (created at
start-up with the collective timeout): an all-gather of (step, bytes, sha256) of every rank, then
point-to-point sends; the received copy or parity is hashed and committed like an own slot, with
the sha256 of every shard it covers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HOSTS_ENV = "PARTITIONER_HOSTS"
MODES = ("none", "copy", "parity")
DEFAULT_PARITY_GROUP = 4


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
