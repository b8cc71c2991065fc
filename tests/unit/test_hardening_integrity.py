"""Issue 14: the network a run listens on, the integrity of the program folder, and the processes
a run leaves behind (Note [loopback only], Note [process groups] in runtime/launch/torchrun.py; Note
[folder integrity] in runtime/program/spec.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.errors import PlanMismatchError
from runtime.program.spec import load_program, seal_folder
from runtime.launch.torchrun import (listening_ports, loopback_interface, loopback_store, run_env, run_tree,
                              torchrun_command)
from _runtime_folders import REPO, child_env, mlp_folder

# ---------------------------------------------------------------------------------------------
# Network

HELPERS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: workers import by path


def _bound(port: int) -> set[str]:
    return {addr for addr, p in listening_ports() if p == port}


def test_run_env_puts_gloo_on_the_loopback_interface_and_the_folder_off_sys_path():
    env = run_env()
    assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == loopback_interface()
    assert loopback_interface() in [name for _, name in __import__("socket").if_nameindex()]
    assert env["PYTHONSAFEPATH"] == "1"


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp")
def test_the_loopback_store_listens_on_127_0_0_1_only():
    """torch's own TCPStore server binds :: (every interface); ours binds 127.0.0.1."""
    import torch.distributed as dist

    store = loopback_store()
    assert _bound(store.port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    client = dist.TCPStore("127.0.0.1", store.port, None, False)
    client.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp")
def test_a_single_host_worker_store_binds_loopback(monkeypatch):
    from datetime import timedelta

    from runtime.launch.world import worker_store as _worker_store
    from runtime.launch.torchrun import free_port

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store = _worker_store(0, 1, timedelta(seconds=30))
    assert store is not None and _bound(port) == {"0100007F"}
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert _worker_store(0, 2, timedelta(seconds=30)) is None  # multi-host: torch's env:// store


def test_torchrun_meets_on_a_private_file_and_hands_the_workers_loopback():
    """No rendezvous store on TCP, MASTER_ADDR 127.0.0.1 (Note [no TCP rendezvous on one host])."""
    command = torchrun_command("train.py", 2, rendezvous="/some/private/rdzv")
    assert command[command.index("--rdzv-endpoint") + 1] == "/some/private/rdzv"
    assert command[command.index("--rdzv-conf") + 1] == "store_type=file"
    assert command[command.index("--local-addr") + 1] == "127.0.0.1"
    own = torchrun_command("train.py", 2)[torchrun_command("train.py", 2).index("--rdzv-endpoint") + 1]
    assert os.path.isabs(own) and os.stat(os.path.dirname(own)).st_mode & 0o077 == 0  # this user's only


def test_the_printed_multi_node_command_has_no_fixed_port():
    import inspect

    from partitioner.cli import run

    source = inspect.getsource(run.cmd_run)
    assert ":29500" not in source and "$MASTER_PORT" in source


# ---------------------------------------------------------------------------------------------
# Program integrity


@pytest.fixture
def folder(tmp_path):
    mlp_folder(str(tmp_path / "prog"), splits=[[0, 1, 2, 3]], ranks=[([0], 0)], steps=1, timeout_s=300)
    return tmp_path / "prog"


def _edit_plan(folder: Path, change) -> None:
    plan = json.loads((folder / "plan.json").read_text())
    change(plan)
    (folder / "plan.json").write_text(json.dumps(plan, indent=1))


def test_a_sealed_folder_loads(folder):
    assert load_program(str(folder)).world_size == 1


def test_an_edited_program_object_is_refused(folder):
    _edit_plan(folder, lambda plan: plan["program"]["optimizer"].update(lr=1e3))
    with pytest.raises(PlanMismatchError, match="edited after it was written"):
        load_program(str(folder))


def test_make_batch_pointing_at_an_unlisted_file_is_refused(folder):
    (folder / "evil.py").write_text("def make_batch(*a, **k):\n    raise SystemExit('ran')\n")

    def point(plan):
        plan["program"]["data"]["make_batch"] = [str(folder / "evil.py") + ":make_batch", {}]
    _edit_plan(folder, point)
    with pytest.raises(PlanMismatchError):
        load_program(str(folder))


def test_a_plan_without_its_file_map_is_refused(folder):
    _edit_plan(folder, lambda plan: plan.pop("files"))
    with pytest.raises(PlanMismatchError, match="lists no \"files\""):
        load_program(str(folder))
    _edit_plan(folder, lambda plan: plan.update(files={}))
    with pytest.raises(PlanMismatchError, match="lists no \"files\""):
        load_program(str(folder))


def test_a_plan_without_program_hash_is_refused(folder):
    _edit_plan(folder, lambda plan: plan.pop("program_hash"))
    with pytest.raises(PlanMismatchError, match="no \"program_hash\""):
        load_program(str(folder))


@pytest.mark.parametrize("planted", ["torch.py", "runtime/__init__.py", "runpy.py", "x.pth", "weights/y.so"])
def test_an_unlisted_importable_file_is_refused(folder, planted):
    path = folder / planted
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("raise SystemExit('planted')\n")
    with pytest.raises(PlanMismatchError, match=f"{planted} \\(not listed\\)"):
        load_program(str(folder))


def test_the_compiler_and_the_test_folders_seal_with_one_writer(folder):
    """seal_folder is idempotent on a folder the writer sealed: same files, same program_hash."""
    before = json.loads((folder / "plan.json").read_text())
    after = seal_folder(str(folder))
    assert after["files"] == before["files"] and after["program_hash"] == before["program_hash"]
    from partitioner.codegen import folder as codegen_folder

    assert codegen_folder.seal_plan is __import__("runtime.program.spec", fromlist=["x"]).seal_plan


def test_train_py_does_not_import_from_the_program_folder(folder):
    """`python train.py` puts the folder first on sys.path; train.py takes it off,
    so a torch.py there (even one listed in the file map) is not what `import torch` finds."""
    (folder / "torch.py").write_text("raise SystemExit('planted torch.py imported')\n")
    (folder / "runpy.py").write_text("raise SystemExit('planted runpy.py imported')\n")
    seal_folder(str(folder))
    env = child_env()
    env.pop("PYTHONSAFEPATH", None)  # the files themselves must do it, however they are started
    from runtime.launch.torchrun import free_port

    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, str(folder / "train.py"), "--steps", "1", "--no-checkpoint"],
                          env=env, capture_output=True, text=True, timeout=180, cwd=str(folder))
    assert "planted" not in done.stdout + done.stderr
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


# ---------------------------------------------------------------------------------------------
# Processes


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


def _wait_gone(text: str, seconds: float = 20) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = _processes_mentioning(text)
        if not left:
            return []
        time.sleep(0.2)
    return _processes_mentioning(text)


# A timeout test must see the timeout fire on workers that run, not on ones still starting: each
# tries a short timeout first and, when the workers had not reached their hang by then (a loaded
# machine), again with a longer one. On a quiet machine the first try is enough.
TIMEOUTS_S = (12, 40)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_timeout_stops_the_agent_and_every_worker(tmp_path):
    """verify's timeout: torchrun's workers run in sessions of their own; none may survive."""
    for timeout_s in TIMEOUTS_S:
        folder = tmp_path / f"hang_{timeout_s}"
        mlp_folder(str(folder), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)], steps=50, timeout_s=300)
        command = torchrun_command(folder / "train.py", 2, args=["--fail-at", "0:0:hang", "--no-checkpoint"])
        with pytest.raises(subprocess.TimeoutExpired):
            run_tree(command, env=child_env(), capture=True, timeout_s=timeout_s, grace_s=5)
        assert _wait_gone(str(folder / "train.py"), 10) == []
        if (folder / "run" / "faults.jsonl").exists():  # rank 0 was hanging, rank 1 waiting on it
            break
    else:
        pytest.fail(f"the workers never reached their hang in {TIMEOUTS_S[-1]} s")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_sigterm_to_the_launcher_reaches_every_worker(tmp_path):
    """`partitioner run` (run_tree) forwards SIGTERM to torchrun's group; nothing keeps training."""
    folder = tmp_path / "hang"
    mlp_folder(str(folder), splits=[[0, 1], [2, 3]], ranks=[([0], 0), ([1], 0)], steps=50, timeout_s=300)
    driver = (
        "import sys\n"
        "from runtime.launch.torchrun import run_tree, torchrun_command, run_env\n"
        "if True:\n"
        f"    cmd = torchrun_command({str(folder / 'train.py')!r}, 2,\n"
        "                           args=['--fail-at', '0:0:hang', '--no-checkpoint'])\n"
        f"    sys.exit(run_tree(cmd, env=run_env(pythonpath={str(REPO)!r}), grace_s=5).returncode)\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        hanging = folder / "run" / "faults.jsonl"  # rank 0 reached its hang: the workers are past start-up
        while not hanging.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hanging.exists(), "the workers never reached their hang"
        assert len(_processes_mentioning(str(folder / "train.py"))) >= 3  # agent + 2 workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert _wait_gone(str(folder / "train.py"), 10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_mentioning(str(folder / "train.py")):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A one-rank compiled program (`partitioner run` and `verify` need a compiler's plan)."""
    from partitioner.cli import main

    folder = tmp_path_factory.mktemp("compiled") / "prog"
    assert main(["compile", "gpt:layers=1,width=16,heads=2,vocab=32,seq=8", "-o", str(folder),
                 "--devices", "1", "--global-batch", "4", "-q"]) == 0
    return folder


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_partitioner_run_forwards_sigterm_to_torchrun_and_its_workers(compiled, tmp_path):
    train = str(compiled / "train.py")
    proc = subprocess.Popen([sys.executable, "-m", "partitioner.cli", "run", str(compiled), "--steps", "10000000",
                             "--checkpoint-every", "0", "-q", "--checkpoint-dir", str(tmp_path / "ck"),
                             "--run-dir", str(tmp_path / "run")],
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(_processes_mentioning(train)) >= 2  # the agent and the worker are training
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert _wait_gone(train, 10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_mentioning(train):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_verify_timeout_leaves_no_worker_behind(compiled, tmp_path):
    """A worker hung in make_batch prints nothing (no broken pipe to end it): verify's timeout
    must stop it, not only the agent."""
    import shutil

    from partitioner.cli.verify import verify

    for timeout_s in TIMEOUTS_S:
        folder, entered = tmp_path / f"sleepy_{timeout_s}", tmp_path / f"entered_{timeout_s}"
        shutil.copytree(compiled, folder)
        _edit_plan(folder, lambda plan: plan["program"]["data"].update(
            make_batch=[f"{HELPERS}/_slow_data.py:sleepy_batch", {"entered": str(entered)}]))
        seal_folder(str(folder))
        try:
            with pytest.raises(RuntimeError, match="did not finish"):
                verify(folder, steps=3, timeout_s=timeout_s)
            assert _wait_gone(str(folder / "train.py"), 10) == []
        finally:
            for pid in _processes_mentioning(str(folder / "train.py")):
                os.kill(pid, signal.SIGKILL)
        if entered.exists():  # the worker was in make_batch when the timeout fired
            break
    else:
        pytest.fail(f"the worker never reached make_batch in {TIMEOUTS_S[-1]} s")


def test_verify_of_a_failing_program_shows_what_the_rank_said(compiled, tmp_path):
    """verify's error ends with the output's last lines: the rank's error, not torchrun's box (Note
    [torchrun's failure box] in runtime/launch/agent_output.py)."""
    import shutil

    from partitioner.cli.verify import verify

    folder = tmp_path / "failing"
    shutil.copytree(compiled, folder)
    _edit_plan(folder, lambda plan: plan["program"]["data"].update(
        make_batch=[f"{HELPERS}/_slow_data.py:failing_batch", {}]))
    seal_folder(str(folder))
    with pytest.raises(RuntimeError, match="failed") as failed:
        verify(folder, steps=2, timeout_s=120)
    message = str(failed.value)
    assert "the corpus file is empty" in message and "error_file" not in message and "=====" not in message, message
    assert "[run] torchrun: rank 0 exited with code" in message, message


@pytest.mark.parametrize("command", ["run", "verify"])
def test_run_and_verify_help_say_they_execute_the_folder(command, capsys):
    from partitioner.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert "executes the folder's Python code" in " ".join(capsys.readouterr().out.split())
