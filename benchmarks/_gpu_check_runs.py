"""One run of a program folder for the one-GPU check (benchmarks/gpu_check.py): torchrun through the
project's own launch code (runtime/launch/torchrun.py, as `partitioner run` does, without importing
the compiler, which needs OR-Tools), then what the run wrote, read back into one record.

The record takes every field the runtime writes, whatever it is: summary.json, memory_rank_0.json
(measured, predicted and, where the runtime reports them, reserved and device-wide peaks),
stage_times_rank_0.json, the losses of metrics.jsonl and the checkpoints' stall and persist times;
so figures the runtime adds later show up here without a change. The device-wide peak is also
polled from outside the run (``nvidia-smi``, when there is one), since that number includes the
CUDA context, library workspaces and NCCL's buffers, which no allocator counter sees.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from runtime.launch.agent_output import with_one_line_box
from runtime.launch.torchrun import run_env, run_tree, torchrun_command

REPO = Path(__file__).resolve().parents[1]
ERROR_WORDS = ("Error", "error:", "Exception", "Traceback", "refused", "failed")


def first_error_line(text: str) -> str | None:
    """The first line of ``text`` that reads like an error, else its last non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if any(word in line for word in ERROR_WORDS) and not line.startswith("Traceback"):
            return line[:500]
    return lines[-1][:500] if lines else None


class DevicePoller:
    """The largest device-wide memory in use on GPU 0 while a run lasts (nvidia-smi every 0.25 s)."""

    def __init__(self):
        self.tool = shutil.which("nvidia-smi")
        self.samples: list[int] = []
        self._stop = threading.Event()
        self.baseline = self._read()
        self._thread = threading.Thread(target=self._loop, daemon=True) if self.tool else None

    def _read(self) -> int | None:
        if not self.tool:
            return None
        try:
            out = subprocess.run([self.tool, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=5).stdout
            return int(float(out.strip().splitlines()[0])) * 2**20
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _loop(self):
        while not self._stop.wait(0.25):
            value = self._read()
            if value is not None:
                self.samples.append(value)

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)

    def figures(self) -> dict:
        return {"device_used_bytes_peak": max(self.samples) if self.samples else None,
                "device_used_bytes_before": self.baseline}


class Answers(dict):
    """A phase's or probe's findings, rewritten to its file after every one (Note [a report that
    survives] in benchmarks/gpu_check.py)."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = str(path)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.save()

    @classmethod
    def load(cls, path: str | Path) -> "Answers":
        """What a phase or probe wrote to ``path`` ({} when it wrote nothing readable)."""
        found = cls(path)
        try:
            dict.update(found, json.loads(Path(path).read_text()))
        except (OSError, ValueError):
            pass
        return found

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self, f, indent=1, default=str)
        os.replace(tmp, self.path)


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def losses_by_step(run_dir: Path) -> list[float | None]:
    """metrics.jsonl's loss per step, the last attempt of a re-run step (a resume rewrites them)."""
    rows = {}
    for row in _lines(run_dir / "metrics.jsonl"):
        if "loss" in row and "step" in row:
            rows[row["step"]] = row["loss"]
    return [rows.get(k) for k in range(max(rows) + 1)] if rows else []


def read_run(run_dir: Path) -> dict:
    """What a finished (or failed) run left in ``run_dir``, with the key figures side by side."""
    out: dict = {}
    summary = _json(run_dir / "summary.json") or {}
    summary.pop("folder", None)
    memory = _json(run_dir / "memory_rank_0.json") or {}
    for key in ("rank", "stages"):
        memory.pop(key, None)
    times = _json(run_dir / "stage_times_rank_0.json")
    losses = losses_by_step(run_dir)
    metrics = _lines(run_dir / "metrics.jsonl")
    ckpt = _lines(run_dir / "checkpoint_stats_rank_0.jsonl")
    out.update({
        "steps_logged": len(losses),
        "predicted_step_time_s": summary.get("predicted_step_time_s"),
        "measured_step_time_s": summary.get("measured_step_time_s"),
        "step_time_ratio": summary.get("step_time_ratio"),
        "predicted_peak_bytes": memory.get("predicted_peak_bytes"),
        "measured_peak_bytes": memory.get("measured_peak_bytes"),
        "capacity_bytes": memory.get("capacity_bytes"),
        "loss_first_last": [losses[0], losses[-1]] if losses else None,
        "losses": losses,
        "summary": summary or None,
        "memory": memory or None,
        "stage_times": times,
        "mfu_last": next((row.get("mfu") for row in reversed(metrics) if "mfu" in row), None),
        "peak_memory_kind": next((row.get("peak_memory_kind") for row in reversed(metrics) if "peak_memory_kind" in row),
                                 None),
        "val_losses": [row["val_loss"] for row in metrics if row.get("val_loss") is not None],
        "checkpoints": {"count": len(ckpt), "stall_s": [r.get("stall_s") for r in ckpt],
                        "persist_s": [r.get("persist_s") for r in ckpt], "bytes": [r.get("bytes") for r in ckpt]}
        if ckpt else None,
        "faults": _lines(run_dir / "faults.jsonl") or None,
    })
    for key, value in memory.items():  # reserved, device-wide, ... whatever the runtime reports
        if key.startswith("measured_") and key not in out:
            out[key] = value
    return out


def run_folder(folder: Path, work: Path, name: str, flags: list[str], *, timeout_s: float, max_restarts: int = 0,
               env: dict | None = None, nproc: int = 1) -> dict:
    """torchrun the ``nproc``-rank program in ``folder`` with run and checkpoint folders of its own under
    ``work/name``; the record of what happened (never raises for a failed run)."""
    run_dir, ckpt_dir = work / name / "run", work / name / "checkpoints"
    for d in (run_dir, ckpt_dir):
        if d.exists():
            shutil.rmtree(d)
    record: dict = {"name": name, "folder": folder.name, "flags": flags, "ok": False, "error": None,
                    "run_dir": str(run_dir)}
    if not (folder / "train.py").is_file():
        record["error"] = f"no program folder at {folder} (not prepared)"
        return record
    started = time.perf_counter()
    with DevicePoller() as poller:
        command = torchrun_command(folder / "train.py", nproc, max_restarts=max_restarts, args=[
            "--run-dir", str(run_dir), "--checkpoint-dir", str(ckpt_dir), *flags])
        try:
            done = run_tree(command, env={**run_env(pythonpath=str(REPO)), **(env or {})}, capture=True,
                            timeout_s=max(5.0, timeout_s))
            code, text = done.returncode, (done.stdout or "") + with_one_line_box(done.stderr or "")
        except subprocess.TimeoutExpired as exc:
            code = None
            text = _text(exc.stdout) + with_one_line_box(_text(exc.stderr))
            record["error"] = f"timed out after {timeout_s:.0f} s: {first_error_line(text) or 'no output'}"
    record["wall_s"] = round(time.perf_counter() - started, 2)
    record["exit_code"] = code
    record["ok"] = code == 0
    if code not in (0, None):
        record["error"] = first_error_line(text)
    record["output_tail"] = text.strip().splitlines()[-12:]
    # where a restart resumed from: "recovered step N: tier=memory|disk ..."
    record["recovered"] = [line.strip() for line in text.splitlines() if "recovered step" in line][-2:] or None
    record.update(poller.figures())
    record.update(read_run(run_dir))
    return record


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def compare_losses(reference: list, other: list) -> dict:
    """Per-step losses of a resumed run against the uninterrupted one's."""
    if not reference or not other:
        return {"comparable": False}
    pairs = [(a, b) for a, b in zip(reference, other) if a is not None and b is not None]
    return {"comparable": True, "steps": len(pairs), "same_length": len(reference) == len(other),
            "bitwise_equal": len(reference) == len(other) and all(a == b for a, b in pairs),
            "max_abs_diff": max((abs(a - b) for a, b in pairs), default=None)}
