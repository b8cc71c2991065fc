"""A program folder's one entry point, train.py, and each rank's role computed from plan.json.

One emitter for both writers: partitioner/codegen/folder.py writes train.py for users, and tests
write hand-made folders with the same text (``write_entry_files``) without the compiler, which is
why it lives in runtime. A rank's role (``rank_role``) and the text `partitioner inspect DIR --rank
N` prints of it (``role_text``) are derived from plan.json's "program" object, the one the runtime
builds its process groups from (Note [roles from the plan]).
"""

from __future__ import annotations

import os

from runtime.launch.world import LaunchError
from runtime.launch.torchrun import command_text
from runtime.program.spec import Program

TRAIN_SOURCE = '''"""Train this program. Every rank runs this file, all started at once in this folder:

    {launch} [--steps N]

(or `partitioner run .`). No file here is a rank's: each rank computes its role (its stages, its
pipeline and data-parallel peers, its schedule's actions) from plan.json at start-up;
`partitioner inspect . --rank N` prints rank N's.
"""
import os
import sys

LAUNCH = {launch_literal}
WORLD_SIZE = {world}

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
        sys.exit(f"train.py runs one rank per process under torchrun, and RANK is not set: in {{HERE}}, "
                 f"run: {{LAUNCH}}")
    train(HERE)
'''


# Note [roles from the plan]: a program folder holds per-stage code, plan.json, README.md and one
# train.py: no file per rank (at 16,384 ranks a rank_<r>.py each was 16k files that every node
# copies and reads at start, issue 48). Each rank computes its role (stages, peers, schedule
# actions) from plan.json's program at start-up, as the runtime builds its groups from it;
# `partitioner inspect DIR --rank N` prints any rank's (``role_text``). A folder with rank_<r>.py
# files was written by an older compiler whose train.py runs them: it is refused with the fix,
# recompile (``refuse_old_shape``), never run half-old.

def rank_role(program: Program, rank: int) -> dict[str, object]:
    """Rank ``rank``'s role, from the program alone (Note [roles from the plan])."""
    if not 0 <= rank < program.world_size:
        raise ValueError(f"--rank {rank}: the program has ranks 0..{program.world_size - 1}; pass one of them")
    from runtime.execute.schedule import rank_actions  # lazy: torch.distributed.pipelining, imported when needed

    layout = program.layout
    return {
        "rank": rank,
        "world_size": program.world_size,
        "stages": list(layout.stages_of_rank[rank]),
        "replica": layout.replica_of_rank[rank],
        "pipeline_ranks": layout.pipeline_ranks(rank),
        "data_parallel_ranks": layout.data_parallel_ranks(rank),
        "schedule": program.schedule,
        "num_microbatches": program.num_microbatches,
        "microbatch_size": program.microbatch_size,
        "actions": [list(a) for a in rank_actions(program, rank)],
        "launch": launch_line(program),
    }


def _ranks(ranks: list[int]) -> str:
    """A list of ranks, a long evenly spaced one as first-last/stride (4,096 peers are one line)."""
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(ranks) <= 4 or len(steps) != 1:
        return str(ranks)
    (step,) = steps
    return f"{ranks[0]}-{ranks[-1]}" + (f"/{step}" if step != 1 else "") + f" ({len(ranks)} ranks)"


def role_text(program: Program, rank: int) -> str:
    """`partitioner inspect DIR --rank N`: rank N's role in words and numbers."""
    role = rank_role(program, rank)
    actions = " ".join(f"{kind}{stage}.{mb}" for kind, stage, mb in role["actions"])
    return "\n".join([
        f"rank {rank} of {program.world_size}: stage(s) {role['stages']} of {program.num_stages}, "
        f"data-parallel replica {role['replica']} of {program.dp}; schedule {program.schedule}, "
        f"{program.num_microbatches} microbatches of {program.microbatch_size} per step",
        f"  pipeline peers {_ranks(role['pipeline_ranks'])}: the rank holding each stage of its replica, by stage",
        f"  data-parallel peers {_ranks(role['data_parallel_ranks'])}: the ranks holding its stage(s), one per replica",
        f"  one step, in order (F|B|W stage.microbatch): {actions}",
        f"  every rank starts with: {role['launch']}",
    ])


def launch_text(world_size: int) -> str:
    """The one line that starts every rank of a program folder, typed in the folder: its README and
    train.py both say this one (the rendezvous a private file: Note [no TCP rendezvous on one
    host] in runtime/launch/torchrun.py)."""
    return command_text(world_size, "train.py")


def launch_line(program: Program) -> str:
    return launch_text(program.world_size)


def _literal(value: str) -> str:
    """A string as Python source, in double quotes (house style)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def train_file_text(program: Program) -> str:
    """The exact text of DIR/train.py. Without RANK (not under torchrun) a program of several ranks
    exits non-zero with the torchrun line to use, rather than guessing rank 0 and waiting for peers
    that never come; a one-rank program runs as plain `python train.py`."""
    launch = launch_line(program)
    return TRAIN_SOURCE.format(launch=launch, launch_literal=_literal(launch), world=program.world_size)


def entry_files(program: Program) -> dict[str, str]:
    """{file name: text} of the folder's entry files: train.py alone, whatever the world size
    (Note [roles from the plan]); it names no plan: plan.json's file map ties it to its plan."""
    return {"train.py": train_file_text(program)}


def write_entry_files(folder: str, program: Program) -> None:
    """Write train.py into ``folder`` (hand-made folders in tests)."""
    for name, text in entry_files(program).items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def _old_shape(names) -> list[str]:
    """The per-rank files (rank_<r>.py) among ``names``: the mark of an older compiler's folder."""
    return sorted(n for n in names if n.startswith("rank_") and n.endswith(".py") and n[5:-3].isdigit())


def refuse_old_shape(folder: str, plan: dict | None = None) -> None:
    """LaunchError when ``folder`` holds, or its plan.json lists, per-rank files (Note
    [roles from the plan]): a folder of an older compiler, whose train.py runs them."""
    listed = (plan or {}).get("files") or {}
    found = _old_shape(set(listed) | set(os.listdir(folder) if os.path.isdir(folder) else ()))
    if found:
        raise LaunchError(
            f"{folder} is a program folder of an older partitioner ({len(found)} per-rank file(s) such as "
            f"{found[0]}): this runtime computes each rank's role from plan.json and runs train.py alone; recompile it "
            f"with `partitioner compile ... -o {folder}`")
