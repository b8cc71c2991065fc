"""README.md of the program folder: how to run it here and on a cluster (docs/design.md §6)."""

from __future__ import annotations

from partitioner.plan import Plan


def readme_source(plan: Plan, plan_hash: str) -> str:
    n = plan.world_size
    nodes = 2 if n % 2 == 0 else 1
    return f"""# Generated training program: {plan.workload}

Plan `{plan_hash}`: {plan.num_stages} pipeline stage(s) × {plan.dp} data-parallel replica(s) = {n} ranks,
{plan.num_microbatches} microbatches of {plan.microbatch_size} per step ({plan.global_batch} samples),
schedule `{plan.schedule}`, predicted step time {plan.predicted.get("step_time_s", 0):.4g} s.

## Run on this machine

    partitioner run .            # or:
    torchrun --standalone --nproc-per-node {n} train.py --steps 20

## Run on N nodes

Split the {n} ranks evenly over nodes (e.g. {nodes} node(s) × {n // nodes}), and on every node run

    torchrun --nnodes {nodes} --nproc-per-node {n // nodes} --node-rank $NODE_RANK \\
             --rdzv-backend c10d --rdzv-endpoint $MASTER_HOST:$MASTER_PORT train.py --steps 20 \\
             --checkpoint-dir /shared/ckpt

with MASTER_PORT a free port on MASTER_HOST and the checkpoint folder on a filesystem every node
mounts: on node-local disks no checkpoint is complete and every restart begins at step 0 (the run
says so at start-up). torch's stores listen on every interface and do not
authenticate: run across nodes only on a network where every host is trusted. `partitioner run`
and `train.py` execute this folder's code: run only folders you trust.

## Files

- `plan.json`: the plan, the program the runtime reads, and the sha256 of every file below.
- `stage_<k>.py`: each stage's forward, one statement per op, with the model's source lines as comments.
- `rank_<r>.py`: which stages a rank holds and its peers.
- `weights/stage_<k>.safetensors`: initial parameters by their original names.
- `user/`: the file(s) of your make_batch and loss, when they are no installed module: the ranks import this copy.
"""
