"""Fault injection for recovery tests: ``--fail-at RANK:STEP[:exit|kill|hang]`` and
``--fail-persist RANK:STEP:BYTES``.

Faults fire only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT unset or 0),
so the restarted workers run clean. ``--fail-at`` fires on rank RANK just before it starts step
STEP (0-based, = make_batch's step): "exit" leaves with os._exit(3), "kill" sends itself SIGKILL,
"hang" sleeps forever (its peers fail through the collective timeout, then torchrun's agent stops
it). ``--fail-persist`` SIGKILLs rank RANK after writing BYTES bytes while persisting the
checkpoint of step STEP (steps done), through ``runtime.checkpoint.FaultPoint``.
Before dying, a fault appends {"rank", "step", "mode", "time_unix"} to RUN_DIR/faults.jsonl (how
benchmarks measure the time from a kill to the first resumed step).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass

MODES = ("exit", "kill", "hang")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    mode: str = "kill"


@dataclass(frozen=True)
class PersistFault:
    rank: int
    step: int
    after_bytes: int


def parse_fail_at(text: str) -> Fault:
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        mode = parts[2] if len(parts) == 3 else "kill"
        fault = Fault(int(parts[0]), int(parts[1]), mode)
    except ValueError:
        raise ValueError(f"--fail-at {text!r}: write RANK:STEP[:MODE], e.g. 1:5:kill") from None
    if mode not in MODES:
        raise ValueError(f"--fail-at {text!r}: mode {mode!r} is not one of {MODES}")
    return fault


def parse_fail_persist(text: str) -> PersistFault:
    try:
        rank, step, nbytes = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--fail-persist {text!r}: write RANK:STEP:BYTES, e.g. 0:4:1000") from None
    return PersistFault(rank, step, nbytes)


def first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


def record(run_dir: str | None, rank: int, step: int, mode: str) -> None:
    if not run_dir:
        return
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "faults.jsonl"), "a") as fh:
            fh.write(json.dumps({"rank": rank, "step": step, "mode": mode, "time_unix": time.time()}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError:
        pass


def fire(fault: Fault, run_dir: str | None = None) -> None:
    """Die (or hang) the way ``fault`` says."""
    record(run_dir, fault.rank, fault.step, fault.mode)
    print(f"[rank {fault.rank}] fault injection: {fault.mode} before step {fault.step}",
          file=sys.stderr, flush=True)
    if fault.mode == "exit":
        os._exit(3)
    if fault.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    while True:  # hang
        time.sleep(3600)


def step_hook(faults: list[Fault], rank: int, run_dir: str | None = None):
    """A ``before_step(step)`` callable for RankTrainer.run, or None when nothing can fire."""
    mine = {f.step: f for f in faults if f.rank == rank}
    if not mine or not first_attempt():
        return None

    def before_step(step: int) -> None:
        if step in mine:
            fire(mine[step], run_dir)

    return before_step
