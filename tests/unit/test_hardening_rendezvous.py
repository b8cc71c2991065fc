"""Issue 42 finding 1: another local user attacks a running `partitioner run` through the stores it
serves, the way any process on the host can (a raw TCPStore client on loopback). torch's c10d
rendezvous keeps its state as a pickle every agent unpickles; the attack plants one that would
create a marker file (Note [no TCP rendezvous on one host] in runtime/launch/torchrun.py)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from runtime.program.spec import seal_folder
from _runtime_folders import child_env

HELPERS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: workers import by path


class _Planted:
    """Unpickled, it creates ``path``: what an attacker's ``os.system(...)`` would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [a.decode(errors="replace").split("=", 1) for a in f.read().split(b"\0") if b"=" in a]
    except OSError:
        return {}
    return dict(pairs)


def _job(marker: str) -> tuple[list[int], list[int]]:
    """(agent pids, worker pids) of the runs of the program whose train.py path contains ``marker``."""
    agents, workers = [], []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            args = _cmdline(int(entry))
            if any(marker in a for a in args):
                (agents if "torch.distributed.run" in args else workers).append(int(entry))
    return agents, [w for w in workers if "MASTER_PORT" in _environ(w)]


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address hex, port) of every TCP socket ``pid`` listens on (/proc/net/tcp{,6} by inode)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    except OSError:
        return []
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    addr, port = cols[1].split(":")
                    found.append((addr, int(port, 16)))
    return found


def _attack_store(host: str, port: int, planted: bytes) -> list[str]:
    """Overwrite every rendezvous state the TCPStore at host:port holds (and torch's default run
    id's) with ``planted``; the keys it listed."""
    import torch.distributed as dist

    client = dist.TCPStore(host, port, None, False, timedelta(seconds=10))
    keys = list(client.list_keys()) if hasattr(client, "list_keys") else []
    for key in {k for k in keys if k.startswith("torch.rendezvous.")} | {"torch.rendezvous.none"}:
        client.set(key, base64.b64encode(planted))
    return keys


def _denied_to_another_user(path: str) -> bool:
    """Whether a process of uid 65534 (nobody) fails to open ``path`` for writing."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.open(path, os.O_RDWR)
            os._exit(0)
        except PermissionError:
            os._exit(3)
        except BaseException:
            os._exit(4)
    return os.waitpid(pid, 0)[1] >> 8 == 3


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    """A one-rank compiled program whose every step takes 0.5 s (alive for 2+ keep-alives)."""
    from partitioner.cli import main

    folder = tmp_path_factory.mktemp("rdzv") / "prog"
    assert main(["compile", "gpt:layers=1,width=16,heads=2,vocab=32,seq=8", "-o", str(folder),
                 "--devices", "1", "--global-batch", "4", "-q"]) == 0
    plan = json.loads((folder / "plan.json").read_text())
    _, kwargs = plan["program"]["data"]["make_batch"]
    plan["program"]["data"]["make_batch"] = [f"{HELPERS}/_slow_data.py:paced_batch", {**kwargs, "delay_s": 0.5}]
    (folder / "plan.json").write_text(json.dumps(plan, indent=1))
    seal_folder(str(folder))
    return folder


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_local_user_cannot_run_code_through_the_rendezvous(paced, tmp_path):
    marker = tmp_path / "pwned"
    planted = pickle.dumps(_Planted(str(marker)))
    steps = 18  # 9 s of steps: the agent's keep-alive (every 5 s) reads the state after the attack
    proc = subprocess.Popen([sys.executable, "-m", "partitioner.cli", "run", str(paced), "--steps", str(steps),
                             "--checkpoint-every", "0", "-q", "--checkpoint-dir", str(tmp_path / "ck"),
                             "--run-dir", str(tmp_path / "run")],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    attacked: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists() and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.2)
        assert (tmp_path / "run" / "metrics.jsonl").exists(), "the run never trained a step"
        agents, workers = _job(str(paced / "train.py"))
        assert agents and workers
        # the agent listens on nothing, the workers on loopback only (Note [no TCP rendezvous on one host])
        assert [_listening(pid) for pid in agents] == [[]] * len(agents)
        assert {addr for pid in workers for addr, _ in _listening(pid)} <= {"0100007F"}  # 127.0.0.1
        endpoint = _cmdline(agents[0])[_cmdline(agents[0]).index("--rdzv-endpoint") + 1]
        host, _, port = endpoint.rpartition(":")
        if port.isdigit():  # a TCP rendezvous store: what main did
            _attack_store(host, int(port), planted)
            attacked.append(endpoint)
        else:  # a file: nobody but the job's user opens it
            assert os.path.exists(endpoint)
            if os.getuid() == 0:
                assert _denied_to_another_user(endpoint)
        # the workers' own store (rank 0's, on loopback): any local process reaches it
        env = _environ(workers[0])
        _attack_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), planted)
        attacked.append(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert not marker.exists(), f"the planted pickle ran (stores attacked: {attacked})"
    assert proc.returncode == 0, err
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == steps - 1


def test_elastic_agents_meet_on_the_file_too():
    """`run --elastic`'s agents: the same private file rendezvous, with the elastic settings added."""
    from runtime.launch.elastic import agent_command

    command = agent_command("train.py", 2, 2, rendezvous="/private/rdzv", host_timeout_s=5, max_restarts=3, args=[])
    assert command[command.index("--rdzv-endpoint") + 1] == "/private/rdzv"
    assert command[command.index("--local-addr") + 1] == "127.0.0.1"
    conf = command[command.index("--rdzv-conf") + 1].split(",")
    assert conf[0] == "store_type=file" and "last_call_timeout=5" in conf and not any("is_host" in c for c in conf)


# ---------------------------------------------------------------------------------------------
# Multi-host: the rendezvous state signed (Note [signed rendezvous state] in
# runtime/launch/signed_rendezvous.py), attacked on a real TCPStore through a real handler.

def test_a_signed_rendezvous_refuses_a_planted_state_before_unpickling_it(tmp_path, monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    from runtime.launch import signed_rendezvous as signed
    from runtime.launch.torchrun import free_port

    monkeypatch.setenv(signed.KEY_ENV, "5e" * 32)
    port = free_port()
    params = RendezvousParameters(signed.BACKEND, f"127.0.0.1:{port}", "job", 1, 1, is_host=True,
                                  last_call_timeout=1, join_timeout=60)
    handler = signed.create_handler(params)
    info = handler.next_rendezvous()  # a real round: the state written and read back sealed
    assert (info.rank, info.world_size) == (0, 1) and handler.num_nodes_waiting() == 0
    marker = tmp_path / "pwned"
    keys = _attack_store("127.0.0.1", port, pickle.dumps(_Planted(str(marker))))
    assert "torch.rendezvous.job" in keys
    with pytest.raises(RendezvousStateError, match="not signed with this run's PARTITIONER_RDZV_KEY"):
        deadline = time.monotonic() + 30  # the handler serves its cached state for a second
        while time.monotonic() < deadline:
            handler.num_nodes_waiting()  # what the agent asks every monitor tick: a sync past the cache
            time.sleep(0.2)
    assert not marker.exists()
    # a state sealed with another key is refused as well
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    client.set("torch.rendezvous.job", base64.b64encode(signed.seal(bytes.fromhex("11" * 32), pickle.dumps(None))))
    with pytest.raises(RendezvousStateError):
        signed._backend_class()(client, "job", bytes.fromhex("5e" * 32)).get_state()


@pytest.mark.parametrize("value", ["", "abc", "zz" * 32, "12" * 15])
def test_a_signed_rendezvous_without_a_good_key_is_refused_in_one_line(value, capsys, monkeypatch):
    from runtime.launch import signed_rendezvous as signed

    monkeypatch.setenv(signed.KEY_ENV, value)
    assert signed.main() == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {signed.KEY_ENV} must hold") and err.count("\n") == 1
