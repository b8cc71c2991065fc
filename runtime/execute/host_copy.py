"""Device tensors brought to the host with one wait, not one per tensor (Note [one wait per snapshot]):
what a checkpoint's snapshot and a run's final save take of the trainer.

Note [one wait per snapshot]: a disk checkpoint's stall is its host copy (``snapshot``). On a GPU,
``t.to("cpu")`` per tensor waits for each copy in turn into pageable memory (staged by the driver,
about half the speed of pinned), and ``float(step)`` per parameter waits once more per parameter
(fused AdamW keeps ``step`` on the GPU). So a CUDA tensor is copied into pinned host memory with
``non_blocking=True`` (torch's pinned-memory cache keeps the blocks for the next snapshot), the
steps are read in one transfer, and the snapshot waits once for all of it. A CPU tensor is
cloned as before: the same bytes, the same files.
"""

from __future__ import annotations

import torch


def step_values(steps) -> dict[str, float]:
    """name -> AdamW's step as a float, for ``(name, step)`` pairs whose step is a number or a
    tensor (Note [one wait per snapshot]): the steps on a GPU (fused AdamW keeps them there) are
    read in one transfer, not one synchronization per parameter; the floats are ``float(step)``'s."""
    steps = list(steps)
    on_device = [(n, v) for n, v in steps if isinstance(v, torch.Tensor) and v.device.type != "cpu"]
    read = {}
    if on_device:  # float64 holds a float32 or an integer step exactly
        read = dict(zip([n for n, _ in on_device],
                        torch.stack([v.detach().reshape(()).to(torch.float64) for _, v in on_device]).tolist()))
    return {n: read[n] if n in read else float(v) for n, v in steps}


def host_copies(entries) -> dict[str, torch.Tensor]:
    """Each ``(name, tensor)`` copied to host memory, by name (Note [one wait per snapshot])."""
    out: dict[str, torch.Tensor] = {}
    waits = set()
    with torch.no_grad():
        for name, t in entries:
            if t.device.type == "cuda":
                out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out[name].copy_(t, non_blocking=True)
                waits.add(t.device)
            else:
                out[name] = t.to("cpu", copy=True)
    for device in waits:  # the copies were queued on the current stream: one wait for all of them
        torch.cuda.current_stream(device).synchronize()
    return out
