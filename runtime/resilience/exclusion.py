"""A compute canary's exclusion (RUN_DIR/exclude.json, Note [compute canaries] in
runtime/resilience/canary.py) turned into a re-plan without the bad host under `run --elastic`.

Note [excluding a host]: a rank blamed twice by the canaries is a persistent compute fault; its
whole host goes, and `run --elastic` re-plans on the others through a lost host's path (Note
[elastic run] in runtime/launch/elastic.py). Three decisions. Only a certain host is excluded:
the rank named alone (3 or more replicas), or the one host holding both ranks of a failing pair
(2 replicas); a pair on two hosts, or an exclusion leaving too few ranks to re-plan, stops with
exit 4 and one line naming the suspects and the fix (dp 3 or more, or --hosts without the bad
one), since dropping both would drop a healthy host on a guess. The state resumed is the newest
checkpoint at or before the last agreeing canary ("good_step"): the fault reaches every replica
through the all-reduce, so anything written after it may hold its effect; newer checkpoints are
set aside and memory slots invalidated, and the relaunch reads the disk (sha256-verified), never
the memory handover (the excluded host's slots are suspect). A worker restarted after the
exclusion (by its agent, or --max-restarts) would train on with the same hosts, so one whose
exclude.json is newer than its round's start leaves at once with exit 4 (``stop_if_excluded``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from runtime.resilience.canary_rules import EXIT_EXCLUDE

EXCLUDE_FILE = "exclude.json"
HANDLED_FILE = "exclude.handled.json"   # what the launcher acted on (a re-plan), kept as the record
ROUND_ENV = "PARTITIONER_ELASTIC_ROUND_UNIX"     # when the launcher started this round of agents
EXCLUSION_ENV = "PARTITIONER_ELASTIC_EXCLUSION"  # the handled exclusion a relaunch recovers by


@dataclass(frozen=True)
class Exclusion:
    """RUN_DIR/exclude.json as the launcher and the relaunched workers read it."""
    ranks: tuple[int, ...]
    hosts: tuple[int, ...]
    certain: bool
    step: int
    good_step: int          # the last agreeing canary's step: nothing newer is resumed
    set_aside: bool         # rank 0 moved what is newer aside (``set_aside``)
    time_unix: float


def load(path: str) -> Exclusion | None:
    try:
        with open(path) as fh:
            body = json.load(fh)
        return Exclusion(tuple(int(r) for r in body["exclude_ranks"]),
                         tuple(int(h) for h in body.get("hosts_of_ranks") or ()), bool(body.get("certain")),
                         int(body["step"]), int(body.get("good_step", 0)), bool(body.get("set_aside")),
                         float(body.get("time_unix", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fresh(run_dir: str, since_unix: float) -> Exclusion | None:
    """RUN_DIR/exclude.json when written at or after ``since_unix``."""
    path = os.path.join(run_dir, EXCLUDE_FILE)
    try:
        if os.stat(path).st_mtime < since_unix:
            return None
    except OSError:
        return None
    return load(path)


def hosts_to_drop(exc: Exclusion, hosts: list[int], gone: set[int]) -> tuple[list[int] | None, str]:
    """The hosts to leave out of the next round, and the line saying so; (None, why) when the
    exclusion cannot be acted on (Note [excluding a host])."""
    ranks = ", ".join(map(str, exc.ranks))
    where = ", ".join(map(str, exc.hosts)) or "?"
    if not exc.certain and len(exc.hosts) > 1:  # both ranks of a pair, on two hosts
        return None, (f"[run] elastic: the compute canary named ranks {ranks} (hosts {where}) at step {exc.step}, "
                      "but with 2 replicas either may be the faulty one: no host is excluded on a guess; the job "
                      f"stops (exit {EXIT_EXCLUDE}); recompile with dp 3 or more for a certain blame, or rerun "
                      "--hosts without the host you believe bad")
    if not exc.hosts:
        return None, (f"[run] elastic: {EXCLUDE_FILE} names ranks {ranks} but not their hosts: nothing to leave "
                      f"out; the job stops (exit {EXIT_EXCLUDE})")
    left = sorted(set(hosts) - gone - set(exc.hosts))
    if not left:
        return None, (f"[run] elastic: the compute canary excluded ranks {ranks} on host(s) {where}, and no "
                      f"other host is left; the job stops (exit {EXIT_EXCLUDE})")
    which = "" if exc.certain else " (one of them: both on this host)"
    return list(exc.hosts), (f"[run] elastic: host(s) {where} excluded: the compute canary caught rank(s) {ranks}"
                             f"{which} computing wrongly again after a rollback (step {exc.step}); re-planning onto "
                             f"host(s) {','.join(map(str, left))} from the checkpoint at or before step "
                             f"{exc.good_step} (the last agreeing canary)")


def mark_handled(run_dir: str, exc: Exclusion, dropped: list[int], survivors: list[int]) -> str:
    """Keep exclude.json as exclude.handled.json (a fresh exclude.json is the next round's) and
    append the "exclusion" row to RUN_DIR/recovery.jsonl; returns the kept file's path."""
    kept = os.path.join(run_dir, HANDLED_FILE)
    os.replace(os.path.join(run_dir, EXCLUDE_FILE), kept)
    row = {"kind": "exclusion", "excluded_ranks": list(exc.ranks), "excluded_hosts": dropped,
           "survivors": survivors, "detected_step": exc.step, "good_step": exc.good_step,
           "reason": "compute canary mismatch after a rollback", "time_unix": time.time()}
    with open(os.path.join(run_dir, "recovery.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return kept


class ExcludeRanks(Exception):
    """Every rank leaves with ``exit_code``: ranks computed wrongly, set aside after ``good_step``."""

    exit_code = EXIT_EXCLUDE
    good_step = 0


class ExcludedRound(Exception):
    """A restarted worker of a round an exclusion ended: it leaves with exit 4, quietly."""

    exit_code = EXIT_EXCLUDE  # runtime/launch/rank.py's main leaves with it


def stop_if_excluded(run_dir: str) -> None:
    """In an elastic worker: refuse to train on a round an exclusion has ended (Note [excluding a host])."""
    since = os.environ.get(ROUND_ENV)
    if since and fresh(run_dir, float(since)) is not None:
        if os.environ.get("RANK") == "0":
            print(f"[rank 0] {os.path.join(run_dir, EXCLUDE_FILE)} ended this round: not training on with the "
                  "same hosts (the launcher re-plans)", flush=True)
        raise ExcludedRound(run_dir)


def set_aside(ckpt_dir: str, good_step: int, rank: int, run_dir: str, checkpointer, memory) -> None:
    """Every rank, after a canary's exclusion: nothing newer than ``good_step`` stays restorable
    (Note [excluding a host]). Collective."""
    import torch.distributed as dist  # lazy: loads torch

    from runtime.resilience.recovery import set_aside_newer  # lazy: loads torch

    if checkpointer is not None:
        checkpointer.settle()
    if memory is not None:
        memory.settle()
        memory.store.invalidate_newer(good_step)
    dist.barrier()  # every rank's persist ended before rank 0 moves the step folders
    if rank == 0:
        set_aside_newer(ckpt_dir, good_step, rank)
        path = os.path.join(run_dir, EXCLUDE_FILE)
        with open(path) as fh:
            body = json.load(fh)
        body["set_aside"] = True
        with open(path + ".tmp", "w") as fh:
            json.dump(body, fh, indent=1)
        os.replace(path + ".tmp", path)
    dist.barrier()
