"""torchrun entry that trains several program folders one after another in the same workers, each
with its own train.py flags: tests and benchmarks use it to save the seconds every worker spends
importing torch.distributed.pipelining::

    torchrun --nproc-per-node N tests/drivers/run_many.py [--job-logs DIR] FOLDER [FLAGS...] [-- FOLDER [FLAGS...]]...

The default process group is created here, so runtime.launch.rank.main reuses it (and leaves it alone).
Every folder must be compiled for N ranks. ``--job-logs DIR``: what each rank prints while it trains
job i goes to DIR/job_<i>.rank_<r>.out and .err instead of the shared streams, so a caller that
put many jobs in one launch can tell whose line is whose (tests/_shared_launch.py).

A job written ``--restarts R FOLDER [FLAGS...]`` runs in forked workers that are restarted up to
R times when one of them fails, each job on its own (Note [restarts in a fork]).

Note [restarts in a fork]: a job with a ``--fail-at`` kill needs a restart, and torchrun's own
re-spawns every worker (seconds of importing torch, on every kill), re-runs the launch's earlier
jobs, and counts restarts per launch, so only the first killed job's fault would fire. So a
``--restarts`` job runs each attempt in a child forked from this worker (torch imported, its
process group destroyed first), with a fresh group on a fresh port and the TORCHELASTIC_* counts
of the job's own attempts, so faults fire in its first attempt only and recovery reads the
checkpoints as after a torchrun restart. As torchrun's agent does, a failed child gets every
other rank's child killed and the attempt run again while restarts are left; the ranks
coordinate through the launch's store, every wait with a deadline (ATTEMPT_TIMEOUT_S). Put
``--restarts`` jobs first (tests/_shared_launch.py does): a child inherits what earlier jobs
left in torch, and DTensor caches device meshes whose groups the parent destroyed.
"""

import importlib
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

import runtime.launch.rank
import runtime.launch.world
from runtime.launch.torchrun import free_port


def jobs_of(argv: list[str]) -> list[list[str]]:
    """``FOLDER FLAGS... -- FOLDER FLAGS...`` -> [[FOLDER, FLAGS...], ...]."""
    jobs, current = [], []
    for arg in argv + ["--"]:
        if arg == "--":
            if current:
                jobs.append(current)
            current = []
        else:
            current.append(arg)
    return jobs


@contextmanager
def _output_to(prefix: str | None):
    """fds 1 and 2 into PREFIX.out / PREFIX.err for the block (child processes included)."""
    if prefix is None:
        yield
        return
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            with open(prefix + suffix, "a") as f:
                os.dup2(f.fileno(), fd)
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


ATTEMPT_TIMEOUT_S = 600.0  # one attempt of a --restarts job, and the wait for every rank to end it
POLL_S = 0.05


def restarts_of(job: list[str]) -> tuple[int, list[str]]:
    """``[--restarts R] FOLDER FLAGS...`` -> (R, [FOLDER, FLAGS...]); R is 0 without the prefix."""
    if job[:1] == ["--restarts"]:
        if len(job) < 3 or not job[1].isdigit():
            raise ValueError(f"run_many: write --restarts R FOLDER [FLAGS...], got {' '.join(job)}")
        return int(job[1]), job[2:]
    return 0, job


# What runtime.launch.rank imports only once a job starts (seconds of CPU per process): imported here
# once, before the first fork, so no attempt's child imports them again.
WARM = ("torch.distributed.pipelining", "torch.distributed.tensor", "safetensors.torch", "runtime.execute.train",
        "runtime.resilience.recovery", "runtime.resilience.checkpoint", "runtime.resilience.checkpoint.shared", "runtime.resilience.checkpoint.delta",
        "runtime.resilience.memtier", "runtime.resilience.sdc", "runtime.launch.entry_files", "runtime.execute.schedule", "runtime.observe.memory",
        "runtime.execute.stage", "runtime.parallel.tensor_parallel", "runtime.execute.recompute")
OPTIONAL_WARM = ("torch.utils.tensorboard", "zstandard")  # rank 0's metrics board, lossless checkpoints


def run_restartable(store, rank: int, world: int, index: int, folder: str, flags: list[str], restarts: int) -> bool:
    """Train the job in forked children, restarting every rank's child after a failure (Note
    [restarts in a fork]); True when an attempt succeeded on every rank."""

    for name in WARM:
        importlib.import_module(name)
    for name in OPTIONAL_WARM:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed: the job does without it, as it would anyway
            pass

    for attempt in range(restarts + 1):
        key = f"run_many/{index}/{attempt}"
        if rank == 0:
            store.set(f"{key}/port", str(free_port()))
        port = store.get(f"{key}/port").decode()
        sys.stdout.flush(), sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the attempt's worker: it never returns into this loop
            code = 1
            try:
                _die_with(parent)
                os.environ.update(MASTER_PORT=port, TORCHELASTIC_RESTART_COUNT=str(attempt),
                                  TORCHELASTIC_MAX_RESTARTS=str(restarts))
                runtime.launch.rank.main(folder, argv=flags)  # exits 1 itself on an error (Note [no hangs])
                code = 0
            except BaseException:  # noqa: BLE001 - whatever it is, the parent must hear of it
                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        failed = f"{key}/failed"
        deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                how = "ok" if code == 0 else f"killed by signal {-code}" if code < 0 else f"exit {code}"
                break
            if store.check([failed]) or time.monotonic() > deadline:  # a peer failed (or ours hangs): stop ours
                how = "stopped" if store.check([failed]) else f"stopped past {ATTEMPT_TIMEOUT_S:.0f} s"
                code = -signal.SIGKILL
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(POLL_S)
        store.set(f"{key}/rank{rank}", how)
        if code != 0:
            store.set(failed, "1")
        store.add(f"{key}/ended", 1)
        while store.add(f"{key}/ended", 0) < world:  # every rank's child is gone before the next attempt
            if time.monotonic() > deadline + ATTEMPT_TIMEOUT_S:
                raise TimeoutError(f"run_many: job {index} attempt {attempt}: not every rank ended it")
            time.sleep(POLL_S)
        if not store.check([failed]):
            return True
        why = ", ".join(f"rank {r} {store.get(f'{key}/rank{r}').decode()}" for r in range(world))
        left = restarts - attempt
        if rank == 0:  # the same verdict on every rank: one line says it
            print(f"[rank {rank}] run_many: job {index} attempt {attempt} failed ({why}); "
                  + (f"restarting it ({left} restart{'s' if left != 1 else ''} left)" if left else "no restarts left"),
                  file=sys.stderr, flush=True)
    return False


def _die_with(parent: int) -> None:
    """This child is SIGKILLed when ``parent`` dies, however it dies (torchrun's agent stops a
    worker's whole process group, which holds the child too; a worker killed alone would leave it
    training): Linux's PR_SET_PDEATHSIG, and a parent already gone is an exit."""
    try:
        import ctypes  # lazy: only a restartable child sets its death signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the process group still covers the agent's stop
        pass
    if os.getppid() != parent:
        os._exit(1)


if __name__ == "__main__":
    argv = sys.argv[1:]
    logs = None
    if argv[:1] == ["--job-logs"]:
        logs, argv = argv[1], argv[2:]
        os.makedirs(logs, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # loopback store on one host
    timeout = timedelta(seconds=60)
    store = runtime.launch.world.worker_store(rank, world, timeout)
    groups = 0  # default process groups made so far (a later one gets its own key prefix in the store)

    def default_group() -> None:
        global groups
        if not dist.is_initialized():
            pg_store = store if groups == 0 or store is None else dist.PrefixStore(f"run_many/pg{groups}", store)
            dist.init_process_group("gloo", timeout=timeout, rank=rank, world_size=world, store=pg_store)
            groups += 1

    jobs = [restarts_of(job) for job in jobs_of(argv)]
    if any(r for r, _ in jobs) and store is None:
        raise SystemExit("run_many: --restarts needs the loopback store of a single-host launch")
    if jobs and not jobs[0][0]:  # before job 0's logs open: a failure here is the launch's, not job 0's
        default_group()
    for i, (restarts, (folder, *flags)) in enumerate(jobs):
        job_start_s = time.perf_counter()
        with _output_to(None if logs is None else os.path.join(logs, f"job_{i}.rank_{rank}")):
            ok = True
            if not restarts:
                default_group()
                runtime.launch.rank.main(folder, argv=flags)
            else:
                if dist.is_initialized():  # a forked child must not inherit a live group (Note [restarts in a fork])
                    dist.destroy_process_group()
                ok = run_restartable(store, rank, world, i, folder, flags, restarts)
        if logs is not None and rank == 0:  # where a slow shared launch spends its time, job by job
            with open(os.path.join(logs, "timings.txt"), "a") as out:
                out.write(f"{time.perf_counter() - job_start_s:8.1f} s  job {i} {folder}\n")
        if not ok:
            sys.exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
