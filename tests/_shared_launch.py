"""One torchrun launch per world size for the whole test session (Note [shared launches]).

Note [shared launches]: starting torchrun costs seconds per launch (each worker imports torch,
the ranks rendezvous) and the suite must stay near ten minutes on two cores, so the e2e and
dist modules whose jobs need no restart and no special environment do not launch their own. A
module registers a *preparer*, a function of a fresh folder that compiles or writes its program
folders and returns ``(context, jobs)``; its module fixture asks the session's ``shared_launches``
fixture (tests/conftest.py) for the result. The first such request prepares every registered
module that has a selected test, then runs one ``tests/drivers/run_many.py`` launch per world size, in
the order of WORLD_ORDER (2 first: later worlds may resume checkpoints it wrote). ``--job-logs`` gives
every job its own output files, so a test reads only its own jobs' lines.

To add a job to a shared launch, a test module returns one more ``Job(world, [FOLDER, FLAGS...])``
from its preparer; ``before`` runs right before that job's launch (e.g. to copy a checkpoint the
world-2 launch wrote). Running one test file alone prepares and launches only that file's jobs.
A job with ``restarts=R`` (a ``--fail-at`` kill to resume from) is restarted up to R times on its
own, in forked workers (Note [restarts in a fork] in tests/drivers/run_many.py): it needs no launch of
its own, and its kill neither restarts nor re-runs the other jobs. Those jobs run before every
plain job of their world's launch, so each is forked from a worker that has trained nothing yet.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

from tests.drivers import RUN_MANY
from runtime.launch.torchrun import run_env, torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_ORDER = (2, 3, 4, 1)
PREPARERS: dict[str, Callable] = {}  # "module:function" -> preparer, in import (collection) order


@dataclasses.dataclass
class Job:
    world: int
    args: list  # FOLDER FLAGS... (train.py flags), stringified at launch
    before: Callable[[], None] | None = None
    restarts: int = 0  # > 0: restarted on its own after a failure (Note [restarts in a fork])


@dataclasses.dataclass
class Output:
    """What the workers of one's own jobs printed (every rank, rank order)."""
    stdout: str = ""
    stderr: str = ""

    def __add__(self, other: "Output") -> "Output":
        return Output(self.stdout + other.stdout, self.stderr + other.stderr)


def prepare(fn: Callable) -> Callable:
    """Register ``fn(root: Path) -> (context, list[Job])`` as a module's preparer."""
    PREPARERS[f"{fn.__module__}:{fn.__qualname__}"] = fn
    return fn


class SharedLaunches:
    def __init__(self, root: Path, modules: set[str], timeout_s: float = 900):
        self.root, self.modules, self.timeout_s = root, modules, timeout_s
        self.results: dict[str, tuple] | None = None
        self.launches = 0

    def result(self, fn: Callable):
        """(context, outputs) of ``fn``'s jobs; ``outputs`` has one Output per Job it returned."""
        key = f"{fn.__module__}:{fn.__qualname__}"
        if self.results is None:
            self.results = self._run_all()
        if key not in self.results:  # a module imported after the launch (not collected)
            self.results.update(self._run({key: PREPARERS.get(key, fn)}))
        context, outputs = self.results[key]
        if isinstance(outputs, BaseException):
            raise outputs
        return context, outputs

    def _run_all(self):
        chosen = {k: fn for k, fn in PREPARERS.items() if k.split(":")[0] in self.modules}
        return self._run(chosen)

    def _run(self, preparers: dict[str, Callable]):
        prepared, failed = {}, {}
        for key, fn in preparers.items():
            folder = self.root / key.replace(":", "__")
            folder.mkdir(parents=True, exist_ok=True)
            start_s = time.perf_counter()
            try:
                prepared[key] = fn(folder)
            except Exception as error:  # noqa: BLE001 - that module's tests report it
                failed[key] = error
            self._timed(f"prepare {key}", start_s)
        outputs = {key: [None] * len(jobs) for key, (_, jobs) in prepared.items()}
        worlds = {job.world for _, jobs in prepared.values() for job in jobs}
        for world in [w for w in WORLD_ORDER if w in worlds] + sorted(worlds - set(WORLD_ORDER)):
            mine = []
            # stable: restartable jobs first, then the plain ones, each in module order (Note [restarts in a fork])
            ordered = sorted(((key, i, job) for key, (_, jobs) in prepared.items() for i, job in enumerate(jobs)),
                             key=lambda kij: kij[2].restarts == 0)
            for key, i, job in ordered:
                if job.world != world or key in failed:
                    continue
                try:
                    if job.before is not None:
                        job.before()
                    mine.append((key, i, job))
                except Exception as error:  # noqa: BLE001
                    failed[key] = error
            # A job that fails fails its own module's tests only: the jobs after it (run_many stops
            # there) go again in a new launch, without the failed module's.
            while mine := [(key, i, job) for key, i, job in mine if key not in failed]:
                self.launches += 1
                logs = self.root / f"logs_{self.launches}_world_{world}"
                args = ["--job-logs", str(logs)]
                for n, (_, _, job) in enumerate(mine):
                    prefix = ["--restarts", str(job.restarts)] if job.restarts else []
                    args += ([] if n == 0 else ["--"]) + prefix + [str(a) for a in job.args]
                start_s = time.perf_counter()
                done = subprocess.run(torchrun_command(RUN_MANY, world, args=args), env=run_env(pythonpath=REPO),
                                      capture_output=True, text=True, timeout=self.timeout_s)
                self._timed(f"launch {self.launches} world {world} ({len(mine)} jobs)", start_s)
                if (logs / "timings.txt").exists():
                    with open(self.root / "timings.txt", "a") as out:
                        out.write((logs / "timings.txt").read_text())
                ran = len(mine)
                if done.returncode != 0:  # the failed job is the last one that wrote anything
                    wrote = [n for n in range(len(mine)) if list(logs.glob(f"job_{n}.rank_*"))]
                    torchrun = (f"torchrun (workers before their first job, and the agent):\n{done.stdout[-2000:]}\n"
                                f"{done.stderr[:3000]}\n...\n{done.stderr[-1500:]}")
                    if not wrote:  # the launch itself failed: every module in it reports that
                        for key, _, _ in mine:
                            failed[key] = AssertionError(f"shared world-{world} launch failed before its first "
                                                         f"job:\n{torchrun}")
                        break
                    ran = wrote[-1]
                    key, _, job = mine[ran]
                    out = _read(logs, ran, world)
                    failed[key] = AssertionError(
                        f"shared world-{world} launch failed in job {ran} ({key}: {' '.join(map(str, job.args))}):\n"
                        f"{out.stdout[-3000:]}\n{out.stderr[-6000:]}\n{torchrun}")
                for n, (key, i, _) in enumerate(mine[:ran]):
                    outputs[key][i] = _read(logs, n, world)
                mine = mine[ran:]
        results = {key: (prepared[key][0], outputs[key]) for key in prepared}
        results.update({key: (None, error) for key, error in failed.items()})
        return results


    def _timed(self, what: str, start_s: float) -> None:
        """Where the session's set-up time goes, in ROOT/timings.txt (a slow suite is read from it)."""
        with open(self.root / "timings.txt", "a") as out:
            out.write(f"{time.perf_counter() - start_s:8.1f} s  {what}\n")


def _read(logs: Path, job: int, world: int) -> Output:
    out = Output()
    for rank in range(world):
        for field, suffix in (("stdout", ".out"), ("stderr", ".err")):
            path = logs / f"job_{job}.rank_{rank}{suffix}"
            if path.exists():
                setattr(out, field, getattr(out, field) + path.read_text(errors="replace"))
    return out
