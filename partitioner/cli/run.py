"""`partitioner run DIR`: the program folder checked on this host (flags, checkpoint and run
folders), then torchrun in its own session, its rendezvous a file only this user opens.
Registered by commands.py's parser (``cmd_run``); it imports torch only when it runs."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from partitioner.solver.plan import Plan
from runtime.launch.entry_files import refuse_old_shape
from runtime.launch.run_options import RunOptions
from runtime.launch.signed_rendezvous import BACKEND as SIGNED, KEY_ENV
from runtime.launch.torchrun import run_env, run_tree, torchrun_command
from runtime.program.spec import PROGRAM_FORMAT, format_refusal, load_plan
from runtime.features.registry import FEATURES
from runtime.resilience.canary_rules import exit_code_after
from runtime.resilience.exclusion import ROUND_ENV


def program_sharded(plan) -> bool:
    """Whether the plan's program shards the optimizer state over its replicas (ZeRO-1)."""
    return plan.decisions.shard_optimizer and plan.dp > 1


def cmd_run(args) -> int:
    """torchrun the program folder on this host. Checkpoints go to --checkpoint-dir (default
    DIR/checkpoints), checked writable here, before any worker starts; a run resumes from the
    newest valid checkpoint there and always leaves a committed checkpoint of its last step."""
    from runtime.resilience.checkpoint import check_writable  # lazy: loads torch (the CLI's parser stays torch-free)

    folder = Path(args.dir)
    options = RunOptions.from_namespace(args)  # Note [one flag table]: checked as every rank checks it
    refuse_old_shape(str(folder))  # Note [roles from the plan] in runtime/launch/entry_files.py
    program = (load_plan(str(folder)).get("program") or {})
    if program.get("format_version") != PROGRAM_FORMAT:  # Note [program format]: before any worker starts
        raise ValueError(f"{folder}: {format_refusal(program.get('format_version'))}")
    plan = Plan.load(folder)
    rank_params = {r["rank"]: [n for k in r["stages"] for n in program["stages"][k]["params"]]
                   for r in program.get("ranks", ())}
    options.check_for(world_size=plan.world_size, sharded=program_sharded(plan),
                      rank_params=rank_params,
                      plan_memory_tier=(program.get("memory_tier") or {}).get("mode") or "off")
    for feature in FEATURES:  # Note [one feature, one module]: before any worker starts
        if (why := feature.run_refusal(program, options)) is not None:
            raise ValueError(why)
    if options.elastic:  # before any folder is made (Note [elastic run])
        from partitioner.cli.elastic import check_elastic

        check_elastic(folder, options, plan)
    ckpt_dir = Path(options.checkpoint_dir) if options.checkpoint_dir else folder / "checkpoints"
    check_writable(str(ckpt_dir))
    _check_run_dir(Path(options.run_dir) if options.run_dir else folder / "run")
    if options.steps is not None:  # resuming past --steps would train nothing (runtime/launch/rank.py checks again)
        from runtime.resilience.checkpoint.manifest import newest_committed

        newest = newest_committed(str(ckpt_dir))
        if newest > options.steps:
            raise ValueError(f"--steps {options.steps}: the newest checkpoint in {ckpt_dir} is at step {newest}, "
                             f"past it; pass --steps {newest + 1} or more to continue, or another "
                             "--checkpoint-dir to start over")
    if options.memory_tier not in (None, "off") and plan.tensor_parallel > 1:
        from runtime.parallel.tensor_parallel import memory_tier_refusal  # lazy: loads torch

        raise ValueError(memory_tier_refusal(options.memory_tier, plan.tensor_parallel))
    # the workers start elsewhere: every path they are given is absolute
    options = options.replace(checkpoint_dir=str(ckpt_dir.resolve()), **{
        name: str(Path(getattr(options, name)).resolve()) for name in ("run_dir", "memory_dir")
        if getattr(options, name) is not None})
    if options.elastic:  # Note [elastic run]: one agent per host (partitioner/cli/elastic.py)
        from partitioner.cli.elastic import run_elastic

        started = time.time()
        return exit_code_after(options.run_dir or str((folder / "run").resolve()), run_elastic(folder, options, plan),
                               started, said=True)
    if not options.quiet:
        world = plan.world_size
        nodes = 2 if world % 2 == 0 and world >= 2 else 1  # the plan's world size, split evenly
        print(f"[run] {world} ranks on this host (torchrun --nproc-per-node {world} {folder / 'train.py'}); "
              + (f"on {nodes} nodes run on each, with the same {KEY_ENV} exported: python -m "
                 f"runtime.launch.signed_rendezvous --nnodes {nodes} --nproc-per-node {world // nodes} "
                 f"--node-rank $NODE_RANK --rdzv-backend {SIGNED} --rdzv-endpoint $MASTER_HOST:$MASTER_PORT "
                 f"{folder / 'train.py'} with --checkpoint-dir on a filesystem every node shares (MASTER_PORT: a "
                 "free port on MASTER_HOST; the nodes' network must be trusted: README \"Trust model\")"
                 if nodes > 1 else "docs/multi-node.md says how to run it across nodes"),
              file=sys.stderr, flush=True)
    # torchrun in its own session; SIGTERM/SIGINT reach it and its workers (Note [process groups]
    # in runtime/launch/torchrun.py). The rendezvous is a file only this user opens (Note [no TCP
    # rendezvous on one host]).
    command = torchrun_command(folder / "train.py", plan.world_size, args=options.to_argv(),
                               max_restarts=options.max_restarts)
    started = time.time()
    code = run_tree(command, env={**run_env(), ROUND_ENV: repr(started)},  # Note [excluding a host]
                    one_line_box=True).returncode  # Note [torchrun's failure box]
    # a canary's exclusion (Note [compute canaries]) is exit 4, not torchrun's 1
    return exit_code_after(options.run_dir or str((folder / "run").resolve()), code, started)


def _check_run_dir(run_dir: Path) -> None:
    """--run-dir (default DIR/run) is made and written once here, before any worker starts: a
    folder the ranks cannot write fails every one of them at its end, with a traceback each."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write_probe_"):
            pass
    except OSError as exc:
        raise ValueError(f"--run-dir {run_dir}: cannot write there ({exc.strerror or exc}): pass --run-dir with a "
                         "folder you can write") from None

