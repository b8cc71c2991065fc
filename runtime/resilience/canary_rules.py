"""What a compute canary (Note [compute canaries] in runtime/resilience/canary.py) runs with, torch-free:
`partitioner compile`, `partitioner run` and every rank refuse the same programs with the same line."""

from __future__ import annotations

import os
import sys

from runtime.program.schedules import PipelineSchedule, schedule_named

EXIT_EXCLUDE = 4  # a rank blamed twice: the job stops for a re-plan without it (RUN_DIR/exclude.json)


def refusal(every: int, *, dp: int, tensor_parallel: int = 1, local_stages: int = 1, sharded: bool = False,
            schedule: PipelineSchedule | None = None, what: str | None = None) -> str | None:
    """Why a program cannot run a canary every ``every`` steps exactly, naming the value and the fix;
    None when it can (or ``every`` is 0). ``what``: how the value was given (default the run flag);
    ``schedule``: the program's (its own refusal), else ``local_stages`` alone decides."""
    if not every:
        return None
    what = what or f"--sdc-canary-every {every}"
    if every < 0:
        return f"{what}: give a number of steps >= 1, or 0 (no canaries)"
    if dp < 2:
        return (f"{what}: the program has dp 1, no second replica to re-run a stage on: recompile with --dp 2 "
                "(and --devices twice its ranks), or drop it")
    if tensor_parallel > 1:
        return (f"{what}: a canary re-runs a whole stage on one rank, and this program splits each stage over "
                f"tensor groups of {tensor_parallel}: recompile with --tp 1, or drop it")
    if schedule is not None and (why := schedule.canary_refusal(what)):
        return why
    if local_stages > 1:
        return (f"{what}: a canary re-runs the one stage of a rank, and the interleaved schedule puts "
                f"{local_stages} on each: recompile with --schedule 1f1b or gpipe, or drop it")
    if sharded:
        return (f"{what}: with sharded optimizer state (ZeRO-1) a canary's rollback is not built: recompile with "
                "--shard-optimizer off, or drop it")
    return None


def program_refusal(program: dict, every: int, what: str | None = None) -> str | None:
    """``refusal`` for plan.json's "program" object (a dict, as `partitioner run` reads it)."""
    if not every:
        return None
    dp = int(program.get("dp", 1))
    stages, world = int(program.get("num_stages", 1)), int(program.get("world_size", 1))
    tp = int(program.get("tensor_parallel", 1) or 1)
    ranks_per_pipeline = max(1, world // max(1, dp * tp))
    local_stages = max(1, stages // ranks_per_pipeline)
    schedule = schedule_named(str(program.get("schedule", "1f1b")), local_stages)  # plan.json's edge: a bad name says so
    return refusal(every, dp=dp, tensor_parallel=tp, local_stages=local_stages,
                   sharded=bool(program.get("shard_optimizer")) and dp > 1, schedule=schedule, what=what)


def exit_code_after(run_dir: str, returncode: int, started_unix: float, said: bool = False) -> int:
    """`partitioner run`'s exit code after torchrun returned ``returncode``: EXIT_EXCLUDE, said in one
    line, when the job stopped because a canary wrote RUN_DIR/exclude.json during this run (torchrun
    itself exits 1 whatever its workers' codes); else ``returncode``. ``said``: the elastic launcher
    already said why it stopped (an exclusion it could not act on: no re-plan follows), so no line."""
    path = os.path.join(run_dir, "exclude.json")
    try:
        fresh = returncode != 0 and os.stat(path).st_mtime >= started_unix
    except OSError:
        fresh = False
    if not fresh:
        return returncode
    if said:
        return EXIT_EXCLUDE
    print(f"[run] stopped for a re-plan: {path} names the rank(s) a compute canary caught twice "
          f"(exit {EXIT_EXCLUDE})", file=sys.stderr, flush=True)
    return EXIT_EXCLUDE
