"""`partitioner run DIR --elastic`: one torchrun elastic agent per host, and what a worker does when
the agents' rendezvous hands it another world size than its program's.

Note [elastic run]: one torchrun agent per host of --hosts, all with ``--nnodes 1:HOSTS`` and the
c10d rendezvous on a private file (Note [no TCP rendezvous on one host] in runtime/launch/torchrun.py),
``last_call_timeout`` = --host-timeout. A lost host's peers fail (Note [a dead peer] in
runtime/launch/rank.py), their agents restart them, and a host that does not rejoin in time is gone:
the round closes with a smaller WORLD_SIZE. Every worker then (``resolve``) all-gathers the host it
stands for, so all agree on the survivors; rank 0 re-plans for them with the compiler as a subprocess
(runtime imports no compiler) into DIR.elastic-h<hosts> (kept for a later restart on the same
survivors), and every rank runs that folder, recovering from the memory tier (Note [memory handover]
in runtime/resilience/memtier/handover.py), else the disk, resharded; RUN_DIR/recovery.jsonl gets an
"elastic" row. When the host returns, the workers run DIR itself again from the newest disk
checkpoint (growing back; no test drives it yet). A canary's exclusion ends a round the same way
(Note [excluding a host] in runtime/resilience/exclusion.py).

Note [standing by]: a re-plan keeps the stage cuts, the microbatch size and the global batch (Note
[re-plan on the same cuts] in partitioner/replan.py), so the survivors may hold more ranks than the
plan chosen for them uses: 3 x dp 1 ranks of global batch 6 at microbatch 2 left with 2 survivors
run dp 1 (dp 2 would need 6 % 4 == 0), or dp 1 is simply predicted faster. The re-planned
program's ranks are the first survivors (its devices are the survivors' in old-rank order,
``used_ranks``); the others stand by: after the re-plan each says so and leaves with exit 0, which
torchrun counts as done, not failed (its agent waits at torchrun's exit barrier for the rest and
exits 0 with them). Every worker leaves the old world's group; the used ones meet again in one of
the re-planned world size on the same store under a fresh prefix (the old group's keys stay there,
and rank 0's store server, which torchrun's MASTER_PORT names, must outlive that group). A
standing-by rank's memory slots leave with it: the handover covers its old rank only through a
peer's copy, else the disk serves (never a state older than the disk's newest). `run --elastic`
refuses before any agent starts a job where a one-host loss has no plan at all
(partitioner/cli/elastic.py ``check_elastic``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from runtime.launch.agent_output import start_forwarding
from runtime.launch.run_options import FlagError, RunOptions
from runtime.launch.torchrun import descendants, rendezvous_args, run_env, stop_tree
from runtime.resilience.canary_rules import EXIT_EXCLUDE
from runtime.resilience.faults import say

HOST_ENV = "PARTITIONER_ELASTIC_HOST"   # the host an agent's workers stand for
DEFAULT_HOST_TIMEOUT_S = 5.0
DEFAULT_RESTARTS = 3


class ElasticRefusalError(FlagError):
    """The survivors cannot run the program with this run's hosts (partitioner.replan.ElasticRefusal's
    line): each rank prints the line, no traceback (rank.py's handler, as for a refused flag)."""


class StandingBy(Exception):
    """This worker's rank is not in the re-planned program (Note [standing by]): said already, it
    leaves with exit 0 (rank.py's handler honours ``exit_code``)."""
    exit_code = 0


def used_ranks(world: int, planned_world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the ranks of the new world that run the re-planned program, those that stand by): Note
    [standing by]."""
    if not 1 <= planned_world <= world:
        raise ElasticRefusalError(f"the re-planned program has {planned_world} ranks for the {world} that met: "
                                  "re-plan it for these survivors again (`partitioner replan`)")
    return tuple(range(planned_world)), tuple(range(planned_world, world))


def hosts_and_counts(hosts: list[int]) -> dict[int, int]:
    """{host: its ranks}: each host's ranks consecutive (torchrun numbers an agent's workers so)."""
    order = list(dict.fromkeys(hosts))
    if hosts != sorted(hosts) or order != list(range(len(order))):
        raise ValueError(f"--hosts {','.join(map(str, hosts))}: with --elastic give each host's ranks together, "
                         "hosts numbered 0, 1, ... in rank order (e.g. 0,0,1,1)")
    return {h: hosts.count(h) for h in order}


def agent_command(train_py: str, nproc: int, num_hosts: int, *, rendezvous: str, host_timeout_s: float,
                  max_restarts: int, args: list[str]) -> list[str]:
    """One host's torchrun elastic agent, meeting the others on the FileStore ``rendezvous`` (Note
    [elastic run]; Note [no TCP rendezvous on one host] in runtime/launch/torchrun.py)."""
    keep = max(2, int(host_timeout_s + 0.999))  # heartbeats a second apart: a silent host is dropped after the timeout
    flags = rendezvous_args(rendezvous)
    conf = flags.index("--rdzv-conf") + 1
    flags[conf] += (f",last_call_timeout={max(1, round(host_timeout_s))},keep_alive_interval=1,"
                    f"keep_alive_max_attempt={keep}")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"1:{num_hosts}", "--nproc-per-node",
            str(nproc), *flags, "--max-restarts", str(max_restarts), "--monitor-interval", "0.5", train_py, *args]


def run_agents(train_py: str, options: RunOptions, *, rendezvous: str, pythonpath: str | None = None,
               timeout_s: float | None = None, skip_hosts: frozenset[int] = frozenset(),
               env: dict[str, str] | None = None, stop_when=None) -> int:
    """Every host's agent but ``skip_hosts``' (excluded: Note [excluding a host] in
    runtime/resilience/exclusion.py), host 0's first (the rendezvous orders nodes by start); 0 when
    the job finished on the hosts that were not lost for good. ``stop_when()`` true: the round is
    over, its agents are stopped."""
    hosts = options.host_list()
    counts = {h: n for h, n in hosts_and_counts(hosts).items() if h not in skip_hosts}
    timeout = options.host_timeout or DEFAULT_HOST_TIMEOUT_S
    restarts = options.max_restarts or DEFAULT_RESTARTS
    args = options.to_argv()
    procs, readers = [], []
    try:
        for h, n in counts.items():
            env = {**run_env(pythonpath=pythonpath), **(env or {}), HOST_ENV: str(h)}
            procs.append(subprocess.Popen(agent_command(train_py, n, len(counts), rendezvous=rendezvous,
                                                        host_timeout_s=timeout, max_restarts=restarts, args=args),
                                          env=env, start_new_session=True, stderr=subprocess.PIPE, text=True,
                                          errors="replace"))
            readers.append(start_forwarding(procs[-1].stderr))  # Note [torchrun's failure box]
            time.sleep(0.2)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(train_py, timeout_s)
            if stop_when is not None and stop_when():
                for p in procs:  # SIGKILL: the round's state is settled; a SIGTERM'd agent prints a traceback
                    _kill_tree(p)
                return EXIT_EXCLUDE
            time.sleep(0.2)
    except BaseException:
        for p in procs:
            if p.poll() is None:
                stop_tree(p)
        raise
    finally:
        for reader in readers:  # every agent has exited; a worker it left holding the pipe is not waited for
            reader.join(timeout=5)
    codes = [p.returncode for p in procs]
    # a host lost for good ends killed (SIGKILL); the job is done when a surviving agent finished
    return 0 if 0 in codes and all(c in (0, -9) for c in codes) else next(c for c in codes if c not in (0, -9))


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent's process group and every process below it (Note [excluding a host])."""
    below = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


# -- in the worker ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Switch:
    """A worker's move to the re-planned folder (``resolve``), for its start-up recovery."""
    original: str
    folder: str
    survivors: tuple[int, ...]   # the old ranks left, new rank i = survivors[i]
    hosts: tuple[int, ...]       # the old layout's host of each old rank
    alive: tuple[int, ...]
    replan_s: float
    lost_unix: float | None
    good_step: int | None = None  # an exclusion's last agreeing canary: the disk, at most this step, serves

    @property
    def done_marker(self) -> str:
        """RUN_DIR's file saying this folder's start-up recovery has run (later restarts recover as usual)."""
        return f".elastic_{os.path.basename(self.folder)}.done"


_switched: list[Switch] = []


def switched() -> Switch | None:
    return _switched[-1] if _switched else None


def resolve(folder: str, options: RunOptions, init_group) -> tuple[str, RunOptions]:
    """The folder this worker runs and its options (Note [elastic run]).
    ``init_group(rank, world, timeout_s, backend, device_kind, store=None)`` makes the default process
    group on this rank's device, set current first (rank.py's); a rank the re-plan does not use
    raises StandingBy (Note [standing by])."""
    from runtime.program.spec import load_program  # lazy: loads torch via the program's parts

    from runtime.resilience import exclusion  # lazy: torch-free, only an elastic run

    host = os.environ.get(HOST_ENV)
    program = load_program(folder)
    world = int(os.environ.get("WORLD_SIZE", program.world_size))
    if host is None or world == program.world_size:
        return folder, options
    import torch  # lazy: loads torch
    import torch.distributed as dist  # lazy: loads torch

    from runtime.exchange import all_gather_json, broadcast_json  # lazy: loads torch
    from runtime.resilience.memtier.groups import hosts_of_ranks  # lazy: loads torch

    rank = int(os.environ["RANK"])
    init_group(rank, world, float(program.collective_timeout_s), program.backend, program.device)
    hosts = list(hosts_of_ranks(program.world_size, options.hosts))
    device = torch.device(program.device)  # the rank's: init_group made it current
    alive = tuple(sorted({int(h) for h in all_gather_json(int(host), device)}))  # Note [no pickle between ranks]
    survivors = tuple(r for r in range(program.world_size) if hosts[r] in alive)
    if len(survivors) != world:
        raise ElasticRefusalError(f"the hosts left ({alive}) hold {len(survivors)} ranks of --hosts "
                                  f"{options.hosts}, but {world} workers met: give every agent its host's ranks")
    out = f"{os.path.abspath(folder)}.elastic-h{'_'.join(map(str, alive))}"
    t0 = time.perf_counter()
    message = broadcast_json(_replan(folder, survivors, out, program.plan_hash) if rank == 0 else None, 0, device)
    if message:
        raise ElasticRefusalError(str(message))
    from runtime.program.spec import load_plan  # lazy: loads the program's parts

    used, standing = used_ranks(world, int(load_plan(out)["world_size"]))
    if rank == 0:
        lost = sorted(set(hosts) - set(alive))
        by = (f"; rank(s) {','.join(map(str, standing))} (old {','.join(str(survivors[r]) for r in standing)}) "
              f"stand by, the re-plan uses {len(used)} of them" if standing else "")
        say(0, f"elastic: host(s) {','.join(map(str, lost))} gone for good; {world} ranks on host(s) "
               f"{','.join(map(str, alive))} continue on {out}{by}")
    if standing:  # Note [standing by]
        store = dist.distributed_c10d._get_default_store()
        dist.destroy_process_group()
        if rank in standing:
            say(rank, f"elastic: standing by (old rank {survivors[rank]}): the re-planned program runs on "
                      f"{len(used)} rank(s); this one leaves with exit 0")
            raise StandingBy(f"rank {rank} stands by")
        os.environ["WORLD_SIZE"] = str(len(used))
        init_group(rank, len(used), float(program.collective_timeout_s), program.backend, program.device,
                   store=dist.PrefixStore(f"elastic-{os.path.basename(out)}/", store))
        survivors = survivors[:len(used)]
    active = {hosts[r] for r in survivors}
    new_hosts = ",".join(str(hosts[r]) for r in survivors)
    new = options.replace(hosts=new_hosts, run_dir=options.run_dir or os.path.join(os.path.abspath(folder), "run"),
                          checkpoint_dir=options.checkpoint_dir or os.path.join(os.path.abspath(folder), "checkpoints"),
                          fail_host=tuple(t for t in options.fail_host if int(t.split(":")[0]) in active),
                          fail_at=(), flip_bit=(), fail_persist=None,
                          fault_matmul=renumbered_faults(options.fault_matmul, survivors),
                          features=_replanned_features(out, options, rank))
    excluded = exclusion.load(os.environ[exclusion.EXCLUSION_ENV]) if os.environ.get(exclusion.EXCLUSION_ENV) else None
    lost_unix = excluded.time_unix if excluded else _lost_unix(new.run_dir or os.path.join(folder, "run"))
    _switched.append(Switch(os.path.abspath(folder), out, survivors, tuple(hosts), alive,
                            time.perf_counter() - t0, lost_unix, excluded.good_step if excluded else None))
    return out, new


def renumbered_faults(texts: tuple[str, ...], survivors: tuple[int, ...]) -> tuple[str, ...]:
    """--fault-matmul drills name old ranks: a survivor's under its new rank, a lost rank's dropped."""
    out = []
    for text in texts:
        rank, rest = text.split(":", 1)
        if int(rank) in survivors:
            out.append(f"{survivors.index(int(rank))}:{rest}")
    return tuple(out)


def _replanned_features(out: str, options: RunOptions, rank: int) -> dict:
    """The features' run flags on the re-planned folder (each says once what it turns off)."""
    from runtime.features.registry import FEATURES  # lazy: only a re-planned start
    from runtime.program.spec import load_plan  # lazy: loads the program's parts

    def once(line: str) -> None:  # every rank decides alike; rank 0 says it
        if rank == 0:
            say(0, line)

    program, changed = load_plan(out).get("program") or {}, dict(options.features)
    for feature in FEATURES:
        changed.update(feature.replanned(program, options, once))
    return changed


def _replan(folder: str, survivors, out: str, plan_hash: str | None) -> str | None:
    """Rank 0: `partitioner replan` into ``out`` (reused when it was made from this plan for these
    survivors); None, or the refusal's line."""
    try:
        with open(os.path.join(out, "elastic.json")) as fh:
            made = json.load(fh)
        if made.get("survivors") == list(survivors) and made.get("old_plan_hash") == plan_hash:
            return None
    except (OSError, ValueError):
        pass
    cmd = [sys.executable, "-m", "partitioner", "replan", folder, "--ranks", ",".join(map(str, survivors)),
           "-o", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    sys.stderr.write(done.stdout + done.stderr)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
        return lines[-1] if lines else f"partitioner replan exited {done.returncode}"
    return None


def _lost_unix(run_dir: str) -> float | None:
    """When the host was lost: the newest host fault's record (faults.jsonl), when a drill made it."""
    try:
        with open(os.path.join(run_dir, "faults.jsonl")) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return None
    times = [r["time_unix"] for r in rows if str(r.get("mode", "")).startswith("host")]
    return max(times) if times else None


def recover_switched(trainer, ckpt_dir: str, options: RunOptions, run_dir: str) -> int:
    """Start-up recovery of a re-planned worker: the old layout's memory tier handed over, else the
    disk, resharded into this plan (Note [memory handover]); writes the "elastic" row."""
    import torch.distributed as dist  # lazy: loads torch

    from runtime.program.spec import load_program  # lazy: loads torch
    from runtime.resilience import checkpoint as ck  # lazy: loads torch
    from runtime.resilience.memtier import handover  # lazy: loads torch
    from runtime.resilience.recovery import recover  # lazy: loads torch

    sw = switched()
    old = load_program(sw.original)
    plan_tier = old.memory_tier
    memory_mode = options.memory_tier or (plan_tier.mode if plan_tier else None)
    group_size = options.parity_group or (plan_tier.group_size if plan_tier else None)
    t0 = time.perf_counter()
    reads0 = ck.READS["shards"]
    got = handover.Handover(None, -1, {}, "", "no memory tier")
    if sw.good_step is not None:  # Note [excluding a host]: the disk, at most the last agreeing canary's step
        got = handover.Handover(None, -1, {}, "", f"an exclusion: the disk at or before step {sw.good_step}")
    elif memory_mode not in (None, "off", "none"):
        got = handover.hand_over(old, old_rank=sw.survivors[trainer.rank], hosts=list(sw.hosts), alive=set(sw.alive),
                                 mode=memory_mode, group_size=group_size, ckpt_dir=ckpt_dir,
                                 memory_dir=options.memory_dir)
    memory_reads = 0
    if got.folder is not None:
        step = recover(trainer, got.folder)
        memory_reads = ck.READS["shards"] - reads0
        source = "memory"
    if got.folder is not None and step != got.step:  # a slot failed its sha256 on some rank: the disk serves
        say(trainer.rank, f"warning: the memory handover of step {got.step} did not verify: recovering from disk")
        step = recover(trainer, ckpt_dir)
        source = "disk" if step > 0 else "none"
    elif got.folder is None:
        step = recover(trainer, ckpt_dir, not_after=sw.good_step)
        source = "disk" if step > 0 else "none"
    dist.barrier()
    if trainer.rank == 0 and got.old_root:
        handover.remove(got)
    seconds = time.perf_counter() - t0
    since = time.time() - sw.lost_unix if sw.lost_unix else None
    p = trainer.program
    say(trainer.rank, f"elastic: recovered step {step} from {source}"
                      + (f" (old ranks by tier: {_by_tier(got.tiers)})" if got.tiers else f" ({got.why})")
                      + f" in {seconds * 1e3:.0f} ms; new plan {p.num_stages} stages x dp {p.dp}, "
                      f"{p.num_microbatches} microbatches, {p.schedule}"
                      + (f"; {since:.1f} s since the host was lost" if since is not None else ""))
    os.makedirs(run_dir, exist_ok=True)
    row = {"kind": "elastic", "rank": trainer.rank, "step": step, "tier": source,
           "lost_hosts": sorted(set(sw.hosts) - set(sw.alive)), "survivors": list(sw.survivors),
           "old_plan": old.plan_hash, "new_plan": p.plan_hash, "folder": sw.folder,
           "plan": {"num_stages": p.num_stages, "dp": p.dp, "num_microbatches": p.num_microbatches,
                    "schedule": p.schedule, "world_size": p.world_size},
           "tiers": {str(r): t for r, t in got.tiers.items()}, "memory_shards_read": memory_reads,
           "disk_shards_read": ck.READS["shards"] - reads0 - memory_reads, "replan_s": sw.replan_s,
           "restore_s": seconds, "since_loss_s": since, "good_step": sw.good_step, "time_unix": time.time()}
    with open(os.path.join(run_dir, "recovery.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")
    dist.barrier()
    if trainer.rank == 0:
        with open(os.path.join(run_dir, sw.done_marker), "w") as fh:
            fh.write(f"{step}\n")
    return step


def closing_note(run_dir: str) -> str | None:
    """The launcher's last line after a re-plan: what was lost, the new plan, where the state came
    from and how long the recovery took (RUN_DIR/recovery.jsonl's elastic rows, metrics.jsonl)."""
    def rows(name):
        try:
            with open(os.path.join(run_dir, name)) as fh:
                return [json.loads(line) for line in fh if line.strip()]
        except (OSError, ValueError):
            return []

    elastic = [r for r in rows("recovery.jsonl") if r.get("kind") == "elastic"]
    if not elastic:
        return None
    last = max(elastic, key=lambda r: r["time_unix"])
    p = last["plan"]
    since = max((r["since_loss_s"] or 0.0) for r in elastic if r["new_plan"] == last["new_plan"])
    after = [r for r in rows("metrics.jsonl") if r.get("time_unix", 0) > last["time_unix"]]
    first = (f", first new step done {since + after[0]['time_unix'] - last['time_unix']:.1f} s after the loss"
             if after and since else "")
    why = ("excluded by a compute canary" if last.get("good_step") is not None else "lost for good")
    return (f"[run] elastic: host(s) {','.join(map(str, last['lost_hosts']))} {why}; re-planned to "
            f"{p['num_stages']} stages x dp {p['dp']}, {p['num_microbatches']} microbatches, {p['schedule']} on "
            f"{p['world_size']} ranks ({last['folder']}); state of step {last['step']} from {last['tier']}"
            f"{f', recovered {since:.1f} s after the loss' if since else ''}{first}"
            + (f" (no state after step {last['good_step']}, the last agreeing canary, was used)"
               if last.get("good_step") is not None else ""))


def _by_tier(tiers: dict[int, str]) -> str:
    by: dict[str, list[int]] = {}
    for r, t in sorted(tiers.items()):
        by.setdefault(t, []).append(r)
    return ", ".join(f"{t} {','.join(map(str, rs))}" for t, rs in by.items())

