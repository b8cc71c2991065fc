"""The memory tier: in-memory checkpoints in host shared memory, with peer redundancy across hosts
(a full copy or XOR parity), recovered from the fastest tier that survived. The disk tier
(runtime/resilience/checkpoint/) keeps running at its own, slower interval underneath. This package
re-exports the names callers use (``from runtime.resilience import memtier``).

Rooms
-----
groups.py  hosts of ranks, redundancy groups and mode (``plan_redundancy``), host memory they cost
           (``memory_cost``); no torch: the compiler plans with it (Note [redundancy])
parity.py  XOR parity: chunks, stripes, a survivor's piece, the rebuild
slots.py   shared-memory slots, whole or absent, and one rank's set of them (``LocalStore``)
           (Note [memory tier layout])
staging.py a GPU rank's copy into a slot: its own stream, pinned buffers (Note [memory tier copy
           on a GPU])
tier.py    ``MemoryTier`` (snapshots copied in the background, the redundancy exchange, clean-up)
           and ``settings_from`` (Note [memory snapshot])
handover.py  the survivors' slots of a lost layout as its checkpoint, for a re-planned program
           (Note [memory handover])

A slot holds a shard in the disk format, written by runtime.resilience.checkpoint.ShardLayout and read by
runtime.resilience.checkpoint.parse_shard. Recovery from the tier (own slot, peer copy, parity, else disk)
is runtime/resilience/recovery.py (Note [memory recovery]); --fail-host is runtime/resilience/faults.py.
"""

from runtime.resilience.memtier.groups import (DEFAULT_PARITY_GROUP, HOSTS_ENV, MODES, Redundancy, chunk_bytes, hosts_of_ranks,
                                    memory_cost, parse_hosts, plan_redundancy)
from runtime.resilience.memtier.parity import chunk_for, encode_parity, other_members, reconstruct, survivor_piece, xor_all
from runtime.resilience.memtier.slots import FORMAT, UnsafeMemoryDir, LocalStore, Slot, default_root, find_slot, lost_marker, pick_slot
from runtime.resilience.memtier.tier import MemoryTier, Settings, settings_from

__all__ = [
    "DEFAULT_PARITY_GROUP", "FORMAT", "HOSTS_ENV", "MODES", "LocalStore", "MemoryTier", "Redundancy", "Settings",
    "Slot", "UnsafeMemoryDir", "chunk_bytes", "chunk_for", "default_root", "encode_parity", "find_slot", "hosts_of_ranks",
    "lost_marker", "memory_cost", "other_members", "parse_hosts", "pick_slot", "plan_redundancy", "reconstruct",
    "settings_from", "survivor_piece", "xor_all",
]
