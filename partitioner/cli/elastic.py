"""`partitioner replan DIR --ranks R,..` and `partitioner run DIR --elastic`: a program re-planned for
the ranks left (partitioner/replan.py, Note [re-plan on the same cuts]), and the run that re-plans
by itself when a host is gone for good (runtime/launch/elastic.py, Note [elastic run]).
Registered by commands.py's parser; torch and OR-Tools load only when a command runs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from runtime.launch.run_options import FlagError, RunOptions
from runtime.resilience import exclusion


def add_parser(sub, fmt) -> None:
    r = sub.add_parser("replan", help="re-plan a program folder for the ranks left (no re-trace), beside it",
                       formatter_class=fmt, description="Re-plan the program in DIR for some of its ranks: the same "
                       "stage cuts, recompute and microbatch size; dp, microbatches and schedule chosen again by the "
                       "cost model. Writes the new program folder OUT (default DIR.replanned).")
    r.add_argument("dir", help="program folder (`partitioner compile -o DIR`)")
    r.add_argument("--ranks", required=True, help="the old ranks that are left, comma-separated (e.g. 0,1)")
    r.add_argument("-o", "--out", default=None, help="the new program folder (default DIR.replanned)")
    r.set_defaults(func=cmd_replan)


def cmd_replan(args) -> int:
    from partitioner.replan import ElasticRefusal, replan, write_replanned  # lazy: loads the solver

    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        raise FlagError(f"--ranks {args.ranks}: give the old ranks that are left as whole numbers, e.g. 0,1") from None
    folder = Path(args.dir)
    out = Path(args.out) if args.out else folder.with_name(folder.name + ".replanned")
    if out.is_symlink() or (out.exists() and not out.is_dir()):  # checked before the solver's seconds
        raise FlagError(f"-o {out}: {'a symbolic link' if out.is_symlink() else 'a file'}, not a folder: name a new "
                        f"program folder (default {folder.name}.replanned beside {folder})")
    if out.exists() and not (out / "plan.json").is_file() and any(out.iterdir()):
        raise FlagError(f"-o {out}: a folder that is not a program folder: name a new one (replan replaces only "
                        "an older program folder)")
    try:
        result = replan(folder, ranks)
    except ElasticRefusal as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_replanned(folder, result, out)
    print(f"{result.summary()}: {out}")
    return 0


def check_elastic(folder: Path, options: RunOptions, plan) -> None:
    """What `run --elastic` refuses before any agent starts (one line each, exit 2): among it a job
    where the loss of some one host leaves survivors no re-plan runs on (Note [standing by] in
    runtime/launch/elastic.py: a plan that uses fewer of them is fine)."""
    from partitioner.replan import ElasticRefusal, refusal_for, replan  # lazy: loads the solver
    from runtime.launch.elastic import hosts_and_counts  # lazy: with the solver above, only when asked
    from runtime.resilience import faults  # lazy: as above

    if options.hosts is None:
        raise FlagError("--elastic runs one torchrun agent per host: give --hosts (e.g. --hosts 0,0,1,1)")
    hosts = options.host_list()
    try:
        hosts_and_counts(hosts)
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    if len(set(hosts)) < 2:
        raise FlagError(f"--elastic --hosts {options.hosts}: one host cannot lose a host and go on; give 2 or more")
    why = refusal_for(plan, list(range(plan.world_size)))
    if why:
        raise FlagError(f"--elastic: {why}")
    drilled = {faults.parse_fail_host(text)[0]: text for text in options.fail_host}
    for host in sorted(set(hosts), key=lambda h: (h not in drilled, h)):  # a drilled host's line first
        left = [r for r, h in enumerate(hosts) if h != host]
        why = refusal_for(plan, left)
        if why is None:
            try:
                replan(folder, left)
            except ElasticRefusal as exc:
                why = str(exc)
        if why and host in drilled:
            raise FlagError(f"--fail-host {drilled[host]}: the survivors could not go on: {why}")
        if why:
            raise FlagError(f"--elastic --hosts {options.hosts}: a loss of host {host} would leave rank(s) "
                            f"{','.join(map(str, left))} no plan ({why}); spread the ranks over more hosts in "
                            "--hosts, or run without --elastic")


def run_elastic(folder: Path, options: RunOptions, plan) -> int:
    """One torchrun elastic agent per host, meeting on a rendezvous file (Note [elastic run]);
    cmd_run has called ``check_elastic``."""
    from runtime.launch.elastic import closing_note, run_agents  # lazy: only an elastic run
    from runtime.launch.torchrun import rendezvous_file  # lazy: as above

    if not options.quiet:
        print(f"[run] --elastic: {len(set(options.host_list()))} torchrun agents (--nnodes 1:{len(set(options.host_list()))}),"
              f" hosts {options.hosts}; a host gone for {options.host_timeout or 5:g} s is replaced by a re-plan",
              file=sys.stderr, flush=True)
    prepare_replans(folder, options.host_list())
    run_dir = options.run_dir or str((folder / "run").resolve())
    gone: frozenset[int] = frozenset()
    env: dict[str, str] = {}
    while True:  # a round of agents; another, without the excluded host, after a canary's exclusion
        started = time.time()
        env[exclusion.ROUND_ENV] = repr(started)

        def set_aside(since=started):  # the round is over once rank 0 set aside what the fault touched
            got = exclusion.fresh(run_dir, since)
            return got is not None and got.set_aside

        # a fresh rendezvous file each round, only this user's (Note [no TCP rendezvous on one host])
        code = run_agents(str(folder / "train.py"), options, rendezvous=rendezvous_file(), skip_hosts=gone,
                          env=env, stop_when=set_aside)
        got = exclusion.fresh(run_dir, started)
        if got is None:
            break
        gone, env = _exclude(folder, options, plan, got, gone, run_dir, env)
        if exclusion.EXCLUSION_ENV not in env:
            break
    note = closing_note(run_dir)
    if note:
        print(note, file=sys.stderr, flush=True)
    return code


def _exclude(folder: Path, options: RunOptions, plan, got, gone: frozenset[int], run_dir: str,
             env: dict[str, str]) -> tuple[frozenset[int], dict[str, str]]:
    """After a round a canary's exclusion ended: the hosts left out of the next round and its
    environment (with EXCLUSION_ENV), or the environment without it when the job stops there
    (Note [excluding a host] in runtime/resilience/exclusion.py; the line says why)."""
    from partitioner.replan import refusal_for  # lazy: loads the solver

    hosts = options.host_list()
    drop, line = exclusion.hosts_to_drop(got, hosts, set(gone))
    print(line, file=sys.stderr, flush=True)
    env = {k: v for k, v in env.items() if k != exclusion.EXCLUSION_ENV}
    if drop is None:
        return gone, env
    left = [r for r, h in enumerate(hosts) if h not in gone and h not in drop]
    why = refusal_for(plan, left)
    if why:
        print(f"[run] elastic: the ranks left ({','.join(map(str, left))}) cannot go on: {why}; the job stops "
              f"(exit {exclusion.EXIT_EXCLUDE})", file=sys.stderr, flush=True)
        return gone, env
    kept = exclusion.mark_handled(run_dir, got, drop, left)
    return gone | set(drop), {**env, exclusion.EXCLUSION_ENV: kept}


def prepare_replans(folder: Path, hosts: list[int]) -> None:
    """The re-planned folder for the loss of each one host, written before the agents start (a
    re-plan costs milliseconds here, a worker's `partitioner replan` seconds of imports): a worker
    of the survivors finds it ready (runtime/launch/elastic.py reuses a folder made for its
    survivors). A loss no plan survives is left to the worker, which refuses it then."""
    from partitioner.replan import ElasticRefusal, replan, write_replanned  # lazy: loads the solver

    for host in sorted(set(hosts)):
        alive = sorted(set(hosts) - {host})
        left = [r for r, h in enumerate(hosts) if h != host]
        try:
            result = replan(folder, left)
        except ElasticRefusal:
            continue
        out = folder.resolve().with_name(f"{folder.resolve().name}.elastic-h{'_'.join(map(str, alive))}")
        write_replanned(folder, result, out, reason={"lost_hosts": [host]})
