"""torchrun worker of benchmarks/tensor_parallel.py: trains one program folder (runtime.launch.rank.main,
no checkpoints) with every training step under a dispatch mode that adds up the tensors handed to
torch's functional collectives (the ones DTensor issues for tensor parallelism: all-reduce,
all-gather, reduce-scatter, all-to-all; runtime/parallel/collective_bytes.py), and writes this rank's bytes
per step to OUT/bytes_rank_<r>.json.

    torchrun --nproc-per-node 2 benchmarks/_tp_bytes_worker.py FOLDER OUT STEPS

The pipeline's point-to-point sends, the data-parallel and tie all-reduces and the loss and norm
all-reduces are c10d calls on process groups, not functional collectives: not counted, so the
figure is tensor parallelism's alone.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.parallel.collective_bytes import CollectiveBytes  # noqa: E402


def main(folder: str, out: str, steps: int) -> None:
    import runtime.launch.rank
    import runtime.execute.train as train

    per_step: list[dict] = []
    original = train.RankTrainer.train_step

    def counted(self, step):
        with CollectiveBytes() as mode:
            loss = original(self, step)
        per_step.append({"bytes": dict(mode.bytes), "calls": dict(mode.calls)})
        return loss

    train.RankTrainer.train_step = counted
    runtime.launch.rank.main(folder, argv=["--steps", str(steps), "--no-checkpoint", "--quiet",
                                      "--run-dir", os.path.join(out, "run")])
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"bytes_rank_{rank}.json"), "w") as f:
        json.dump(per_step, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
