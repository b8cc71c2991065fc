"""partitioner compile | inspect | run | verify | export | calibrate | data | generate.

Every error path prints one or two lines naming the value and the fix, and exits non-zero.
Each subcommand imports what it needs when it runs, so `partitioner --help` and usage errors
answer without importing torch (seconds on a small machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runtime.program.parts import Precision
from runtime.launch.entry_files import rank_role, refuse_old_shape, role_text
from runtime.program.spec import load_program
from runtime.launch.run_options import add_flags as add_run_flags, dash_values_joined
import partitioner
from partitioner.cli import data as data_command, elastic as elastic_command, generate as generate_command
from partitioner.cli.run import cmd_run
from partitioner.cli.examples import EXAMPLES
from partitioner.cli.progress import CompileProgress, end_open_lines
from runtime.data.corpus.spec import absolute_spec
from runtime.errors import import_failure
from runtime.features.registry import settings as feature_settings
from partitioner.config.cluster import ClusterSpec
from partitioner.config.job import load_job, training_settings
from partitioner.solver.plan import Plan
from partitioner.solver.schedules import REQUEST_CHOICES

EXIT_USAGE = 2


def cmd_compile(args) -> int:
    # lazy: loads torch
    from partitioner.models.builtin import load_workload
    # lazy: loads OR-Tools
    from partitioner.solver.solve import SolverConfig
    # lazy: loads torch
    from runtime.resilience.checkpoint import parse_duration_s

    job = load_job(args.job) if args.job else None  # Note [training settings merge]: flags win
    if args.cluster:
        if not Path(args.cluster).is_file():
            raise ValueError(f"--cluster {args.cluster}: no such file; write a cluster TOML (docs/configuration.md)")
        cluster = ClusterSpec.from_toml(args.cluster)
    elif job is not None and job.cluster is not None and args.devices is None and args.device is None:
        cluster = job.cluster
    else:
        cluster = ClusterSpec.homogeneous(2 if args.devices is None else args.devices, args.device or "cpu")
    # Lets `partitioner verify` rebuild the original model, from any directory.
    spec_file, colon, function = args.model.partition(":")
    model_spec = f"{Path(spec_file).resolve()}{colon}{function}" if spec_file.endswith(".py") else args.model
    training = {"model_spec": model_spec}
    optimizer = {key: value for key, value in (("lr", args.lr), ("total_steps", args.steps),
                                               ("warmup_steps", args.warmup_steps)) if value is not None}
    if optimizer:
        training["optimizer"] = optimizer
    if args.clip_grad_norm is not None:
        training["clip_grad_norm"] = None if args.clip_grad_norm.lower() == "none" else _float_flag(
            "--clip-grad-norm", args.clip_grad_norm)
    if args.compile_stages:  # Note [compiled stages] in runtime/execute/compile_stages.py
        training["compile_stages"] = True
    if args.pretrained:
        training["pretrained"] = str(Path(args.pretrained).resolve())
    # Note [a corpus replaces make_batch]; a job file's [data] source is resolved by load_job; an
    # empty --data "" is refused by absolute_spec, not dropped
    if args.data is not None:
        training["data"] = absolute_spec(args.data)
    if args.precision:  # a setting like the others, not a keyword beside them
        training["precision"] = args.precision
    if args.recompute:  # Note [recompute a user pins] in partitioner/solver/recompute_cost.py
        training["recompute"] = args.recompute
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every}: must be a number of steps >= 0 "
                         "(0: only the last)")
    if args.calibrate_threads is not None and args.calibrate_threads < 0:
        raise ValueError(f"--calibrate-threads {args.calibrate_threads}: give 1 or more (0 = leave as is)")
    if args.parity_group is not None:
        if args.memory_tier not in ("parity", "auto"):
            raise ValueError(f"--parity-group {args.parity_group} sizes the parity groups of the memory tier: "
                             "add --memory-tier parity (or auto)")
        if args.parity_group < 2:
            raise ValueError(f"--parity-group {args.parity_group}: a parity group holds 2 or more nodes")
    if args.checkpoint_every is not None:
        training["checkpoint_every"] = args.checkpoint_every
    if args.sdc_every is not None:  # Note [replica digests]
        if args.sdc_every < 0:
            raise ValueError(f"--sdc-every {args.sdc_every}: give a number of steps >= 0 (0: no replica check)")
        training["sdc_every"] = args.sdc_every
    for setting in feature_settings(side="compile"):  # Note [one feature, one module]; checked by compile()
        if getattr(args, setting.key, None) is not None:
            training[setting.key] = getattr(args, setting.key)
    if args.mtbf is not None:
        training["mtbf_s"] = parse_duration_s(args.mtbf)
    if args.memory_tier is not None:
        training["memory_tier"] = {"mode": args.memory_tier, **({"group_size": args.parity_group}
                                                               if args.parity_group else {})}
    if job is not None and ("checkpoint_every" in training or "mtbf_s" in training):
        job.training.pop("checkpoint_every", None)  # one cadence: the flag's
        job.training.pop("mtbf_s", None)
    settings = training_settings(job.training if job else None, training,
                                 names=(f"job file {args.job} [training]", "flags"))

    say = CompileProgress(quiet=args.quiet, verbose=args.verbose)  # steps, times and the solver, on stderr
    from partitioner.calibrate import CalibrationConfig, DeviceProfile

    profiles = [DeviceProfile.load(path) for path in args.profile or []]
    calibration = None
    if args.calibrate and args.no_calibrate:
        raise ValueError("--calibrate measures this model's regions and --no-calibrate prices with the cpu preset: "
                         "give one")
    if args.calibrate:
        out = args.profile_out or f"{str(args.output).rstrip('/')}.profile.json"
        calibration = CalibrationConfig(repeats=args.calibrate_repeats, warmup=min(3, args.calibrate_repeats),
                                        threads=args.calibrate_threads or None, profile_out=out)
    elif args.profile_out:
        raise ValueError("--profile-out names where --calibrate saves its fit: add --calibrate")
    say(f"model {args.model}")
    workload = load_workload(args.model, pretrained=settings.pretrained, data=settings.data)
    started = time.perf_counter()
    plan = partitioner.compile(
        workload, cluster=cluster, global_batch=args.global_batch, num_stages=args.stages, dp=args.dp,
        microbatches=args.microbatches, schedule=args.schedule, granularity=args.granularity,
        training=settings, solver_config=SolverConfig(time_limit_s=args.time_limit), progress=say,
        profiles=profiles, calibrate=calibration, shard_optimizer=args.shard_optimizer, tensor_parallel=args.tp,
        sequence_parallel=args.sequence_parallel,  # Note [sequence parallelism as a decision]
        machine_profile="preset" if args.no_calibrate else "auto",  # Note [machine profile]
    )
    say(f"write {args.output}")
    plan.save(args.output)
    say.close()
    if not args.quiet:
        print(plan.summary())
        ranks = f"{plan.world_size} rank{'s' * (plan.world_size != 1)}"
        print(f"\nwrote {args.output} in {time.perf_counter() - started:.1f} s; "
              f"run it: partitioner run {args.output} --steps 20 ({ranks}: torchrun "
              f"--nproc-per-node {plan.world_size} {Path(args.output) / 'train.py'})")
    return 0


def _float_flag(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} {text}: give a number (e.g. {flag} 1.0) or none") from None


def _checkpoint_target(target: Path, checkpoints: bool):
    """(checkpoint dir, program or None, one step or None) when TARGET names checkpoints: a folder
    of step_N dirs, one step_N dir (or its manifest.json), or a program folder with --checkpoints."""
    # lazy: loads torch
    from partitioner.inspect import checkpoints as checkpoint_listing

    def program_near(folder: Path):  # DIR/checkpoints of a program folder: check the model too
        return checkpoint_listing.program_of(folder.parent) if (folder.parent / "plan.json").is_file() else None

    if target.is_file() and target.name == "manifest.json":
        target = target.parent
    if target.is_file() and checkpoints:  # plan.json --checkpoints
        return target.parent / "checkpoints", checkpoint_listing.program_of(target.parent), None
    if not target.is_dir():
        return None
    if checkpoint_listing.is_step_dir(target):
        return target.parent, program_near(target.parent), int(target.name.removeprefix("step_"))
    if (target / "plan.json").is_file():
        return (target / "checkpoints", checkpoint_listing.program_of(target), None) if checkpoints else None
    if checkpoints or checkpoint_listing.is_checkpoint_dir(target):
        return target, program_near(target), None
    return None


def _inspect_checkpoints(args, ckpt_dir: Path, program, step) -> int:
    # lazy: loads torch
    from partitioner import inspect
    # lazy: loads torch
    from partitioner.inspect import checkpoints as checkpoint_listing

    for flag, given in (("--dot", args.dot), ("--html", args.html), ("--node", args.node), ("--rank", args.rank)):
        if given:
            raise ValueError(f"{flag} shows a plan, and {args.target} names checkpoints: list them as a table "
                             "or with --json, or pass the program folder for the plan")
    listing = checkpoint_listing.scan(ckpt_dir, program=program, step=step)
    text = inspect.to_json_text(listing) if args.json else checkpoint_listing.text(listing)
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _rank_role(folder: Path, rank: int, *, as_json: bool) -> str:
    """`inspect DIR --rank N`: rank N's role as its rank computes it at start-up (Note [roles from
    the plan] in runtime/launch/entry_files.py)."""
    refuse_old_shape(str(folder))
    program = load_program(str(folder))
    return json.dumps(rank_role(program, rank), indent=1) if as_json else role_text(program, rank)


def cmd_inspect(args) -> int:
    # lazy: loads torch
    from partitioner import inspect
    # lazy: loads torch
    from partitioner.inspect import checkpoints as checkpoint_listing

    target = Path(args.target)
    if not target.exists():
        raise ValueError(f"{target}: no such file or folder; pass a program folder or its plan.json")
    found = _checkpoint_target(target, args.checkpoints)
    if found is not None:
        return _inspect_checkpoints(args, *found)
    if target.is_dir() and not (target / "plan.json").is_file():
        raise ValueError(f"{target} has no plan.json: pass a program folder written by `partitioner compile` "
                         "(or a checkpoint folder, one with step_* directories)")
    try:
        plan = Plan.load(target)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:  # valid JSON, not a plan
        name = target / "plan.json" if target.is_dir() else target
        raise ValueError(f"{name} is not a plan ({type(exc).__name__}: {exc}); "
                         "recompile it with `partitioner compile`") from None
    if args.rank is not None and (args.node is not None or args.dot or args.html):
        raise ValueError("--rank shows one rank's role: pass it alone (or with --json), not with --node, --dot or --html")
    if args.rank is not None:
        text = _rank_role(target if target.is_dir() else target.parent, args.rank, as_json=args.json)
    elif args.node is not None:
        info = inspect.explain_node(plan, args.node, *inspect.load_priced(target))
        text = inspect.to_json_text(info) if args.json else inspect.explain_text(info)
    elif args.json:
        text = inspect.to_json_text(inspect.inspect_json(plan))
    elif args.dot:
        text = inspect.dot(plan).rstrip("\n")
    elif args.html:
        path = inspect.write_html(plan, args.html)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB); open it in a browser", file=sys.stderr)
        return 0
    else:
        text = inspect.table(plan)
        if target.is_dir() and checkpoint_listing.is_checkpoint_dir(target / "checkpoints"):
            print(f"checkpoints in {target / 'checkpoints'}: partitioner inspect {target} --checkpoints",
                  file=sys.stderr)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `inspect ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_calibrate(args) -> int:
    """This machine's cpu profile: show it (measuring it if absent or with --refresh), or refit
    it from a finished run (Notes [machine profile], [refit from a run])."""
    # lazy: loads torch
    from partitioner.calibrate import machine

    if args.from_run and args.refresh:
        raise ValueError("--refresh measures the machine again and --from-run refits it to a run: give one "
                         "(a refit needs the measurement the run's plan was priced by)")
    say = CompileProgress(prefix="[calibrate] ")
    if args.from_run:
        # lazy: loads torch
        from partitioner.calibrate.refit import refit_from_run

        key = machine.MachineKey.here()
        profile, why = machine.load_cached(key)
        if profile is None:
            raise ValueError(f"no usable machine profile of this machine ({why}): compile without --no-calibrate "
                             "(it measures one), run the program, then refit from that run")
        report = refit_from_run(args.from_run, profile)
        path = machine.save(report.profile)
        print(report.text())
        print(f"wrote {path}; the next compile on this machine prices with it")
        return 0
    resolved = machine.machine_profile(refresh=args.refresh, progress=say)
    say.close()
    print(f"{resolved.how}: {resolved.path}")
    print(resolved.profile.describe())
    return 0


def cmd_verify(args) -> int:
    # lazy: loads torch
    from partitioner.cli.verify import verify

    folder = Path(args.dir)
    if not (folder / "plan.json").is_file():
        raise ValueError(f"{folder} has no plan.json: pass a folder written by `partitioner compile -o DIR`")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: verify compares at least 1 step (e.g. --steps 3)")
    report = verify(folder, steps=args.steps)
    print(report.text())
    return 0 if report.ok else 1


def cmd_export(args) -> int:
    # lazy: loads torch
    from partitioner.models.export import export

    report = export(args.target, args.output, program_dir=args.program)
    print(report.text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="partitioner", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    c = sub.add_parser("compile", help="compile a model into a program folder", epilog=EXAMPLES["compile"],
                       formatter_class=fmt)
    c.add_argument("model", help="built-in name with arguments (gpt:layers=12), module:function, file.py:function, "
                   "or hf:CONFIG_DIR (a Hugging Face config, local files only)")
    c.add_argument("-o", "--output", required=True, help="program folder to write")
    c.add_argument("--data", metavar="SPEC", help="train on a token corpus: tokens:DIR (partitioner data prepare), "
                   "tokens:FILE.bin,dtype=uint16, megatron:PREFIX, hf-disk:DIR")
    c.add_argument("--pretrained", metavar="DIR", help="Hugging Face safetensors (model.safetensors or a sharded "
                   "index) an hf: MODEL starts from; each rank reads its own stage's tensors")
    c.add_argument("--devices", type=int, help="number of devices (default 2)")
    c.add_argument("--device", help="device kind: cpu (default), a100, a100-80gb, h100, h200")
    c.add_argument("--cluster", help="cluster TOML file (overrides --devices/--device and the job file's)")
    c.add_argument("--job", metavar="FILE", help="job TOML: [training] settings and the cluster "
                   "(docs/configuration.md); the flags below override it")
    c.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    c.add_argument("--steps", type=int, help="training steps: the LR schedule's length and what `run` trains "
                   "(default 1000)")
    c.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 2)")
    c.add_argument("--clip-grad-norm", metavar="NORM", help="clip the global gradient norm to NORM (none: off)")
    c.add_argument("--compile-stages", action="store_true", help="torch.compile (inductor) each stage's forward, "
                   "warmed before step 1 (default off)")
    c.add_argument("--global-batch", type=int, default=8)
    c.add_argument("--microbatches", type=int)
    c.add_argument("--stages", type=int)
    c.add_argument("--dp", type=int)
    c.add_argument("--tp", type=int, help="tensor-parallel degree: ranks per tensor group, each stage's linear "
                   "layers sharded across them (default: the solver chooses among the degrees the program runs)")
    c.add_argument("--schedule", default="1f1b", choices=REQUEST_CHOICES,
                   help="interleaved: 2-4 stages per rank, priced by its worst stage (one device class); zb, zbv: "
                        "zero-bubble (backward split into input and weight gradients; zbv: 2 stages per rank in a V); "
                        "auto: the solver weighs them all by predicted step time")
    c.add_argument("--granularity", default="block", choices=["block", "sublayer", "op", "node"])
    c.add_argument("--time-limit", type=float, default=10.0, help="solver time limit per candidate, seconds")
    group = c.add_mutually_exclusive_group()
    group.add_argument("--checkpoint-every", type=int)
    group.add_argument("--mtbf", help="mean time between failures (e.g. 6h): picks the checkpoint interval")
    c.add_argument("--memory-tier", choices=["auto", "none", "copy", "parity"], help="in-memory checkpoints "
                   "every step with redundancy across nodes (auto: none on one node, copy on two, parity on "
                   "more); the plan says what it costs in host memory")
    c.add_argument("--parity-group", type=int, help="nodes per parity group (default min(nodes, 4))")
    c.add_argument("--sdc-every", type=int, help="the plan compares its replicas' digests every K steps "
                   "(0: never; default 20 with dp > 1); its cost is in the predicted step")
    for setting in feature_settings(side="compile"):  # Note [one feature, one module] in runtime/features/__init__.py
        c.add_argument(setting.flag, type=setting.type, metavar=setting.metavar, help=setting.help)
    c.add_argument("--calibrate", action="store_true", help="measure every region on this machine, fit the "
                   "time model for its device kind and compile with it (see --profile-out)")
    c.add_argument("--no-calibrate", action="store_true", help="price cpu devices with the cpu preset's figures, "
                   "not this machine's cached profile (partitioner calibrate; default: the profile, measured "
                   "once the first time, a few seconds)")
    c.add_argument("--profile-out", metavar="FILE", help="where --calibrate saves the fitted profile "
                   "(default: OUTPUT.profile.json beside the program folder)")
    c.add_argument("--profile", metavar="FILE", action="append", help="a fitted device profile (JSON from "
                   "--calibrate) pricing regions on its device kind; repeat for several kinds")
    c.add_argument("--calibrate-repeats", type=int, default=10, help="timed repeats per region (median)")
    c.add_argument("--calibrate-threads", type=int, default=1, help="torch threads while measuring on CPU "
                   "(default 1, what `partitioner run` gives each rank; 0 = leave as is)")
    c.add_argument("--precision", choices=[p.value for p in Precision],
                   help="autocast policy (default: bf16-mixed on GPU kinds, fp32 on cpu)")
    c.add_argument("--shard-optimizer", choices=["auto", "on", "off"], default="auto",
                   help="AdamW state sharded over data-parallel replicas (ZeRO-1); auto: where it pays")
    c.add_argument("--sequence-parallel", choices=["auto", "on", "off"], default="auto",
                   help="with --tp: norms, dropouts and residual adds on a 1/tp slice of the sequence (Megatron's "
                   "sequence parallelism); auto: where it is priced no slower")
    c.add_argument("--recompute", choices=["auto", "none", "full", "selective"],
                   help="activation recompute: auto (the default: the solver chooses whole regions), none (never; "
                   "refused if nothing fits without it), full (every region that saves memory, as Megatron's "
                   "full recompute), selective (only each attention core, as Korthikanti et al. 2022; not with --tp > 1)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr, no summary")
    c.set_defaults(func=cmd_compile)

    i = sub.add_parser("inspect", help="show a plan", epilog=EXAMPLES["inspect"], formatter_class=fmt)
    i.add_argument("target", help="program folder, plan.json, or a checkpoint folder (or one step_N in it)")
    form = i.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="machine-readable (docs/design.md §11 fields and more)")
    form.add_argument("--dot", action="store_true", help="the region graph coloured by stage, as Graphviz")
    form.add_argument("--html", metavar="FILE", help="write one self-contained HTML page to FILE")
    i.add_argument("--node", metavar="NAME", help="explain where graph node (or region) NAME sits and what "
                   "moving it costs; with --json, as JSON")
    i.add_argument("--rank", metavar="N", type=int, help="rank N's role, as it computes it from plan.json at "
                   "start-up: its stages, pipeline and data-parallel peers, its schedule's actions; with --json, as JSON")
    i.add_argument("--checkpoints", action="store_true", help="list the checkpoints of the program folder "
                   "(DIR/checkpoints): valid or why not, size, plan, and which one a resume picks; a checkpoint "
                   "folder or one step_N folder as TARGET lists without this flag")
    i.set_defaults(func=cmd_inspect)

    r = sub.add_parser("run", help="train with a program folder on this host", epilog=EXAMPLES["run"],
                       formatter_class=fmt, allow_abbrev=False, description="Train with a program folder on this host. "
                       "This executes the folder's Python code: run only folders you trust (README \"Trust model\").")
    r.add_argument("dir")
    add_run_flags(r, "run")  # Note [one flag table] in runtime/launch/run_options.py: train.py parses the same
    r.set_defaults(func=cmd_run)

    k = sub.add_parser("calibrate", help="this machine's cpu profile: measure it, show it, refit it from a run",
                       epilog=EXAMPLES["calibrate"], formatter_class=fmt,
                       description="This machine's cpu profile, which prices cpu devices in every compile: "
                       "measured once (seconds) and cached under $XDG_CACHE_HOME/partitioner (~/.cache).")
    what = k.add_mutually_exclusive_group()
    what.add_argument("--machine", action="store_true", help="show the profile, measuring it if none is cached "
                      "(the default)")
    what.add_argument("--from-run", metavar="RUN_DIR", help="refit the profile to a finished run (DIR/run, or "
                      "the program folder DIR): its measured step and per-stage times")
    k.add_argument("--refresh", action="store_true", help="with --machine: measure again, replacing the cache")
    k.set_defaults(func=cmd_calibrate)

    v = sub.add_parser("verify", help="train the program and the unpartitioned model side by side, compare",
                       epilog=EXAMPLES["verify"], formatter_class=fmt,
                       description="Train the program and the unpartitioned model side by side, compare. "
                       "This executes the folder's Python code: verify only folders you trust (README \"Trust model\").")
    v.add_argument("dir")
    v.add_argument("--steps", type=int, default=3)
    v.set_defaults(func=cmd_verify)
    e = sub.add_parser("export", help="a checkpoint as consolidated weights (and config) from_pretrained loads",
                       epilog=EXAMPLES["export"], formatter_class=fmt)
    e.add_argument("target", help="program folder, its run folder, a checkpoint folder, or one step_N in it")
    e.add_argument("-o", "--output", required=True, help="folder to write (must not exist)")
    e.add_argument("--program", metavar="DIR", help="the program folder, when the checkpoints are not beside it")
    e.set_defaults(func=cmd_export)
    data_command.add_parser(sub, fmt)  # partitioner/cli/data.py: prepare | check
    generate_command.add_parser(sub, fmt)  # partitioner/cli/generate.py
    elastic_command.add_parser(sub, fmt)  # partitioner/cli/elastic.py: replan
    for each in sub.choices.values():  # `partitioner compile ... -v` too; SUPPRESS keeps `partitioner -v compile`
        each.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="show tracebacks on errors (compile: and the solver's per-candidate lines)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps no public map of them
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in argv if w in commands), None)
    if command is not None:  # `--mtbf -5h`: the value to its own check, not argparse's "expected one argument"
        argv = dash_values_joined(argv, commands[command])
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused, never dropped: a misspelt flag would run with the default and say nothing
        from runtime.launch.run_options import unknown_flag_message

        known = list(commands[args.command]._option_string_actions)
        print(f"error: {unknown_flag_message(unknown, known, f'partitioner {args.command}')}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - user-facing boundary
        from partitioner.errors import PartitionerError

        end_open_lines()
        if isinstance(exc, ImportError) and not args.verbose:  # Note [the real import error] in runtime/errors.py
            print(f"error: {import_failure(exc)} (-v shows the traceback)", file=sys.stderr)
            return EXIT_USAGE
        if args.verbose or not isinstance(exc, (ValueError, PartitionerError, OSError, RuntimeError)):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
