"""XOR parity over a redundancy group (Note [redundancy] in runtime/resilience/memtier/groups.py): the chunk
member i addresses to member k, the stripe each member holds, what a survivor sends to rebuild a
lost member, and the rebuild. Pure arithmetic on uint8 tensors; the distributed exchange
(runtime/resilience/memtier/tier.py), the recovery (runtime/resilience/recovery.py) and the unit tests all use it."""

from __future__ import annotations

import torch

from runtime.resilience.memtier.groups import chunk_bytes


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
