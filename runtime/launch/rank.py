"""Entry point of every rank: ``runtime.launch.rank.main(folder)``, the one call of a folder's train.py.

Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), checks it
against the plan, computes this rank's role from plan.json (Note [roles from the plan] in
runtime/launch/entry_files.py; a folder of per-rank files is refused), initializes the process group with the plan's backend and collective
timeout, creates the pipeline / data-parallel / tie groups, trains, and writes DIR/run/.

Note [no hangs]: every collective and point-to-point operation runs under the plan's
``collective_timeout_s`` (init_process_group and every new_group get it). Under gloo a dead peer
surfaces as an exception in the survivors. Under NCCL it does not: an NCCL operation raises
nothing in Python; a survivor blocks in its next host sync until NCCL's watchdog sees the
operation time out (``collective_timeout_s`` later) and, with torch's default
TORCH_NCCL_ASYNC_ERROR_HANDLING, aborts the process (SIGABRT): torchrun sees a signal, and
restarts still happen, later. The start-up wait is longer (Note [start-up barrier] in
runtime/parallel/control.py), so skew before step 1 is not such a timeout. On any error a rank
prints the traceback and leaves with ``os._exit(1)`` instead of unwinding through process-group
destructors, which can block on the dead peer; torchrun's agent then tears down the remaining
workers (and restarts them when ``--max-restarts`` allows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import os
import sys
import traceback
from datetime import timedelta

from runtime.resilience import faults
from runtime.launch.entry_files import refuse_old_shape
from runtime.features.base import Run
from runtime.features.registry import FEATURES
from runtime.resilience.exclusion import ExcludeRanks
from runtime.errors import InputMismatchError, MissingPackageError, one_line_error
from runtime.program.spec import Program, ProgramFormatError, load_program
from runtime.launch.run_options import FlagError, RunOptions
from runtime.launch.torchrun import command_text, free_port
from runtime.launch.world import LaunchError, init_group, init_world, rank_device
from runtime.torch_version import check_torch, pipeline_refusal


class ResumeBeyondStepsError(LaunchError):
    """The checkpoint to resume from is past --steps: every rank knows it, rank 0 says it."""


# Where this rank is, for the one line a rank prints when a peer dies (Note [a dead peer]).
_at = {"step": None, "ckpt_dir": None}

# Note [a dead peer]: when a rank dies (killed, out of memory, a fault drill), every peer waiting on
# it in a gloo collective or send/receive gets an error ("Connection reset by peer", a timeout,
# DistBackendError). Its traceback tells nothing the dead rank's own output and torchrun's summary
# do not, and one per surviving rank buries them; so a survivor prints one line: its rank, the
# step, and what happens next (torchrun restarts the job from the newest committed checkpoint, or
# no restarts are left), and exits non-zero so torchrun does so. Under NCCL the line comes only
# where the wait is on a gloo group (start-up recovery and rollbacks, Note [the control group] in
# runtime/parallel/control.py; a checkpoint's commit): a wait on an NCCL group ends in the
# watchdog's abort instead (Note [no hangs]).
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "socket closed",
              "connection refused", "timed out", "gloo/transport", "nccl communicator was aborted",
              "watchdog caught collective operation timeout")


def peer_lost(exc: BaseException) -> bool:
    """Is ``exc`` a collective or point-to-point operation failing because a peer is gone?"""
    try:
        # lazy: loads torch
        import torch.distributed as dist

        kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    except Exception:  # noqa: BLE001 - no torch.distributed: not a collective's error
        kinds = ()
    if kinds and isinstance(exc, kinds):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(needle in text for needle in _PEER_LOST)


def rank_error_lines(who, exc: BaseException, *, whole: bool) -> str:
    """A failed rank's last word: ``[rank R] Type: `` and the first line of the message that says
    something (a message that starts with a newline, as some of torch's do, printed an empty one),
    then, when ``whole`` (no traceback above holds it), the message's other lines."""
    lines = [ln.rstrip() for ln in str(exc).strip().splitlines()]
    head = f"[rank {who}] {type(exc).__name__}: {lines[0].strip() if lines else '(no message)'}"
    return "\n".join([head] + (lines[1:] if whole else []))


def peer_lost_line(rank, exc: BaseException) -> str:
    """The one line a surviving rank prints (Note [a dead peer])."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "]" in first and first.startswith("["):  # gloo's "[/__w/.../pair.cc:537] Read error ..."
        first = first.split("]", 1)[1].strip()
    first = first.split(". This is typically")[0].rstrip(".")
    step = _at["step"]
    where = f"at step {step}" if step is not None else "while starting"
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts < allowed:
        resume = "from step 0"
        if _at["ckpt_dir"]:
            try:
                # lazy: loads torch
                from runtime.resilience.checkpoint.manifest import newest_committed

                newest = newest_committed(_at["ckpt_dir"])
                resume = f"from the checkpoint of step {newest}" if newest >= 0 else resume
            except Exception:  # noqa: BLE001 - the line must come out
                resume = "from the newest committed checkpoint"
        nxt = f"torchrun restarts the job {resume} (restart {restarts + 1} of {allowed})"
    else:
        nxt = (f"no restarts left (--max-restarts {allowed}): the job stops; rerun `partitioner run` "
               "to resume from the newest checkpoint")
    what = "stopped answering" if ("timed out" in first.lower() or "timeout" in first.lower()) else "died"
    return f"[rank {rank}] a peer rank {what} {where} ({first}); {nxt}"


def read_env(program: Program, folder: str, rank: int | None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment, checked against the plan."""
    want = program.world_size
    if "WORLD_SIZE" not in os.environ:
        if want != 1:
            raise LaunchError(f"this program needs {want} processes and WORLD_SIZE is not set: "
                              f"launch it with `{command_text(want, os.path.join(folder, 'train.py'))}`")
        # A one-rank program may run as a plain `python train.py`.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    world = int(os.environ["WORLD_SIZE"])
    if world != want:
        raise LaunchError(f"the program was compiled for world_size={want} but WORLD_SIZE={world}: "
                          f"launch it with `{command_text(want, os.path.join(folder, 'train.py'))}`")
    env_rank = int(os.environ.get("RANK", "0"))
    if rank is not None and rank != env_rank:
        raise LaunchError(f"rank {rank} was asked for but RANK={env_rank}: run train.py under torchrun, "
                          "which gives each worker its RANK")
    return env_rank, world, int(os.environ.get("LOCAL_RANK", str(env_rank)))


def parse_args(argv: list[str] | None) -> RunOptions:
    """The flags `partitioner run` and torchrun pass through train.py to every rank (Note [one flag
    table] in runtime/launch/run_options.py): an unknown one is a FlagError, never dropped."""
    return RunOptions.parse(sys.argv[1:] if argv is None else argv, side="rank")


def _chain(*hooks):
    """One hook calling each of ``hooks`` (None ones skipped) in order."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def call(*args):
        for h in hooks:
            h(*args)

    return call


def main(folder: str, rank: int | None = None, *, steps: int | None = None,
         run_dir: str | None = None, exit_on_error: bool = True,
         argv: list[str] | None = None) -> list[float] | None:
    """Train this rank of the program in ``folder``; returns the per-step losses.

    steps: number of steps (default: program "steps", else optimizer total_steps).
    run_dir: where metrics.jsonl and final/ go (default DIR/run).
    exit_on_error: on an exception print it and ``os._exit(1)`` (Note [no hangs]); False re-raises.
    """
    # A fatal signal in native code (a segfault, glibc's heap checks aborting) would end the rank
    # with one line and no place: every thread's Python stack goes to stderr instead (the persist,
    # hashing and memory-tier threads run beside the training loop).
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    try:
        check_torch()  # Note [what the runtime needs]: an older torch is one line here, not an AttributeError later
        options = parse_args(argv)
        refuse_old_shape(folder)  # a rank's role comes from plan.json: Note [roles from the plan] in runtime/launch/entry_files.py
        from runtime.resilience.exclusion import stop_if_excluded  # torch-free; Note [excluding a host]

        stop_if_excluded(options.run_dir or run_dir or os.path.join(os.path.abspath(folder), "run"))
        guard = contextlib.nullcontext()
        if os.environ.get("PARTITIONER_EMULATE_NCCL"):  # tests only: Note [NCCL emulation]
            from runtime.parallel.nccl_emulation import emulated  # lazy: loads torch

            guard = emulated()
        with guard:
            if options.elastic:  # Note [elastic run]: another world than the program's runs the re-planned folder
                from runtime.launch import elastic  # lazy: only an elastic run

                folder, options = elastic.resolve(folder, options, init_world)
            steps = options.steps if options.steps is not None else steps
            run_dir = options.run_dir or run_dir
            losses = _main(folder, rank, steps=steps, run_dir=run_dir, options=options)
        # The trainer's objects (precision, sharding, their hooks) form reference cycles that keep
        # the destroyed group's store, and so its listening port, alive until a collection: a
        # second launch in this process (a notebook, a test driver) could not bind the port.
        gc.collect()
        return losses
    except Exception as exc:
        if not exit_on_error:
            raise
        if getattr(exc, "exit_code", None) is not None:  # Note [compute canaries]: said already, leave with its code
            sys.stdout.flush()
            os._exit(exc.exit_code)
        who = os.environ.get("RANK", "?") if rank is None else rank
        if isinstance(exc, ResumeBeyondStepsError):  # rank 0 says it; the others leave quietly
            if str(who) == "0":
                print(f"error: {exc}", file=sys.stderr, flush=True)
        elif (full := one_line_error(exc)) is not None:  # a full disk: where, and what to do
            print(f"[rank {who}] error: {full}", file=sys.stderr, flush=True)
        elif peer_lost(exc):  # Note [a dead peer]: one line, not a gloo traceback per survivor
            print(peer_lost_line(who, exc), file=sys.stderr, flush=True)
        else:
            # a launch mistake, a batch the program was not compiled for (Note [constant inputs] in
            # runtime/data/synthetic.py) or a package missing here (Note [what the runtime needs])
            # needs its message, not a traceback
            told = isinstance(exc, (LaunchError, InputMismatchError, FlagError, MissingPackageError,
                                    ProgramFormatError))
            if not told:
                traceback.print_exc()
            print(rank_error_lines(who, exc, whole=told), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _where(step: int) -> None:
    _at["step"] = step


def _first_replanned_start(folder: str, run_dir: str) -> bool:
    """A worker moved to a re-planned folder whose state has not been handed over yet."""
    from runtime.launch.elastic import switched  # lazy: only an elastic run

    sw = switched()
    return sw is not None and sw.folder == folder and not os.path.exists(os.path.join(run_dir, sw.done_marker))


@dataclasses.dataclass
class _Resilience:
    """The rank's checkpoint, fault-drill and replica-check settings, checked before anything slow."""

    use_ckpt: bool
    ckpt_dir: str
    every: int
    mtbf_s: float | None
    keep: int
    fail_at: list
    fail_persist: object
    compression: str
    full_every: int
    sdc_every: int
    flips: list
    memory_settings: object
    checkpointer: object = None
    memory: object = None
    check: object = None


def _resilience(program: Program, options: RunOptions, folder: str, rank: int, sharded: bool) -> _Resilience:
    from runtime.resilience import checkpoint as ck, memtier, sdc  # lazy: loads torch
    from runtime.resilience.checkpoint.delta import FULL_EVERY, _zstd  # lazy: loads torch

    use_ckpt = not options.no_checkpoint
    every, mtbf_s = options.checkpoint_every, options.mtbf_s
    if every is None and mtbf_s is None:
        every = program.checkpoint_every or 0
        mtbf_s = None if every else program.mtbf_s
    compression = options.checkpoint_compression or "none"
    if compression == "lossless":
        _zstd()  # a missing zstandard is a clear error here, not in the first persist
    sdc_every = options.sdc_every
    if sdc_every is None:
        sdc_every = sdc.DEFAULT_EVERY if program.sdc_every is None else program.sdc_every
    for feature in FEATURES:  # Note [one feature, one module] in runtime/features/__init__.py
        if (why := feature.rank_refusal(program, options, rank)) is not None:
            raise LaunchError(why)
    memory_settings = memtier.settings_from(program.memory_tier, options) if use_ckpt else None
    if memory_settings is not None and program.tensor_parallel > 1:  # Note [what tensor parallelism runs with]
        from runtime.parallel.tensor_parallel import memory_tier_refusal  # lazy: only a tp program

        raise LaunchError(memory_tier_refusal(memory_settings.mode, program.tensor_parallel))
    out = _Resilience(
        use_ckpt=use_ckpt, every=every or 0, mtbf_s=mtbf_s, memory_settings=memory_settings,
        ckpt_dir=os.path.abspath(options.checkpoint_dir or os.path.join(folder, "checkpoints")),
        keep=3 if options.keep_checkpoints is None else options.keep_checkpoints,
        fail_at=[faults.parse_fail_at(t) for t in options.fail_at], compression=compression,
        fail_persist=faults.parse_fail_persist(options.fail_persist) if options.fail_persist else None,
        full_every=options.checkpoint_full_every or FULL_EVERY,
        flips=[faults.parse_flip_bit(t) for t in options.flip_bit],
        sdc_every=0 if sharded else sdc_every)  # a plan of an older compile may name one: it could see nothing
    if use_ckpt:
        ck.check_writable(out.ckpt_dir)
    return out


def _main(folder: str, rank: int | None, *, steps: int | None, run_dir: str | None,
          options: RunOptions | None = None):
    folder, options = os.path.abspath(folder), options or RunOptions()
    program = load_program(folder)
    rank, world, local_rank = read_env(program, folder, rank)
    if (why := pipeline_refusal(program)) is not None:  # Note [torch 2.11's pipelining]
        raise LaunchError(why)
    if steps is not None and steps < 1:
        raise LaunchError(f"--steps {steps}: train at least 1 step (e.g. --steps 20)")
    sharded = program.shard_optimizer and program.dp > 1
    options.check_for(world_size=world, sharded=sharded, steps=steps)  # as `partitioner run` did: hand starts too
    if options.collective_timeout is not None:
        program = dataclasses.replace(program, collective_timeout_s=options.collective_timeout)
    res = _resilience(program, options, folder, rank, sharded)  # before anything slow (and before training)
    # Heavy imports (torch.distributed.pipelining takes seconds) only after the cheap checks.
    from runtime.parallel import control  # lazy: loads torch; Note [the control group]
    from runtime.resilience import sdc  # lazy: loads torch
    from runtime.resilience.memtier import hosts_of_ranks  # lazy: loads torch

    steps = program.steps_to_train if steps is None else steps
    run_dir = run_dir or os.path.join(folder, "run")
    trainer, device, owns_group = _start(folder, program, rank, world, local_rank, run_dir)
    if res.use_ckpt:  # Note [shared checkpoint folder]: across nodes, say so when it is not one folder
        from runtime.resilience.checkpoint.shared import check_shared  # lazy: loads torch

        check_shared(res.ckpt_dir, rank, hosts_of_ranks(world, options.hosts), device)
    if rank == 0:
        from runtime.execute.schedule import schedule_text  # lazy: loads torch

        print(f"program {program.plan_hash}: {world} ranks, {program.num_stages} "
              f"stages x dp {program.dp}, {steps} steps\n" + ("" if options.quiet else schedule_text(program)),
              end="", flush=True)
    start_step = _recover(trainer, res, options, folder, run_dir, steps, owns_group) if res.use_ckpt else 0
    before_step, after_step = _core_hooks(trainer, res, options, program, rank, world, run_dir, steps, start_step)
    control.startup_barrier()  # Note [start-up barrier]: each rank's restore took its own time
    hooks = [h for f in FEATURES if (h := f.attach(Run(  # Note [one feature, one module]
        program=program, options=options, rank=rank, world=world, trainer=trainer, folder=folder, run_dir=run_dir,
        start_step=start_step, steps=steps, device=device, hosts=hosts_of_ranks(world, options.hosts)))) is not None]
    before_step = _chain(before_step, *(h.before_step for h in hooks))
    after_step = _chain(*(h.after_step for h in hooks), after_step)
    for hook in hooks:
        after_step = hook.wrap_after_step(after_step) if hook.wrap_after_step else after_step
    evaluator = next((h.evaluator for h in hooks if h.evaluator is not None), None)
    quiet_every = options.log_every or max(1, -(-(steps - min(start_step, steps)) // 10))
    while True:
        try:
            losses = trainer.run(steps, start_step=min(start_step, steps), before_step=before_step,
                                 log_every=max(1, quiet_every if options.quiet else 1), after_step=after_step,
                                 evaluator=evaluator)
            break
        except sdc.SilentDataCorruption as exc:  # on every rank alike: roll back together, train on
            start_step = sdc.roll_back(trainer, exc, ckpt_dir=res.ckpt_dir if res.use_ckpt else None,
                                       checkpointer=res.checkpointer, memory=res.memory,
                                       check=res.check or next((h.digest_check for h in hooks if h.digest_check), None))
            for hook in (h for h in hooks if h.rolled_back is not None):
                hook.rolled_back(start_step)
        except ExcludeRanks as exc:  # Note [excluding a host]: nothing after the fault stays restorable
            if res.use_ckpt:
                from runtime.resilience.exclusion import set_aside  # lazy: only on an exclusion

                set_aside(res.ckpt_dir, exc.good_step, rank, run_dir, res.checkpointer, res.memory)
            raise
    for done in [res.check and res.check.finish] + [h.finish for h in hooks]:
        if done is not None:
            done()
    _finish(trainer, res, owns_group)
    return losses


def _start(folder: str, program: Program, rank: int, world: int, local_rank: int, run_dir: str):
    """(trainer, device, whether this call made the default group): the environment, groups, trainer."""
    import torch.distributed as dist  # lazy: loads torch

    from runtime.execute.precision import device_numerics  # lazy: loads torch
    from runtime.execute.train import RankTrainer, seed_host_generators  # lazy: loads torch
    from runtime.parallel import control  # lazy: loads torch; Note [the control group]
    from runtime.parallel.grad_sync import create_groups  # lazy: loads torch

    timeout = timedelta(seconds=float(program.collective_timeout_s))
    seed_host_generators(program.seed + rank)  # Note [global generators] in runtime/execute/train.py
    device_numerics(program.device, program.precision)  # before any CUDA work: Note [deterministic kernels on a GPU]
    device = rank_device(program.device, local_rank)
    # A caller that already set up the default group (a test driver, a notebook) keeps it.
    owns_group = not dist.is_initialized()
    if owns_group:
        init_group(program.backend, rank, world, timeout, device)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise LaunchError(f"the existing process group is rank {dist.get_rank()} of "
                          f"{dist.get_world_size()}, the program wants rank {rank} of {world}")
    # On an error nothing below is unwound politely: main() exits hard (Note [no hangs]).
    groups = create_groups(program.layout, rank, timeout=timeout)
    control.make_control_group(timeout)
    trainer = RankTrainer(folder, program, rank, device=device, groups=groups, run_dir=run_dir)
    control.startup_barrier()  # Note [start-up barrier]: compiled stages, pretrained weights
    return trainer, device, owns_group


def _recover(trainer, res: _Resilience, options: RunOptions, folder: str, run_dir: str, steps: int,
             owns_group: bool) -> int:
    """The step to train from, with the memory tier and the Checkpointer set on ``res``."""
    import torch.distributed as dist  # lazy: loads torch

    from runtime.parallel import control  # lazy: loads torch
    from runtime.resilience import memtier  # lazy: loads torch
    from runtime.resilience.checkpoint import Checkpointer  # lazy: loads torch
    from runtime.resilience.recovery import recover, recover_any  # lazy: loads torch

    timeout = timedelta(seconds=float(trainer.program.collective_timeout_s))
    if res.memory_settings is not None:  # created before the Checkpointer's group, on every rank
        memory = memtier.MemoryTier(trainer, res.memory_settings, ckpt_dir=res.ckpt_dir, timeout=timeout,
                                    run_dir=run_dir)
        res.memory = memory if memory.enabled else None  # no room in shared memory: disk only (warned)
    if options.elastic and _first_replanned_start(folder, run_dir):  # Note [memory handover]
        from runtime.launch.elastic import recover_switched  # lazy: only a re-planned start

        start_step = recover_switched(trainer, res.ckpt_dir, options, run_dir)
    elif res.memory_settings is not None:
        start_step = recover_any(trainer, res.ckpt_dir, res.memory, run_dir=run_dir)
    else:
        start_step = recover(trainer, res.ckpt_dir)
    if start_step > steps:  # resuming would train nothing and save the resumed state as final
        if owns_group:  # nothing runs on it any more, every rank refuses alike: leave it clean
            control.release()
            dist.destroy_process_group()
        raise ResumeBeyondStepsError(
            f"--steps {steps}: the checkpoint to resume from in {res.ckpt_dir} is at step {start_step}, "
            f"past it; pass --steps {start_step + 1} or more to continue, or another --checkpoint-dir "
            "to start over")
    res.checkpointer = Checkpointer(
        trainer, res.ckpt_dir, every=res.every, keep=res.keep, mtbf_s=res.mtbf_s, timeout=timeout,
        start_step=start_step, persist_fault=res.fail_persist, compression=res.compression,
        full_every=res.full_every, stats_path=os.path.join(run_dir, f"checkpoint_stats_rank_{trainer.rank}.jsonl"))
    return start_step


def _core_hooks(trainer, res: _Resilience, options: RunOptions, program: Program, rank: int, world: int,
                run_dir: str, steps: int, start_step: int):
    """(before_step, after_step) of the core: the fault drills, the checkpoint tiers, the replica check."""
    from runtime.resilience import sdc  # lazy: loads torch
    from runtime.resilience.memtier import hosts_of_ranks  # lazy: loads torch

    before_step = _chain(_where, faults.step_hook(res.fail_at, rank, run_dir),
                         faults.flip_hook(res.flips, rank, trainer.named_parameters(), run_dir),
                         faults.matmul_hook([faults.parse_fault_matmul(t) for t in options.fault_matmul], rank,
                                            trainer.modules, run_dir))
    _at["ckpt_dir"] = res.ckpt_dir if res.use_ckpt else None
    after_step = res.checkpointer.after_step if res.checkpointer else None
    if res.memory is not None:
        before_step = _chain(res.memory.fault_hook(), before_step)
        after_step = _chain(res.memory.after_step, after_step)
    elif options.fail_host:  # no memory tier to wipe: the host's ranks die all the same (a drill of the disk tier)
        host = hosts_of_ranks(world, options.hosts)[rank]
        before_step = _chain(faults.host_hook([faults.parse_fail_host(t) for t in options.fail_host], host=host,
                                              rank=rank, marker=os.path.join(run_dir, f".lost_host_{host}"),
                                              run_dir=run_dir), before_step)
    if res.sdc_every and program.dp > 1:  # Note [replica digests] in runtime/resilience/sdc.py: before the checkpoint
        res.check = sdc.ReplicaCheck(trainer, res.sdc_every, run_dir=run_dir, last_step=steps, start_step=start_step,
                                     also_at=res.checkpointer.due if res.checkpointer else None)
        after_step = _chain(res.check.after_step, after_step)
    return before_step, after_step


def _finish(trainer, res: _Resilience, owns_group: bool) -> None:
    import torch.distributed as dist  # lazy: loads torch

    from runtime.parallel import control  # lazy: loads torch

    if res.checkpointer is not None:
        res.checkpointer.finish()
        if res.memory is not None:
            res.memory.finish()  # after the last disk checkpoint is committed: then the memory tier goes
    trainer.save_final()
    if owns_group:
        control.release()
        dist.destroy_process_group()
