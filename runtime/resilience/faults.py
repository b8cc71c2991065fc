"""Fault injection, every kind in one room: where a test or a benchmark makes a rank, a host or a
persist die, and nothing else. No process group, no other runtime module imported but runtime.errors
(the rooms that fire these import this one). A spec that does not parse is a FlagError naming it and
its form, raised when `partitioner run` and each rank read their flags, before any worker starts.

- ``--fail-at RANK:STEP[:exit|kill|hang]`` (``Fault``, ``step_hook``): rank RANK, just before it
  starts step STEP (0-based, = make_batch's step): "exit" leaves with os._exit(3), "kill" sends
  itself SIGKILL, "hang" sleeps forever (its peers fail through the collective timeout, then
  torchrun's agent stops it).
- ``--fail-persist RANK:STEP:BYTES`` (``PersistFault``): rank RANK is SIGKILLed after writing
  BYTES bytes while persisting the checkpoint of step STEP (steps done), through a ``FaultPoint``.
- ``--fail-host HOST:STEP[:ATTEMPT]`` (``parse_fail_host``, ``host_hook``): every rank of HOST
  marks the host lost (the memory tier wipes a lost host's shared memory at the restart) and
  SIGKILLs itself before step STEP, in that attempt of the torchrun job (default the first).
  ``HOST:STEP:permanent`` (needs --elastic, runtime/launch/elastic.py): the host never comes back,
  its torchrun agent is killed with it, so the survivors re-plan (Note [elastic run]).
- ``--flip-bit RANK:STEP[:TENSOR]`` (``BitFlip``, ``flip_hook``): just before step STEP, rank RANK
  flips one bit of element 0 of parameter TENSOR (original name; default its first parameter; a
  tensor-parallel one: of its local piece, Note [a flip without a collective]):
  the silent data corruption runtime/resilience/sdc.py must find. Fires once per process, first attempt only.
- ``--fault-matmul RANK:STEP[:permanent]`` (``MatmulFault``, ``matmul_hook``): from step STEP on,
  rank RANK adds a small delta to the output of the first matmul of each stage forward (Note [a
  faulty matmul]): the compute fault runtime/resilience/canary.py must catch. First attempt only.
- ``FaultPoint``: die after a number of bytes written or before a numbered file operation of a
  checkpoint persist (Note [crash consistency] in runtime/resilience/checkpoint/manifest.py); action "raise"
  is the in-process stand-in (``SimulatedCrash``) for the one-process drills.

--fail-at and --fail-persist fire only in the first attempt of a torchrun job
(TORCHELASTIC_RESTART_COUNT unset or 0), so the restarted workers run clean. Before dying, a fault
appends {"rank", "step", "mode", "time_unix"} to RUN_DIR/faults.jsonl (how benchmarks measure the
time from a kill to the first resumed step). ``say`` is the one way these rooms (checkpoint,
memtier, recovery) write a rank's line to stderr.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass

from runtime.errors import FlagError

MODES = ("exit", "kill", "hang")


def say(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


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
        raise FlagError(f"--fail-at {text!r}: write RANK:STEP[:MODE], e.g. 1:5:kill") from None
    if mode not in MODES:
        raise FlagError(f"--fail-at {text!r}: mode {mode!r} is not one of {', '.join(MODES)}: write RANK:STEP[:MODE], "
                        "e.g. 1:5:kill")
    return fault


def parse_fail_persist(text: str) -> PersistFault:
    try:
        rank, step, nbytes = (int(x) for x in text.split(":"))
        if min(rank, step, nbytes) < 0:
            raise ValueError
    except ValueError:
        raise FlagError(f"--fail-persist {text!r}: write RANK:STEP:BYTES, e.g. 0:4:1000") from None
    return PersistFault(rank, step, nbytes)


@dataclass(frozen=True)
class BitFlip:
    rank: int
    step: int
    tensor: str | None = None


def parse_flip_bit(text: str) -> BitFlip:
    parts = str(text).split(":", 2)
    try:
        if len(parts) < 2 or int(parts[0]) < 0 or int(parts[1]) < 0:
            raise ValueError
        flip = BitFlip(int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 and parts[2] else None)
    except ValueError:
        raise FlagError(f"--flip-bit {text!r}: write RANK:STEP[:TENSOR], e.g. 1:5 or 1:5:layers.0.weight") from None
    return flip


def _stored(tensor):
    """The plain tensor this rank stores for ``tensor``.

    Note [a flip without a collective]: a
    tensor-parallel parameter is a DTensor (vocab-split embedding, column/row linears, replicated
    norms), and any op on it is DTensor's (a ``view(-1)`` of a shard all-gathers it over the tensor
    group); run on the named rank alone, that collective waits for peers that never join, and the
    job hangs until the collective timeout. The drill flips this rank's local piece instead (its
    shard, or its copy of a replicated parameter), shared storage, no collective: exactly the
    corruption one bad device makes. runtime/resilience/sdc.py digests the same local pieces."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor (duck-typed: no runtime module imported here)
    return tensor if local is None else local


def flip_bit(tensor) -> int:
    """Flip one bit of element 0 of ``tensor`` in place (bit 20 of a 4-byte word, a low mantissa
    bit of a float32: the value changes, stays finite); returns the bit's index in its word. A
    DTensor: element 0 of this rank's local piece (Note [a flip without a collective])."""
    # lazy: loads torch
    import torch

    flat = _stored(tensor).detach().view(-1)
    size = flat.element_size()
    word = torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8
    bit = {torch.int32: 20, torch.int16: 4, torch.uint8: 2}[word]
    words = flat.view(word)
    with torch.no_grad():
        words[0:1].bitwise_xor_(torch.tensor(1 << bit, dtype=word, device=words.device))
    return bit


def flip_hook(flips: list[BitFlip], rank: int, params: dict, run_dir: str | None = None):
    """A ``before_step(step)`` callable for --flip-bit on ``rank`` (``params``: original name ->
    parameter), or None when none can fire. Each flip fires once (a rollback re-runs the step
    clean). An unknown TENSOR is a FlagError naming the rank's parameters."""
    mine = {f.step: f for f in flips if f.rank == rank}
    if not mine or not first_attempt():
        return None
    for f in mine.values():
        if f.tensor is not None and f.tensor not in params:
            raise FlagError(f"--flip-bit {f.rank}:{f.step}:{f.tensor}: rank {rank} holds no parameter "
                            f"{f.tensor!r}; it holds {sorted(params)[:8]}{' ...' if len(params) > 8 else ''}")
    fired: set[int] = set()

    def before_step(step: int) -> None:
        if step in mine and step not in fired:
            fired.add(step)
            f = mine[step]
            name = f.tensor or next(iter(params))
            bit = flip_bit(params[name])
            record(run_dir, rank, step, f"flip-bit {name}")
            piece = " (this rank's local piece)" if _stored(params[name]) is not params[name] else ""
            say(rank, f"fault injection: flipped bit {bit} of {name}[0]{piece} before step {step}")

    return before_step


@dataclass(frozen=True)
class MatmulFault:
    rank: int
    step: int
    permanent: bool = False


def parse_fault_matmul(text: str) -> MatmulFault:
    parts = str(text).split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "permanent"):
            raise ValueError
        fault = MatmulFault(int(parts[0]), int(parts[1]), len(parts) == 3)
        if fault.rank < 0 or fault.step < 0:
            raise ValueError
    except ValueError:
        raise FlagError(f"--fault-matmul {text!r}: write RANK:STEP[:permanent], e.g. 1:5 or 1:5:permanent") from None
    return fault


# Note [a faulty matmul]: the silent corruption a replica digest cannot see is a wrong product in a
# forward or backward matmul: it is averaged into every replica's gradient by the all-reduce, and
# the replicas stay equal. The drill makes one: while armed, the first matmul-family call (F.linear,
# matmul, mm, bmm, addmm, ``@``, or their aten overloads) of each forward of the rank's stage
# modules returns its product scaled by 1 + delta (every element: one alone can be cut by a relu or
# be a causal query no output reads), under a TorchFunctionMode around the
# module's forward, so the corruption flows on through autograd like a real one (and also hits a
# canary re-run on that rank: a bad device is bad for every computation it makes). Armed from step
# STEP on; transient: disarmed when the job goes back to an earlier step (a rollback: the device
# recovered, the re-run steps are clean); permanent: never disarmed (a rollback meets it again).
# delta is a part in a thousand or two epsilons of the product's own dtype, whichever is larger: a
# fixed 1e-3 is under half a bf16 ulp (2**-9 of the value or more), so under bf16-mixed (the GPU
# default) every product rounded back to itself and the drill faulted nothing while saying it
# had. With delta >= 2 eps, x * (1 + delta) moves every nonzero finite x by at least two ulps of
# its dtype whatever the rounding, in fp32, bf16, fp16 and the fp8 formats alike.
MATMUL_DELTA = 1e-3


def matmul_delta(dtype) -> float:
    """The relative perturbation of a faulty product of ``dtype`` (Note [a faulty matmul])."""
    # lazy: loads torch
    import torch

    return max(MATMUL_DELTA, 2 * torch.finfo(dtype).eps)


@dataclass
class _MatmulState:
    """What one rank's --fault-matmul is doing (Note [a faulty matmul])."""

    armed: bool = False
    cleared: bool = False   # a transient fault after a rollback
    last_step: int = -1
    fired: int = 0          # products perturbed so far


def _matmul_mode(fault_state: _MatmulState):
    """A TorchFunctionMode perturbing the first matmul of each forward it wraps (lazy: torch)."""
    # lazy: loads torch
    import torch
    from torch.overrides import TorchFunctionMode  # lazy: torch, as above

    aten = torch.ops.aten  # compiled stage files call the aten overloads (Note [stage code])
    matmuls = {torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm,
               torch.Tensor.matmul, torch.Tensor.__matmul__, aten.linear.default, aten.mm.default,
               aten.addmm.default, aten.bmm.default, aten.matmul.default}

    class FirstMatmulOff(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.done = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not self.done and func in matmuls and isinstance(out, torch.Tensor) and out.is_floating_point():
                self.done = True
                fault_state.fired += 1
                out = out * (1.0 + matmul_delta(out.dtype))
            return out

    return FirstMatmulOff


def matmul_hook(fault_list: list[MatmulFault], rank: int, modules: list, run_dir: str | None = None):
    """A ``before_step(step)`` callable arming --fault-matmul on ``rank`` (Note [a faulty matmul]),
    or None when none names it (or in a later attempt). Wraps each of ``modules``' forward."""
    mine = [f for f in fault_list if f.rank == rank]
    if not mine or not first_attempt():
        return None
    fault = min(mine, key=lambda f: f.step)
    state = _MatmulState()
    mode = _matmul_mode(state)

    def wrap(forward):
        def faulty(*args, **kwargs):
            if not state.armed:
                return forward(*args, **kwargs)
            with mode():
                return forward(*args, **kwargs)

        return faulty

    for m in modules:
        m.forward = wrap(m.forward)

    def before_step(step: int) -> None:
        if step <= state.last_step and not fault.permanent:
            state.cleared = True  # a rollback: the transient fault is gone
        state.last_step = step
        was = state.armed
        state.armed = step >= fault.step and not state.cleared
        if state.armed and not was:
            kind = "permanent" if fault.permanent else "transient"
            record(run_dir, rank, step, f"fault-matmul {kind}")
            say(rank, f"fault injection: a faulty matmul ({kind}) from step {step} on")

    return before_step


PERMANENT = -1  # the attempt of a --fail-host HOST:STEP:permanent: it fires in the first attempt, for good


def parse_fail_host(text: str) -> tuple[int, int, int]:
    """"HOST:STEP[:ATTEMPT|:permanent]" -> (host, step, attempt); attempt defaults to 0 (the
    first); "permanent" is PERMANENT (the first attempt, and the host's agent dies too)."""
    try:
        words = text.split(":")
        if len(words) == 3 and words[2] == "permanent":
            words[2] = str(PERMANENT)
        parts = [int(x) for x in words]
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] < PERMANENT):
            raise ValueError
    except ValueError:
        raise FlagError(f"--fail-host {text!r}: write HOST:STEP[:ATTEMPT] or HOST:STEP:permanent, e.g. 1:3") from None
    if min(parts[:2]) < 0:  # it would never fire: a drill that passes without its fault
        raise FlagError(f"--fail-host {text!r}: host {parts[0]} step {parts[1]} is never reached, so the host is never "
                        "lost: give a host and a step >= 0, e.g. 1:3")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else 0


def attempt() -> int:
    """Which attempt of the torchrun job this worker is (0: the first)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def first_attempt() -> bool:
    return attempt() == 0


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


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # SIGKILL is asynchronous only in theory; never return


def fire(fault: Fault, run_dir: str | None = None) -> None:
    """Die (or hang) the way ``fault`` says."""
    record(run_dir, fault.rank, fault.step, fault.mode)
    say(fault.rank, f"fault injection: {fault.mode} before step {fault.step}")
    if fault.mode == "exit":
        os._exit(3)
    if fault.mode == "kill":
        _sigkill_self()
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


def host_hook(fail_hosts, *, host: int, rank: int, marker: str, run_dir: str | None = None):
    """A ``before_step(step)`` callable for --fail-host (``fail_hosts``: (host, step, attempt)
    triples), or None when nothing can fire on ``rank`` of ``host`` in this attempt: before a
    chosen step it writes ``marker`` (the memory tier's lost-host file), records the fault and
    SIGKILLs itself."""
    mine = {s for h, s, a in fail_hosts if h == host and (a == attempt() or (a == PERMANENT and attempt() == 0))}
    permanent = {s for h, s, a in fail_hosts if h == host and a == PERMANENT}
    if not mine:
        return None

    def before_step(step: int) -> None:
        if step in mine:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            with open(marker, "w") as fh:
                fh.write(f"{step}\n")
            record(run_dir, rank, step, "host-permanent" if step in permanent else "host")
            say(rank, f"fault injection: host {host} lost{' for good' if step in permanent else ''} before step {step}")
            if step in permanent:  # the whole host goes: its torchrun agent (our parent) with it
                try:
                    os.kill(os.getppid(), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _sigkill_self()

    return before_step


# ---------------------------------------------------------------------------------------------
# Fault points inside a checkpoint persist (Note [crash consistency])


class SimulatedCrash(BaseException):
    """Raised by a FaultPoint with action="raise": the in-process stand-in for SIGKILL (a
    BaseException, so no ``except Exception`` on the way tidies anything up)."""


@dataclass
class FaultPoint:
    """Die after ``after_bytes`` bytes written, or just before operation number ``before_op``
    (0-based; operations: open, write chunk, fsync, rename, mkdir, unlink, rmtree, dir fsync),
    counting over everything done with this object. action: "sigkill" or "raise"."""

    after_bytes: int | None = None
    before_op: int | None = None
    action: str = "sigkill"
    bytes_done: int = 0
    ops_done: int = 0

    def _die(self, where: str):
        if self.action == "raise":
            raise SimulatedCrash(where)
        sys.stderr.write(f"[fault] killing pid {os.getpid()} during checkpoint persist: {where}\n")
        sys.stderr.flush()
        _sigkill_self()

    def op(self, what: str) -> None:
        if self.before_op is not None and self.ops_done >= self.before_op:
            self._die(f"before op {self.ops_done} ({what})")
        self.ops_done += 1

    def allow_bytes(self, n: int) -> int:
        """How many of the next ``n`` bytes may be written before dying."""
        if self.after_bytes is None:
            return n
        return max(0, min(n, self.after_bytes - self.bytes_done))

    def wrote(self, n: int, what: str) -> None:
        self.bytes_done += n
        if self.after_bytes is not None and self.bytes_done >= self.after_bytes:
            self._die(f"after {self.bytes_done} bytes ({what})")


class _NoFault(FaultPoint):
    def op(self, what: str) -> None:
        pass

    def wrote(self, n: int, what: str) -> None:
        pass


def armed(fault: FaultPoint | None) -> FaultPoint:
    """``fault``, or a point that never fires (so the writers need no ``if fault`` of their own)."""
    return fault if fault is not None else _NoFault()
