"""Launching a program under torchrun on this host: the command line, its environment, a free port.

The one place that builds torchrun commands: `partitioner run`, `partitioner verify`, the tests and
the benchmarks all launch through here, so a fix to how we launch (docs/design.md §2: the shared
rendezvous store) lands everywhere at once. Standard library only: generated programs and the
compiler both import it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Sequence

from runtime.launch.agent_output import start_forwarding


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (single-host runs bind loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: str | Path, nproc: int, *, args: Sequence[str] = (),
                     max_restarts: int = 0, rendezvous: str | None = None) -> list[str]:
    """``torchrun`` of ``script`` (a .py path, or ``-m package.module``) with ``nproc`` workers on
    this host: the rendezvous is the file ``rendezvous`` (``rendezvous_file()`` where not given),
    no TCP store, and the workers' store is on 127.0.0.1 (Note [no TCP rendezvous on one host])."""
    target = ["-m", str(script)[3:]] if str(script).startswith("-m ") else [str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            *rendezvous_args(rendezvous or rendezvous_file()), "--max-restarts", str(max_restarts),
            *target, *map(str, args)]


def command_text(nproc: int, script: str) -> str:
    """The torchrun line a person types on one host, for messages: what ``torchrun_command`` and
    ``run_env`` do (Note [no TCP rendezvous on one host]), its rendezvous file in a fresh 0700 folder."""
    return (f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=lo torchrun "  # lo: the same bytes anywhere
            f"--nproc-per-node {nproc} --rdzv-backend c10d --rdzv-conf store_type=file --rdzv-endpoint "
            f"\"$(mktemp -d)/rdzv\" --local-addr {LOOPBACK} {script}")


# Intra-op threads of each rank ``run_env`` launches unless the caller's OMP_NUM_THREADS says otherwise.
RANK_THREADS = 1


def rank_threads(environ=None) -> int:
    """The intra-op threads each rank launched with ``run_env`` computes with: OMP_NUM_THREADS of
    ``environ`` (this process's environment), RANK_THREADS where unset. verify's oracle computes
    with as many (Note [the oracle computes as the ranks do] in runtime/execute/reference.py)."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", str(RANK_THREADS))
    # OpenMP reads a list ("4,2") as threads per nesting level: torch's intra-op pool is the first.
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a positive whole number of threads per rank: "
                         f"unset it (the ranks then compute with {RANK_THREADS}) or set e.g. OMP_NUM_THREADS=1")
    return int(first)


def run_env(*, pythonpath: str | None = None) -> dict:
    """The environment for torchrun: this process's, plus what makes restarts work.

    ``pythonpath`` goes first on PYTHONPATH, so workers import the same checkout as the caller
    (tests and benchmarks pass the repository root)."""
    env = dict(os.environ)
    # torchrun restarts with gloo hang on a stale shared store unless this is set (docs/design.md §2).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # Ranks share this host's cores: torch's default of one thread per core oversubscribes them.
    env.setdefault("OMP_NUM_THREADS", str(RANK_THREADS))
    # Single-host runs: gloo (and tensorpipe) bind the loopback interface, not what the hostname
    # resolves to (Note [loopback only]).
    env["GLOO_SOCKET_IFNAME"] = env["TP_SOCKET_IFNAME"] = loopback_interface()
    # The program folder is not an import root: `python train.py` would put it first on sys.path,
    # ahead of torch and runtime (docs/design.md §12); train.py also drops it.
    env["PYTHONSAFEPATH"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ---------------------------------------------------------------------------------------------
# Note [loopback only]: a single-host run listens on 127.0.0.1 and nothing else. torch's TCPStore
# server binds every interface (``::``) whatever host it is given, so nobody lets torch create a
# listening store: the rendezvous is a file, no store at all (Note [no TCP rendezvous on one
# host]), and rank 0's store for init_process_group is created by runtime/launch/world.py from a
# socket bound to 127.0.0.1 (``loopback_store``, TCPStore's ``master_listen_fd``). gloo binds the
# interface GLOO_SOCKET_IFNAME names, set to the loopback interface in ``run_env``. Multi-host runs
# (the command `partitioner run` prints) assume a trusted network: README "Trust model".

LOOPBACK = "127.0.0.1"


def loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux, "lo0" elsewhere)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name == "lo" or name.startswith("lo"):
            return name
    return "lo"


def loopback_store(port: int = 0, *, world_size: int | None = None, timeout_s: float = 300):
    """A TCPStore server listening on 127.0.0.1:``port`` only (Note [loopback only])."""
    # lazy: loads torch
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(512)
    port = sock.getsockname()[1]
    # The store's server takes the descriptor over: detached, the socket object won't close it.
    return dist.TCPStore(LOOPBACK, port, world_size, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach())


# ---------------------------------------------------------------------------------------------
# Note [no TCP rendezvous on one host]: torch's c10d rendezvous keeps its state in the store as
# base64 of a pickle that every agent unpickles on each keep-alive, so whoever can write that store
# runs code as the job's user; a TCPStore has no authentication and any local process can connect
# to 127.0.0.1 (issue 42). torchrun's --standalone hosts one too. On one host the rendezvous is a
# FileStore instead (the c10d backend's ``store_type=file``, in torch 2.11 as in 2.13): a file in a
# folder made by mkdtemp (mode 0700, this user's), so another user cannot open, read or write it.
# ``--local-addr 127.0.0.1`` makes that MASTER_ADDR the workers get (otherwise this host's FQDN),
# so rank 0's store for init_process_group binds loopback (runtime/launch/world.py), and
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE (``run_env``) keeps the agent from hosting a TCPStore for
# them on every interface. What that worker store and gloo's connections still let a local user do
# is README "Trust model"; nothing the ranks receive is unpickled (Note [no pickle between ranks]
# in runtime/exchange.py). Multi-host runs use torch's TCP rendezvous: a trusted network.
# A FileStore appends every write: each agent's keep-alive adds its state, ~0.5 KB (measured: 526
# bytes every 5 s for one agent, ~0.4 MB an hour; an elastic agent beats every second, ~2 MB an
# hour), in $TMPDIR until the launching process exits.

_private: list[str] = []  # this process's private folder of rendezvous files, made on first use


def rendezvous_file() -> str:
    """A new path for a rendezvous FileStore in this process's private folder (mode 0700, removed
    when the process exits): one per launch, or per elastic round (its agents share it)."""
    if not _private:
        try:
            _private.append(tempfile.mkdtemp(prefix="partitioner-rdzv-"))
        except OSError as exc:
            raise ValueError(f"cannot make the run's rendezvous folder in {tempfile.gettempdir()} "
                             f"({exc.strerror or exc}): set TMPDIR to a folder you can write") from None
        atexit.register(shutil.rmtree, _private[0], True)
    return os.path.join(_private[0], f"rdzv-{os.getpid()}-{next(_serial)}")


_serial = itertools.count()


def rendezvous_args(path: str) -> list[str]:
    """torchrun's flags for a rendezvous on the FileStore at ``path`` (Note [no TCP rendezvous on
    one host]); an elastic agent adds its own settings to the --rdzv-conf value."""
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", path, "--rdzv-conf", "store_type=file",
            "--local-addr", LOOPBACK]


def listening_ports() -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket on this host, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == "0A":  # TCP_LISTEN
                addr, port = cols[1].split(":")
                found.append((addr, int(port, 16)))
    return found


# ---------------------------------------------------------------------------------------------
# Note [process groups]: torchrun runs in its own session, and its workers each in their own
# (torch.distributed.elastic starts them with start_new_session). `partitioner run` forwards
# SIGTERM/SIGINT to the agent's group, and the agent stops its workers; on a timeout, or when the
# agent does not stop them in ``grace_s``, every process below the agent is killed, so no worker
# keeps training into the folder after the command returns.


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return []
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tree(proc: subprocess.Popen, *, grace_s: float = 10.0) -> None:
    """SIGTERM the agent's process group and every process below it; SIGKILL what is left after
    ``grace_s`` (Note [process groups])."""
    seen = set(descendants(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    _signal(seen, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        seen |= set(descendants(proc.pid)) if proc.poll() is None else set()
        if proc.poll() is not None and not any(_alive(p) for p in seen):
            break
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _signal([p for p in seen if _alive(p)], signal.SIGKILL)
    proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_tree(command: Sequence[str], *, env: dict | None = None, timeout_s: float | None = None,
             capture: bool = False, grace_s: float = 10.0, one_line_box: bool = False) -> subprocess.CompletedProcess:
    """Run torchrun in its own session, forwarding SIGTERM/SIGINT to it; on ``timeout_s`` stop the
    whole tree and raise subprocess.TimeoutExpired (Note [process groups]). ``one_line_box``
    (without ``capture``): torchrun's failure traceback and box become one line on stderr (Note
    [torchrun's failure box] in runtime/launch/agent_output.py)."""
    pipe = subprocess.PIPE if capture else None
    piped = one_line_box and not capture
    proc = subprocess.Popen(list(command), env=env, stdout=pipe, stderr=subprocess.PIPE if piped else pipe, text=True,
                            errors="replace" if piped else None, start_new_session=True)
    reader = start_forwarding(proc.stderr) if piped else None
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    try:
        try:
            out, err = _wait(proc, reader, timeout_s)
        except subprocess.TimeoutExpired:
            stop_tree(proc, grace_s=grace_s)
            out, err = _wait(proc, reader, None)
            raise subprocess.TimeoutExpired(command, timeout_s, output=out, stderr=err) from None
        if forwarded:  # the agent has stopped; make sure its workers have too
            stop_tree(proc, grace_s=grace_s)
    except BaseException:
        if proc.poll() is None:
            stop_tree(proc, grace_s=grace_s)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if reader is not None:  # every worker has gone: the pipe ends when the last writer does
            reader.join(timeout=grace_s)
    return subprocess.CompletedProcess(list(command), proc.returncode, out, err)


def _wait(proc: subprocess.Popen, reader: threading.Thread | None, timeout_s: float | None):
    """(stdout, stderr) of ``proc`` once it exits; the stderr a ``reader`` forwards is not kept."""
    if reader is None:
        return proc.communicate(timeout=timeout_s)
    proc.wait(timeout=timeout_s)
    return None, None
