"""The flags a run takes, as one table (``FLAGS``) and one frozen ``RunOptions``: `partitioner run`
and every rank's train.py (``runtime.launch.rank.main``) parse the same table, check the same way, and
refuse a flag they do not know.

Note [one flag table]: a run flag is declared once, here, with the side that takes it: "both"
(`partitioner run` checks it and passes it on to every rank's train.py), "run" (`partitioner run`
only: torchrun's) or "rank" (train.py only). ``RunOptions`` checks every value that needs no
program when it is built (``__post_init__``) and what needs the program's world size, sharding and
steps in ``check_for``; `partitioner run` calls both before torchrun starts, so a mistake costs no
worker start-up, and each rank calls them again on the same text (``to_argv`` writes it), so a
train.py started by hand is held to the same rules. An unknown flag is refused with the nearest
known one, never dropped: a misspelt ``--chekpoint-every 5`` would otherwise train with the plan's
cadence and say nothing.

No torch at import: `partitioner run --help` and a usage error answer in milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Callable

from runtime.errors import FlagError
from runtime.features import registry
from runtime.program.parts import Values
from runtime.resilience import faults

# = runtime.resilience.checkpoint.delta.MAX_FULL_EVERY, repeated: that module loads torch
# (tests/unit/test_hardening_chains.py checks they agree)
MAX_FULL_EVERY = 64
MAX_HOST_TIMEOUT_S = 86400.0  # a day, past any host's reboot; torchrun's rendezvous takes whole seconds (inf: none)


@dataclass(frozen=True)
class Flag:
    name: str                          # "--checkpoint-every"
    type: Callable | None              # int, float or str; None: a switch
    help: str
    side: str = "both"                 # "both" | "run" | "rank" (Note [one flag table])
    choices: tuple[str, ...] = ()
    repeat: bool = False               # may be given several times (a list)
    exclusive: str | None = None       # flags sharing this name exclude each other
    short: str | None = None           # "-q"
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


MEMORY_TIER_MODES = ("off", "auto", "none", "copy", "parity")

FLAGS: tuple[Flag, ...] = (
    Flag("--steps", int, "train until this many steps are done (default: the plan's steps)"),
    Flag("--checkpoint-dir", str, "where checkpoints go (default DIR/checkpoints)"),
    Flag("--run-dir", str, "where metrics.jsonl and final/ go (default DIR/run)"),
    Flag("--checkpoint-every", int, "checkpoint every K steps (0: only the last; default: the plan's)",
         exclusive="cadence"),
    Flag("--mtbf", str, "mean time between failures (e.g. 6h): the interval by Young/Daly from the measured "
         "snapshot stall", exclusive="cadence"),
    Flag("--keep-checkpoints", int, "keep the newest N checkpoints (default 3)"),
    Flag("--no-checkpoint", None, "neither resume from nor write checkpoints", side="rank"),
    Flag("--max-restarts", int, "torchrun restarts of the whole job after a rank dies (default 0)", side="run"),
    Flag("--fail-at", str, "RANK:STEP[:exit|kill|hang] (fault injection, first attempt)", repeat=True),
    Flag("--fail-persist", str, "RANK:STEP:BYTES: kill RANK after BYTES bytes of its shard of checkpoint STEP "
         "(fault injection, first attempt)"),
    Flag("--checkpoint-compression", str, "lossless: each tensor a zstd'd XOR delta against the previous "
         "checkpoint, a full one every --checkpoint-full-every (8)", choices=("none", "lossless")),
    Flag("--checkpoint-full-every", int, "with lossless: a full checkpoint every K (default 8, at most 64)"),
    Flag("--flip-bit", str, "RANK:STEP[:TENSOR]: flip one bit of a parameter before STEP (silent data "
         "corruption drill, first attempt)", repeat=True),
    Flag("--sdc-every", int, "compare the replicas' digests every K steps (0: never; default: the plan's)"),
    Flag("--fault-matmul", str, "RANK:STEP[:permanent]: a faulty matmul on RANK from STEP on (compute-fault drill, "
         "first attempt; transient: gone after a rollback)", repeat=True),
    Flag("--collective-timeout", float, "seconds every collective may wait (default: the plan's)"),
    Flag("--memory-tier", str, "in-memory checkpoints every step in host shared memory, with redundancy across "
         "hosts: none (own host only), copy (a peer holds a full copy), parity (XOR over a group) "
         "(default: the plan's choice)", choices=MEMORY_TIER_MODES),
    Flag("--memory-every", int, "memory snapshot every K steps (default 1)"),
    Flag("--parity-group", int, "hosts per parity group (default: the plan's)"),
    Flag("--hosts", str, "host of each rank, e.g. 0,0,1,1 (default $PARTITIONER_HOSTS, else LOCAL_WORLD_SIZE "
         "ranks a host)"),
    Flag("--memory-dir", str, "the memory tier's shared-memory folder (default /dev/shm)"),
    Flag("--fail-host", str, "HOST:STEP[:ATTEMPT|:permanent]: kill every rank of HOST before STEP and wipe its memory "
         "tier (fault injection, first attempt); permanent (with --elastic): the host never comes back", repeat=True),
    Flag("--elastic", None, "one torchrun elastic agent per host (--hosts): when a host is gone for good, the survivors "
         "re-plan for themselves and go on from the newest state the tiers hold (Note [elastic run] in "
         "runtime/launch/elastic.py)"),
    Flag("--host-timeout", float, "with --elastic: seconds a lost host may take to come back before the survivors "
         "re-plan without it (default 5)", side="run"),
    Flag("--quiet", None, "rank 0 prints every Nth step and the final summary only (no schedule table)",
         short="-q"),
    Flag("--log-every", int, "with --quiet: the step lines' interval (default: about 10 lines per run)",
         metavar="N"),
) + tuple(Flag(s.flag, s.type, s.help, metavar=s.metavar) for s in registry.settings(side="run"))
FEATURE_FLAGS = {s.key: s for s in registry.settings(side="run")}  # Note [one feature, one module]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What one run was asked for on its command line (``FLAGS``; None: not given, the plan decides)."""

    steps: int | None = None
    checkpoint_dir: str | None = None
    run_dir: str | None = None
    checkpoint_every: int | None = None
    mtbf: str | None = None
    keep_checkpoints: int | None = None
    no_checkpoint: bool = False
    max_restarts: int = 0
    fail_at: tuple[str, ...] = ()
    fail_persist: str | None = None
    checkpoint_compression: str | None = None
    checkpoint_full_every: int | None = None
    flip_bit: tuple[str, ...] = ()
    sdc_every: int | None = None
    fault_matmul: tuple[str, ...] = ()
    collective_timeout: float | None = None
    memory_tier: str | None = None
    memory_every: int | None = None
    parity_group: int | None = None
    hosts: str | None = None
    memory_dir: str | None = None
    fail_host: tuple[str, ...] = ()
    elastic: bool = False
    host_timeout: float | None = None
    quiet: bool = False
    log_every: int | None = None
    features: Values = field(default_factory=Values)  # the features' run flags given, by setting key

    def __post_init__(self):
        object.__setattr__(self, "features", Values(self.features))
        for name in ("fail_at", "flip_bit", "fail_host", "fault_matmul"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        _check_values(self)

    # -- parsing and writing ---------------------------------------------------------------------

    @staticmethod
    def parse(argv: list[str], *, side: str = "rank", prog: str = "train.py") -> "RunOptions":
        """``argv`` read by the table's flags of ``side``; an unknown flag is a FlagError naming it
        and the nearest known flag."""
        parser = argparse.ArgumentParser(prog=prog, description="train this program's rank", allow_abbrev=False)
        add_flags(parser, side)
        known, unknown = parser.parse_known_args(dash_values_joined(argv, parser))
        if unknown:
            raise FlagError(unknown_flag_message(unknown, flag_names(side), prog))
        return RunOptions.from_namespace(known)

    @staticmethod
    def from_namespace(namespace) -> "RunOptions":
        given = {f.dest: getattr(namespace, f.dest) for f in FLAGS if getattr(namespace, f.dest, None) is not None}
        features = {k: given.pop(k) for k in FEATURE_FLAGS if k in given}
        return RunOptions(**given, features=features)

    def to_argv(self) -> list[str]:
        """These options as train.py's flags: the ones given, of the sides a rank takes."""
        out: list[str] = []
        for flag in FLAGS:
            if flag.side == "run":
                continue
            value = self.features.get(flag.dest) if flag.dest in FEATURE_FLAGS else getattr(self, flag.dest)
            if flag.type is None:
                out += [flag.name] if value else []
            elif flag.repeat:
                for each in value:
                    out += [flag.name, str(each)]
            elif value is not None:
                out += [flag.name, str(value)]
        return out

    def replace(self, **changes) -> "RunOptions":
        return dataclasses.replace(self, **changes)

    # -- what the options mean -------------------------------------------------------------------

    @property
    def mtbf_s(self) -> float | None:
        from runtime.resilience.checkpoint.interval import parse_duration_s  # only when given: keeps --help light

        return None if self.mtbf is None else parse_duration_s(self.mtbf)

    def host_list(self) -> list[int] | None:
        return None if self.hosts is None else [int(h) for h in self.hosts.split(",")]

    def check_for(self, *, world_size: int, sharded: bool, steps: int | None = None, rank_params: dict[int, list[str]] | None = None,
                  plan_memory_tier: str | None = None) -> None:
        """The checks that need the program: every named rank exists, every fault fires, nothing
        asks a sharded program for the replica check (the features' own: ``Feature.run_refusal``).
        ``steps``: the steps this run trains, when known (default: --steps). ``rank_params``: each
        rank's parameter names, so a --flip-bit TENSOR no rank holds is refused before any starts.
        ``plan_memory_tier``: the plan's memory-tier mode ("off" when it has none; None: not
        checked), so a --memory-dir no tier would use is refused, not ignored."""

        steps = self.steps if steps is None else steps
        last = f"0..{world_size - 1}"
        for text in self.fail_at:
            fault = faults.parse_fail_at(text)
            if not 0 <= fault.rank < world_size:  # it would never fire
                raise FlagError(f"--fail-at {text}: rank {fault.rank} does not exist, the program runs "
                                f"{world_size} ranks: give a rank in {last}")
            if fault.step < 0 or (steps is not None and fault.step >= steps):
                where = f"0..{steps - 1} (--steps {steps})" if steps is not None else ">= 0"
                raise FlagError(f"--fail-at {text}: step {fault.step} is never reached, so the fault never "
                                f"fires: give a step in {where}")
        if sharded and (self.flip_bit or (self.sdc_every or 0) > 0):
            from runtime.resilience.sdc import sharded_refusal  # Note [no replica check on sharded state]; torch: when asked

            raise FlagError(sharded_refusal(f"--flip-bit {self.flip_bit[0]}" if self.flip_bit
                                            else f"--sdc-every {self.sdc_every}"))
        for text in self.flip_bit:
            flip = faults.parse_flip_bit(text)
            if flip.rank >= world_size or (steps is not None and flip.step >= steps):
                raise FlagError(f"--flip-bit {text}: rank {flip.rank} step {flip.step} is never reached (the "
                                f"program runs {world_size} ranks{f' for {steps} steps' if steps else ''})")
            held = (rank_params or {}).get(flip.rank)
            if flip.tensor is not None and held is not None and flip.tensor not in held:
                raise FlagError(f"--flip-bit {text}: rank {flip.rank} holds no parameter {flip.tensor!r}; it holds "
                                f"{sorted(held)[:4]}{' ...' if len(held) > 4 else ''}")
        for text in self.fault_matmul:
            fault = faults.parse_fault_matmul(text)
            if fault.rank >= world_size or (steps is not None and fault.step >= steps):
                raise FlagError(f"--fault-matmul {text}: rank {fault.rank} step {fault.step} is never reached (the "
                                f"program runs {world_size} ranks{f' for {steps} steps' if steps else ''})")
        if self.memory_dir is not None and plan_memory_tier is not None \
                and (self.memory_tier or plan_memory_tier) == "off":
            why = ("--memory-tier off" if self.memory_tier == "off"
                   else "the plan has no memory tier and no --memory-tier asks for one")
            raise FlagError(f"--memory-dir {self.memory_dir}: no memory tier would use it ({why}): leave out "
                            "--memory-dir, or pass --memory-tier auto to keep snapshots there")
        # as memtier.groups.hosts_of_ranks places them (torch-free here): LOCAL_WORLD_SIZE to a node
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size))
        hosts = [r // local for r in range(world_size)]
        if self.hosts is not None:
            hosts = self.host_list()
            if len(hosts) != world_size:
                example = ",".join(str(r * 2 // world_size) for r in range(world_size))
                raise FlagError(f"--hosts {self.hosts}: give the host of each of the {world_size} ranks, comma-"
                                f"separated (e.g. {example})")
        placed_by_env = self.hosts is None and os.environ.get("PARTITIONER_HOSTS")  # the workers' own layout
        for text in () if placed_by_env else self.fail_host:  # a host no rank runs on is never lost
            host, step, _ = faults.parse_fail_host(text)
            if host not in hosts:
                raise FlagError(f"--fail-host {text}: no rank runs on host {host} (hosts "
                                f"{', '.join(map(str, sorted(set(hosts))))}{'' if self.hosts else ': pass --hosts'})")
            if steps is not None and step >= steps:
                raise FlagError(f"--fail-host {text}: step {step} is never reached (--steps {steps}), so the host is "
                                f"never lost: give a step in 0..{steps - 1}")


def _check_values(o: RunOptions) -> None:
    """Each value on its own (no program needed); FlagError naming the flag, the value and the fix."""

    def at_least(name: str, low, fix: str):
        value = getattr(o, name)
        if value is not None and not value >= low:
            raise FlagError(f"--{name.replace('_', '-')} {value}: {fix}")

    at_least("steps", 1, "train at least 1 step (e.g. --steps 20)")
    at_least("max_restarts", 0, "give 0 (no restarts) or more")
    at_least("checkpoint_every", 0, "must be a number of steps >= 0 (0: only the last)")
    at_least("keep_checkpoints", 1, "keep at least 1")
    at_least("checkpoint_full_every", 1, "give 1 or more (1: every checkpoint full)")
    if o.checkpoint_full_every is not None and o.checkpoint_full_every > MAX_FULL_EVERY:
        raise FlagError(f"--checkpoint-full-every {o.checkpoint_full_every}: at most {MAX_FULL_EVERY} (every "
                        "resume reads the whole delta chain and retention keeps all of it); give 1.."
                        f"{MAX_FULL_EVERY} (default 8)")
    at_least("sdc_every", 0, "give a number of steps >= 0 (0: no replica check)")
    for key, value in o.features.items():
        if key not in FEATURE_FLAGS:
            raise FlagError(f"RunOptions(features={{{key!r}: ...}}): no run flag has that key; the features' are "
                            f"{', '.join(sorted(FEATURE_FLAGS))}")
        if (why := FEATURE_FLAGS[key].flag_error(value)) is not None:
            raise FlagError(why)
    for feature in registry.FEATURES:
        if (why := feature.flags_refusal(o.features)) is not None:
            raise FlagError(why)
    at_least("memory_every", 1, "snapshot every 1 or more steps")
    at_least("parity_group", 2, "a parity group holds 2 or more hosts")
    at_least("log_every", 1, "print every 1 or more steps")
    if o.collective_timeout is not None and not o.collective_timeout > 0:
        raise FlagError(f"--collective-timeout {o.collective_timeout}: give seconds > 0 "
                        "(e.g. --collective-timeout 300)")
    if o.checkpoint_every is not None and o.mtbf is not None:
        raise FlagError(f"--checkpoint-every {o.checkpoint_every} and --mtbf {o.mtbf}: give one (--mtbf picks "
                        "the interval)")
    if o.checkpoint_compression not in (None, "none", "lossless"):
        raise FlagError(f"--checkpoint-compression {o.checkpoint_compression}: give none or lossless")
    if o.memory_tier not in (None,) + MEMORY_TIER_MODES:
        raise FlagError(f"--memory-tier {o.memory_tier}: give one of {', '.join(MEMORY_TIER_MODES)}")
    if o.log_every is not None and not o.quiet:
        raise FlagError(f"--log-every {o.log_every} thins the step lines of --quiet: add --quiet")
    o.mtbf_s  # noqa: B018 - parsed now: a bad duration fails here, not in every worker
    for text in o.fail_at:
        faults.parse_fail_at(text)
    if o.fail_persist is not None:
        faults.parse_fail_persist(o.fail_persist)
    for text in o.flip_bit:
        faults.parse_flip_bit(text)
    for text in o.fail_host:
        if faults.parse_fail_host(text)[2] == faults.PERMANENT and not o.elastic:
            raise FlagError(f"--fail-host {text}: a host lost for good needs --elastic (the survivors re-plan); add "
                            "--elastic, or give HOST:STEP[:ATTEMPT] for a host that comes back")
    if o.host_timeout is not None and not (o.elastic and 0 < o.host_timeout <= MAX_HOST_TIMEOUT_S):
        raise FlagError(f"--host-timeout {o.host_timeout}: give seconds > 0 with --elastic, at most "
                        f"{MAX_HOST_TIMEOUT_S:g} (a day) (e.g. --elastic --host-timeout 5)")
    for text in o.fault_matmul:
        faults.parse_fault_matmul(text)
    if o.hosts is not None:
        try:
            hosts = o.host_list()
        except ValueError:
            hosts = [-1]
        if min(hosts) < 0:
            raise FlagError(f"--hosts {o.hosts}: give the host of each rank as whole numbers >= 0, comma-separated "
                            "(e.g. 0,0,1,1)")


# -- the table as argparse flags ------------------------------------------------------------------


def flags_of(side: str) -> tuple[Flag, ...]:
    """The flags ``side`` ("run": `partitioner run`, "rank": train.py) takes."""
    return tuple(f for f in FLAGS if f.side in ("both", side))


def flag_names(side: str) -> list[str]:
    return [f.name for f in flags_of(side)] + [f.short for f in flags_of(side) if f.short]


def add_flags(parser: argparse.ArgumentParser, side: str) -> None:
    """Every flag of ``side`` on ``parser``, with no defaults: a flag not given stays None, so the
    plan's value applies (``RunOptions``'s defaults)."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for flag in flags_of(side):
        target = parser
        if flag.exclusive:
            if flag.exclusive not in groups:
                groups[flag.exclusive] = parser.add_mutually_exclusive_group()
            target = groups[flag.exclusive]
        names = [flag.short, flag.name] if flag.short else [flag.name]
        kwargs: dict = {"help": flag.help, "dest": flag.dest}
        if flag.type is None:
            kwargs.update(action="store_true", default=None)
        else:
            kwargs.update(type=flag.type, action="append" if flag.repeat else "store")
            if flag.choices:
                kwargs["choices"] = list(flag.choices)
            if flag.metavar:
                kwargs["metavar"] = flag.metavar
        target.add_argument(*names, **kwargs)


def dash_values_joined(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with each value that starts with "-" and names no flag written ``--flag=VALUE``.
    argparse reads ``--mtbf -5h`` as a flag missing its value ("expected one argument"), and
    ``--fail-at -1:3`` likewise: joined, the value reaches its own check, which names it and the fix
    (``--mtbf '-5h': the mean time between failures must be more than 0``)."""
    takes = {s for a in parser._actions if a.option_strings and a.nargs is None for s in a.option_strings}
    known = set(parser._option_string_actions)
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":  # what follows is positional
            return out + list(argv[i:])
        after = argv[i + 1] if i + 1 < len(argv) else None
        if (word in takes and after is not None and after.startswith("-") and after != "--"
                and after.split("=", 1)[0] not in known):
            out.append(f"{word}={after}")
            i += 2
        else:
            out.append(word)
            i += 1
    return out


def unknown_flag_message(unknown: list[str], known: list[str], prog: str) -> str:
    """One line: the first unknown flag (or stray word), the nearest known flag, and where the list is."""
    flag = next((u for u in unknown if u.startswith("-")), unknown[0])
    name = flag.split("=", 1)[0]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not name.startswith("-"):
        return f"{prog}: unexpected argument {name!r}: flags take one value each (see {prog} --help)"
    hint = f"did you mean {near[0]}?" if near else f"see {prog} --help for the flags"
    return f"{prog}: unknown flag {name}: {hint}"
