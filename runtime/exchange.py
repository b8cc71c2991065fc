"""Small Python values between ranks, as JSON in byte tensors: the runtime's replacement for torch's
object collectives.

Note [no pickle between ranks]: torch's ``all_gather_object``/``broadcast_object_list`` unpickle
what a peer sends, and a peer on one host is a loopback TCP connection (gloo's pairs, found through
rank 0's store) that nothing authenticates: a local process of another user that gets in between
(README "Trust model") would run code as the job's user the moment a rank unpickled its bytes. So
the runtime sends its bookkeeping (memory rows, memory-tier offers, the elastic re-plan's hosts and
refusal) as JSON, which decodes to data and nothing else: a hostile peer can stall a run or feed it
wrong values, never run code. A payload over MAX_BYTES is refused before it is allocated. The
tensors live on ``device`` (the rank's, given as a ``torch.device``: NCCL takes CUDA tensors only);
tests/unit/test_exchange.py keeps torch's object collectives out of runtime/.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

MAX_BYTES = 64 << 20  # the runtime's largest exchange (memory-tier offers) is kilobytes


def _encode(obj) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _checked(size: int, src: int) -> int:
    if not 0 < size <= MAX_BYTES:
        raise RuntimeError(f"rank {src} sent a {size}-byte exchange (at most {MAX_BYTES}): a peer that is not "
                           "this job's rank is on its connection (README \"Trust model\"); restart the job")
    return size


def _decode(payload: torch.Tensor, src: int):
    try:
        return json.loads(bytes(payload.cpu().tolist()).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise RuntimeError(f"rank {src} sent an exchange that is not JSON ({exc.__class__.__name__}): a peer that "
                           "is not this job's rank is on its connection (README \"Trust model\"); restart the job") \
            from None


def all_gather_json(obj, device: torch.device, group=None) -> list:
    """Every rank's ``obj`` (JSON-able), in group rank order (Note [no pickle between ranks])."""
    payload = _encode(obj).to(device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [_checked(int(s.item()), r) for r, s in enumerate(sizes)]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload
    out = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [_decode(t[:k], r) for r, (t, k) in enumerate(zip(out, lengths))]


def broadcast_json(obj, src: int, device: torch.device, group=None):
    """``obj`` (JSON-able) of rank ``src`` (a global rank, as torch's broadcast takes), on every rank."""
    mine = dist.get_rank() == src
    payload = _encode(obj).to(device) if mine else None
    size = torch.tensor([payload.numel() if mine else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if mine:
        dist.broadcast(payload, src, group=group)
        return json.loads(json.dumps(obj))  # what the others decode: tuples become lists on every rank alike
    received = torch.empty(_checked(int(size.item()), src), dtype=torch.uint8, device=device)
    dist.broadcast(received, src, group=group)
    return _decode(received, src)
