"""A GPU rank's memory-tier copy: on its own stream, through pinned buffers (Note [memory tier copy
on a GPU]).

Note [memory tier copy on a GPU]: the snapshot's copy (Note [memory snapshot] in
runtime/resilience/memtier/tier.py) runs in a thread beside the next step. From a GPU, a plain
``copy_`` into the shared-memory file would queue on the default stream behind the step's kernels
and hold up the next ones until done, and a copy into pageable memory is staged by the driver at
about half the speed of pinned. So at the step boundary the trainer's stream records an event
(everything the optimizer wrote is before it); the thread copies on a stream of its own that
waits for that event, through two pinned buffers of ``STAGING_BYTES`` taken in turn (a chunk
goes to the GPU's copy engine while the previous one is copied into the file on the host), and
the optimizer's pre-hook still waits for the whole copy before it changes a parameter. Pinned
memory is bounded (two buffers per rank, not a pinned copy of the shard) and the shared-memory
file stays an ordinary mapping (no cudaHostRegister to undo when the layout changes). CPU
tensors are copied as before.
"""

from __future__ import annotations

import torch

STAGING_BYTES = 64 * 2**20


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def staged_copy(pairs, buffers: list[torch.Tensor], *, record=lambda: None, wait=lambda mark: None) -> None:
    """Copy each ``(source, destination)`` pair's bytes through ``buffers`` (1-D uint8, taken in turn,
    chunks of their size): a chunk is copied into a buffer (``non_blocking``), ``record()`` marks it,
    and the buffer is emptied into the destination after ``wait(mark)``, when it is next needed or
    at the end (Note [memory tier copy on a GPU]). Destinations are contiguous."""
    inflight: list = [None] * len(buffers)
    size = min(int(b.numel()) for b in buffers)

    def drain(k: int) -> None:
        if inflight[k] is not None:
            mark, dst, n = inflight[k]
            wait(mark)
            dst.copy_(buffers[k][:n])
            inflight[k] = None

    turn = 0
    for src, dst in pairs:
        src_bytes, dst_bytes = _flat_bytes(src), dst.reshape(-1).view(torch.uint8)
        for start in range(0, int(src_bytes.numel()), size):
            k = turn % len(buffers)
            turn += 1
            drain(k)
            n = min(size, int(src_bytes.numel()) - start)
            buffers[k][:n].copy_(src_bytes[start:start + n], non_blocking=True)
            inflight[k] = (record(), dst_bytes[start:start + n], n)
    for k in sorted(range(len(buffers)), key=lambda k: (k - turn) % len(buffers)):  # oldest first
        drain(k)


class GpuCopy:
    """One rank's copy stream and staging buffers, made at its first snapshot."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def copy(self, pairs, ready) -> None:
        """``pairs`` of (GPU tensor, host destination), on this stream after the event ``ready``."""
        stream = self.stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            staged_copy(pairs, self.buffers, record=stream.record_event, wait=lambda event: event.synchronize())
