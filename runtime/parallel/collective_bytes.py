"""Counting what tensor parallelism sends: a dispatch mode that adds up the tensors handed to
torch's functional collectives (the ones DTensor issues: all-reduce, all-gather, reduce-scatter,
all-to-all) by kind. benchmarks/tensor_parallel.py runs training steps under it and
tests/unit/test_tp_traffic.py a stage's forward and backward, to compare with the cost model's
figures (Note [tensor-parallel traffic] in passes/tp_roles.py).

The pipeline's point-to-point sends and the data-parallel, tie, loss and norm all-reduces are
c10d calls on process groups, not functional collectives: not counted.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Bytes one member sends under ring algorithms, per byte of the collective's input (tp members).
def ring_factor(kind: str, tp: int) -> float:
    """all-reduce of n bytes: 2 (tp-1)/tp n; all-gather of each member's c bytes: (tp-1) c;
    reduce-scatter of n bytes: (tp-1)/tp n."""
    if kind.startswith("all_reduce"):
        return 2 * (tp - 1) / tp
    if kind.startswith("all_gather"):
        return float(tp - 1)
    if kind.startswith("reduce_scatter"):
        return (tp - 1) / tp
    raise ValueError(f"no ring figure for collective {kind}: add it to runtime/parallel/collective_bytes.py")


class CollectiveBytes(TorchDispatchMode):
    """Payload bytes (the input tensors') and calls per functional collective kind."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar the op into local ops and collectives first
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        kind = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and kind.startswith(("all_", "reduce_", "broadcast")):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            self.bytes[kind] = self.bytes.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors)
            self.calls[kind] = self.calls.get(kind, 0) + 1
        return func(*args, **kwargs)

    def sent_bytes(self, tp: int) -> float:
        """What one member sent under ring algorithms."""
        return sum(ring_factor(kind, tp) * n for kind, n in self.bytes.items())
