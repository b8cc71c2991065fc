"""The text of a program folder's entry files: rank_<r>.py (one rank's program) and train.py (the
torchrun entry that picks rank_<RANK>.py).

One emitter for both writers: partitioner/codegen/folder.py writes these files for users, and tests
write hand-made folders with the same text (``write_entry_files``) without the compiler, which is
why it lives in runtime. Everything is derived from plan.json's "program" object, so the rank
layout said in a file's header is the one the runtime builds its process groups from.
"""

from __future__ import annotations

import os

from runtime.errors import PlanMismatchError
from runtime.launch.torchrun import command_text
from runtime.program.spec import Program
from runtime.program.user_code import import_path

TRAIN_SOURCE = '''"""torchrun entry: every process runs the rank_<RANK>.py program of its rank. Start every
rank at once, in this folder (or `partitioner run .`):

    {launch} [--steps N]
"""
import os
import sys

LAUNCH = {launch_literal}

# This folder is data, not an import root: `python train.py` put it first on sys.path, where a
# stray torch.py or runtime/ here would shadow the installed packages (docs/design.md §12).
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

import runpy
from pathlib import Path

if __name__ == "__main__":
    folder = Path(__file__).resolve().parent
    rank = os.environ.get("RANK")
    if rank is None:  # started by hand: without torchrun no rank would meet its peers
        sys.exit(f"train.py runs one rank per process under torchrun, and RANK is not set: in {{folder}}, "
                 f"run: {{LAUNCH}}")
    runpy.run_path(str(folder / f"rank_{{int(rank)}}.py"), run_name="__main__")
'''


# Note [rank file constants]: rank_<r>.py states, as Python constants, what the runtime uses for
# its rank, all derived from plan.json's program (``rank_constants``); runtime/launch/rank.py recomputes
# them at start-up and refuses a rank file that says otherwise (``check_rank_file``). The file
# hashes in plan.json already refuse an edited file; this check keeps the rank file a true
# statement of the program, hand-written folders included.

RANK_FILE_HEADER = """\
# What this rank runs, as constants. runtime.launch.rank recomputes every one of them from plan.json's
# "program" object at start-up and refuses to start (PlanMismatchError naming the constant and both
# values) if this file says otherwise; the program itself is runtime.program.spec.Program.
#   STAGES               the stages this rank holds (several under the interleaved schedule)
#   PIPELINE_RANKS       the rank holding each stage of this rank's replica, by stage: its pipeline peers
#   DATA_PARALLEL_RANKS  the ranks holding the same stage(s), one per replica: its data-parallel peers
#   ACTIONS              one step of its schedule, (F|B, stage, microbatch) in execution order
#   NUM_MICROBATCHES, MICROBATCH_SIZE  per replica and step; samples per microbatch
#   LAUNCH               the command that starts every rank (run it in this folder)
"""


def rank_constants(program: Program, rank: int, *, actions: list | None = None) -> dict[str, object]:
    """The constants of rank_<rank>.py, in file order (Note [rank file constants]). ``actions``:
    the rank's schedule row when the caller has it (``entry_files`` computes each once)."""
    if actions is None:
        from runtime.execute.schedule import rank_actions  # lazy: torch.distributed.pipelining, imported when needed

        actions = rank_actions(program, rank)
    layout = program.layout
    return {
        "RANK": rank,
        "WORLD_SIZE": program.world_size,
        "STAGES": list(layout.stages_of_rank[rank]),
        "REPLICA": layout.replica_of_rank[rank],
        "PIPELINE_RANKS": layout.pipeline_ranks(rank),
        "DATA_PARALLEL_RANKS": layout.data_parallel_ranks(rank),
        "SCHEDULE": program.schedule,
        "NUM_MICROBATCHES": program.num_microbatches,
        "MICROBATCH_SIZE": program.microbatch_size,
        "ACTIONS": [tuple(a) for a in actions],
        "LAUNCH": launch_line(program),
    }


def launch_text(world_size: int) -> str:
    """The one line that starts every rank of a program folder, typed in the folder: its README,
    train.py and rank files all say this one (the rendezvous a private file: Note [no TCP
    rendezvous on one host] in runtime/launch/torchrun.py)."""
    return command_text(world_size, "train.py")


def launch_line(program: Program) -> str:
    return launch_text(program.world_size)


def _literal(value: object) -> str:
    """A constant as Python source, strings in double quotes (house style)."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "(" + ", ".join(_literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _actions_source(actions: list[tuple]) -> list[str]:
    """ACTIONS over several lines, eight actions a line."""
    if not actions:
        return ["ACTIONS = []"]
    lines = ["ACTIONS = ["]
    for i in range(0, len(actions), 8):
        lines.append("    " + ", ".join(_literal(a) for a in actions[i:i + 8]) + ",")
    lines.append("]")
    return lines


def rank_file_text(program: Program, rank: int, plan_hash: str | None = None) -> str:
    """The exact text of DIR/rank_<rank>.py: what the rank runs (``rank_constants``), one call
    into runtime.launch.rank. ``plan_hash`` defaults to the program's own."""
    return _rank_file_text(program, rank, plan_hash, rank_constants(program, rank), None)


def _rank_file_text(program: Program, rank: int, plan_hash: str | None, c: dict[str, object],
                    actions_source: list[str] | None) -> str:
    """``rank_file_text`` from its constants ``c``; ``actions_source``: ACTIONS's lines when the
    caller has rendered them (Note [rank files by position])."""
    world = program.world_size
    body = []
    for name, value in c.items():
        if name == "ACTIONS":
            body.extend(actions_source if actions_source is not None else _actions_source(value))
        else:
            body.append(f"{name} = {_literal(value)}")
    return "\n".join([
        f'"""Rank {rank} of {world}: stage(s) {c["STAGES"]} of {program.num_stages}, '
        f'data-parallel replica {c["REPLICA"]} of {program.dp}.',
        "",
        f"Generated by partitioner from plan {plan_hash or program.plan_hash}. "
        "Run every rank at once with torchrun:",
        f"    {c['LAUNCH']}",
        '"""',
        RANK_FILE_HEADER.rstrip("\n"),
        "import os",
        "import sys",
        "",
        "# This folder is not an import root (docs/design.md §12): drop it before importing runtime.",
        "sys.path[:] = [p for p in sys.path",
        "               if os.path.realpath(p or os.curdir) != os.path.dirname(os.path.realpath(__file__))]",
        "",
        "import runtime.launch.rank",
        "",
        *body,
        "",
        "",
        'if __name__ == "__main__":',
        "    runtime.launch.rank.main(os.path.dirname(os.path.abspath(__file__)), rank=RANK)",
        "",
    ])


def check_rank_file(folder: str, program: Program, rank: int) -> None:
    """Refuse to start when rank_<rank>.py's constants disagree with the program (Note [rank
    file constants]): PlanMismatchError naming each constant and both values."""
    path = os.path.join(folder, f"rank_{rank}.py")
    if not os.path.isfile(path):
        raise PlanMismatchError(f"{path} is missing: every rank of a program folder has its rank file; "
                                "recompile, or write it with runtime.launch.entry_files.write_entry_files")
    module = import_path(path)
    wrong = []
    for name, want in rank_constants(program, rank).items():
        got = getattr(module, name, "<not set>")
        if _plain(got) != _plain(want):
            wrong.append(f"{name} = {_short(got)} but plan.json's program gives {_short(want)}")
    if wrong:
        raise PlanMismatchError(f"{path} does not state the program of rank {rank}: " + "; ".join(wrong)
                                + "; recompile, or rewrite the rank files with "
                                "runtime.launch.entry_files.write_entry_files")


def _plain(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _short(value: object) -> str:
    text = _literal(value) if isinstance(value, (list, tuple, str, int)) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def train_file_text(program: Program) -> str:
    """The exact text of DIR/train.py. Without RANK (not under torchrun) it exits non-zero with the
    torchrun line to use, rather than guessing rank 0 and waiting for peers that never come."""
    launch = launch_line(program)
    return TRAIN_SOURCE.format(launch=launch, launch_literal=_literal(launch))


# Note [rank files by position]: a rank's ACTIONS are its pipeline position's row of the schedule,
# the same for the dp x tp ranks of that position; at 16,384 ranks asking the schedule for every
# position's row once per rank, and rendering each row once per rank, was most of writing the
# folder (issue 48). ``entry_files`` asks once and renders once per position; the texts are the
# ones ``rank_file_text`` gives, byte for byte.
def entry_files(program: Program, plan_hash: str | None = None) -> dict[str, str]:
    """{file name: text} of every rank_<r>.py and train.py."""
    from runtime.execute.schedule import _rank_orders  # lazy: torch.distributed.pipelining, imported when needed

    layout = program.layout
    orders = _rank_orders(program.schedule, layout.pp_size, program.num_stages, program.num_microbatches)
    position_of_rank = {r: pos for pipeline in layout.pipelines for pos, r in enumerate(pipeline)}
    rendered: dict[int, list[str]] = {}
    files = {}
    for r in range(program.world_size):
        pos = position_of_rank[r]
        c = rank_constants(program, r, actions=orders[pos])
        if pos not in rendered:
            rendered[pos] = _actions_source(c["ACTIONS"])
        files[f"rank_{r}.py"] = _rank_file_text(program, r, plan_hash, c, rendered[pos])
    files["train.py"] = train_file_text(program)
    return files


def write_entry_files(folder: str, program: Program, plan_hash: str | None = None) -> None:
    """Write rank_<r>.py for every rank and train.py into ``folder`` (hand-made folders in tests)."""
    for name, text in entry_files(program, plan_hash).items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
