"""README.md of the program folder: how to run it here and on a cluster (docs/design.md §6)."""

from __future__ import annotations

from partitioner.solver.plan import Plan
from runtime.launch.signed_rendezvous import BACKEND, KEY_ENV
from runtime.launch.entry_files import launch_text


def readme_source(plan: Plan, plan_hash: str) -> str:
    n = plan.world_size
    nodes = 2 if n % 2 == 0 else 1
    return f"""# Generated training program: {plan.workload}

Plan `{plan_hash}`: {plan.num_stages} pipeline stage(s) × {plan.dp} data-parallel replica(s) = {n} ranks,
{plan.num_microbatches} microbatches of {plan.microbatch_size} per step ({plan.global_batch} samples),
schedule `{plan.schedule}`, predicted step time {plan.predicted.get("step_time_s", 0):.4g} s.

## Run on this machine

    partitioner run .            # or:
    {launch_text(n)} --steps 20

(its rendezvous a file in a fresh private folder: torch's `--standalone` serves one on TCP that
any local user can write, and what it holds is a pickle the agent loads).

## Run on N nodes

Split the {n} ranks evenly over nodes (e.g. {nodes} node(s) × {n // nodes}), and on every node run

    python -m runtime.launch.signed_rendezvous --nnodes {nodes} --nproc-per-node {n // nodes} \\
             --node-rank $NODE_RANK --rdzv-backend {BACKEND} \\
             --rdzv-endpoint $MASTER_HOST:$MASTER_PORT train.py --steps 20 --checkpoint-dir /shared/ckpt

with the same {KEY_ENV} exported on every node (a secret: `python3 -c 'import secrets;
print(secrets.token_hex(32))'`), MASTER_PORT a free port on MASTER_HOST and the checkpoint folder
on a filesystem every node mounts: on node-local disks no checkpoint is complete and every restart
begins at step 0 (the run says so at start-up). The key signs torch's rendezvous state, so no other
host can plant a pickle there; torch's stores and transports still listen on every interface
unauthenticated: run across nodes only on a network where every host is trusted. `partitioner run`
and `train.py` execute this folder's code: run only folders you trust.

{_node_section(plan)}## Files

- `plan.json`: the plan, the program the runtime reads, and the sha256 of every file below.
- `stage_<k>.py`: each stage's forward, one statement per op, with the model's source lines as comments.
- `train.py`: the one entry point every rank runs; each rank computes its role (stages, peers,
  schedule) from `plan.json`, and `partitioner inspect . --rank N` prints rank N's.
- `weights/stage_<k>.safetensors`: initial parameters by their original names.
- `user/`: the file(s) of your make_batch and loss, when they are no installed module: the ranks import this copy.
"""


def _node_section(plan: Plan) -> str:
    """Which ranks each cluster node runs, when the plan spans several (Note [exact placements]
    in partitioner/solver/placements.py): torchrun gives node-rank k the k-th block of ranks."""
    node_of_rank: dict[int, int] = {}
    kind_of_rank: dict[int, str] = {}
    for stage in plan.stages:
        for rank, node in zip(stage.ranks, stage.nodes):
            node_of_rank[rank], kind_of_rank[rank] = node, stage.device
    if len(set(node_of_rank.values())) < 2:
        return ""
    blocks: list[tuple[int, list[int]]] = []
    for rank in sorted(node_of_rank):
        if blocks and blocks[-1][0] == node_of_rank[rank]:
            blocks[-1][1].append(rank)
        else:
            blocks.append((node_of_rank[rank], [rank]))
    lines = ["## Where the ranks run", "",
             "The plan puts each rank on a device of a given cluster node (its links and speed are what the",
             "plan was solved for). Start the node of each row with its --node-rank and --nproc-per-node:", ""]
    for k, (node, ranks) in enumerate(blocks):
        kinds = ", ".join(kind_of_rank[r] for r in ranks)
        lines.append(f"- cluster node {node}: --node-rank {k} --nproc-per-node {len(ranks)}, ranks "
                     f"{ranks[0]}..{ranks[-1]} on its first {len(ranks)} device(s) ({kinds})")
    return "\n".join(lines) + "\n\n"
