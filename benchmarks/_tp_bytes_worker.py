"""torchrun worker of benchmarks/tensor_parallel.py: trains one program folder (runtime.launch.main,
no checkpoints) with every training step under a dispatch mode that adds up the tensors handed to
torch's functional collectives (the ones DTensor issues for tensor parallelism: all-reduce,
all-gather, reduce-scatter, all-to-all), and writes this rank's bytes per step to OUT/bytes_rank_<r>.json.

    torchrun --nproc-per-node 2 benchmarks/_tp_bytes_worker.py FOLDER OUT STEPS

The pipeline's point-to-point sends, the data-parallel and tie all-reduces and the loss and norm
all-reduces are c10d calls on process groups, not functional collectives: not counted, so the
figure is tensor parallelism's alone.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CollectiveBytes(TorchDispatchMode):
    """Payload bytes (the input tensor's) per functional collective kind."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

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


def main(folder: str, out: str, steps: int) -> None:
    import runtime.launch
    import runtime.train as train

    per_step: list[dict] = []
    original = train.RankTrainer.train_step

    def counted(self, step):
        with CollectiveBytes() as mode:
            loss = original(self, step)
        per_step.append({"bytes": dict(mode.bytes), "calls": dict(mode.calls)})
        return loss

    train.RankTrainer.train_step = counted
    runtime.launch.main(folder, argv=["--steps", str(steps), "--no-checkpoint", "--quiet",
                                      "--run-dir", os.path.join(out, "run")])
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"bytes_rank_{rank}.json"), "w") as f:
        json.dump(per_step, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
