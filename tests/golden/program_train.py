"""Train this program. Every rank runs this file, all started at once in this folder:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-conf store_type=file --rdzv-endpoint "$(mktemp -d)/rdzv" --local-addr 127.0.0.1 train.py [--steps N]

(or `partitioner run .`). No file here is a rank's: each rank computes its role (its stages, its
pipeline and data-parallel peers, its schedule's actions) from plan.json at start-up;
`partitioner inspect . --rank N` prints rank N's.
"""
import os
import sys

LAUNCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-conf store_type=file --rdzv-endpoint \"$(mktemp -d)/rdzv\" --local-addr 127.0.0.1 train.py"
WORLD_SIZE = 2

# This folder is data, not an import root: `python train.py` put it first on sys.path, where a
# stray torch.py or runtime/ here would shadow the installed packages (docs/design.md §12).
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

import runtime.launch.rank


def train(folder: str) -> None:
    """What this rank runs, in order; runtime.launch.rank.main(folder) does each part:

    1. start-up: plan.json read and every file's sha256 checked (runtime.program.spec.load_program);
       this rank's role computed from it (runtime.program.layout.Layout, runtime.execute.schedule.rank_actions);
       its process groups joined (runtime.parallel.grad_sync.create_groups); its stages built from
       stage_<k>.py and weights/ (runtime.execute.train.RankTrainer)
    2. recovery: the newest committed checkpoint in checkpoints/ restored, else step 0
       (runtime.resilience.recovery.recover)
    3. the steps, up to --steps: the schedule's forward and backward actions over the microbatches,
       gradients summed over the data-parallel peers, one optimizer step (RankTrainer.run)
    4. checkpoints: after the steps the cadence picks, every rank's shard written and committed
       together (runtime.resilience.checkpoint.Checkpointer.after_step)
    5. end: the last checkpoint committed, the final weights in run/final/, metrics in
       run/metrics.jsonl, the process groups released (RankTrainer.save_final)
    """
    runtime.launch.rank.main(folder)


if __name__ == "__main__":
    if "RANK" not in os.environ and WORLD_SIZE > 1:  # without torchrun no rank would meet its peers
        sys.exit(f"train.py runs one rank per process under torchrun, and RANK is not set: in {HERE}, "
                 f"run: {LAUNCH}")
    train(HERE)
