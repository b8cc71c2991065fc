"""What people watch while a run trains: the step line's ETA, and the per-step figures of
metrics.jsonl beyond loss and time (achieved FLOP/s, MFU, peak memory per rank), mirrored to
TensorBoard when the ``tensorboard`` package is installed.

Note [model FLOPs and MFU]: a step's model FLOPs are the plan's, forward plus backward of every
stage for every microbatch of every replica (plan.json's stage table holds them per microbatch,
from the flops pass), without the forward that recomputed regions run again: the usual
definition of MFU (PaLM, Megatron-LM), so a plan that recomputes more shows a lower MFU for the
same work. Achieved FLOP/s = model FLOPs / the step's wall time; MFU = that / the peak of the
devices the ranks run on, each rank once: on a GPU kind the datasheet's dense peak at the policy's
compute dtype (the program's ``peak_flops_per_s``, Note [datasheet peaks] in
partitioner/config/device_presets.py), not the sustained 40% of it that the cost model prices
with, which would show MFU 2.5 times too high. Without a datasheet (cpu, a kind the cluster file
describes by its numbers) the peak is the plan cluster's rate of each rank's kind; on CPU that
is the preset's nominal rate, so the MFU there is a relative figure, not a hardware claim.

Note [peak memory per step]: every rank reports the peak it has reached so far, gathered onto rank 0
by one all_gather of a few int64 per rank each step (next to the loss's all_reduce): on CUDA the
caching allocator's ``max_memory_allocated``, and beside it (``peak_memory_reserved_bytes``,
``device_memory_used_bytes``) its ``max_memory_reserved`` and the device-wide used bytes after the
step (Note [what a GPU holds beyond the tensors] in runtime/observe/memory.py); on CPU, where torch
keeps no count, the process's peak resident set (``ru_maxrss``), which also counts the interpreter
and torch's own libraries. The record says which (``peak_memory_kind``). ``--measure-memory``
(runtime/observe/memory.py) gives the tensor-level CPU figure at the end of a run.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from runtime.file_trust import read_bounded
from runtime.observe.memory import cuda_memory_figures


def plan_step_flops(folder: str) -> tuple[float | None, float | None]:
    """(model FLOPs of one step, peak FLOP/s of the ranks' devices) from plan.json, Nones when
    the plan lacks them (hand-written folders)."""
    try:
        plan = json.loads(read_bounded(os.path.join(folder, "plan.json"), follow=True))  # Note [files are not trusted]
        stages = plan["stages"]
        m, dp = int(plan["num_microbatches"]), int(plan["dp"])
        flops = sum(float(s["flops_fwd"]) + float(s["flops_bwd"]) for s in stages) * m * dp
        peak = (plan.get("program") or {}).get("peak_flops_per_s")
        if not peak:  # no datasheet: the cluster's rate of each rank's kind, each rank once
            rates = {g["kind"]: float(g["flops_per_s"]) for g in plan.get("cluster", {}).get("group", [])}
            tp = int(plan.get("tensor_parallel", 1))
            if all("ranks" in s for s in stages):
                kinds = list({first + t: s.get("device") for s in stages for first in s["ranks"]
                              for t in range(tp)}.values())
            else:  # a hand-written plan without ranks: each stage's device once per replica
                kinds = [s.get("device") for s in stages] * dp
            peak = sum(rates[k] for k in kinds) if all(k in rates for k in kinds) else None
        return (flops if flops > 0 else None), (float(peak) if peak else None)
    except (OSError, KeyError, TypeError, ValueError):
        return None, None


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This rank's peak so far and what it counts (Note [peak memory per step])."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale, "host_peak_rss"


# the metrics fields a CUDA rank adds beside peak_memory_bytes, in gather order (Note [peak memory per step])
CUDA_MEMORY_FIELDS = ("peak_memory_reserved_bytes", "device_memory_used_bytes")


def memory_row(device: torch.device) -> tuple[list[int], tuple[str, ...], str]:
    """(this rank's figures, their metrics fields, peak_memory_kind): peak_memory_bytes first."""
    own, kind = peak_memory_bytes(device)
    if device.type != "cuda":
        return [own], ("peak_memory_bytes",), kind
    more = cuda_memory_figures(device)
    return [own, more["measured_peak_reserved_bytes"], more["device_used_bytes"]], \
        ("peak_memory_bytes", *CUDA_MEMORY_FIELDS), kind


def eta_text(seconds: float) -> str:
    """12s, 4m05s, 3h02m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StepWatch:
    """Built on every rank (the memory gather is a collective); rank 0 writes what it returns."""

    def __init__(self, folder: str, device: torch.device, *, rank: int, run_dir: str, steps: int, start_step: int):
        self.device, self.rank, self.steps, self.start_step = device, rank, steps, start_step
        self.step_flops, self.peak_flops_per_s = plan_step_flops(folder)
        self.times: list[float] = []  # each step's time
        self.ends: list[float] = []   # when each step's figures were taken
        self.board = _tensorboard(run_dir) if rank == 0 else None

    def eta_s(self, step: int) -> float:
        """Seconds left after ``step``: the steps to go times the wall time per step so far, from
        the end of the first step (which pays for warm-up) to the end of the last, checkpoints and
        logging included; after the first step alone, its own time."""
        left = max(0, self.steps - 1 - step)
        if len(self.ends) > 1:
            per_step = (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1)
        else:
            per_step = self.times[-1] if self.times else 0.0
        return left * per_step

    def measure(self, step: int, step_time_s: float) -> dict:
        """The step's extra metrics fields (every rank calls it; the all_gather is collective)."""
        self.times.append(step_time_s)
        self.ends.append(time.perf_counter())
        own, fields, kind = memory_row(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            mine = torch.tensor(own, dtype=torch.int64, device=self.device)
            gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
            per_rank = torch.stack(gathered).tolist()  # one sync, not one per rank
        else:
            per_rank = [own]
        out: dict = {field: [row[i] for row in per_rank] for i, field in enumerate(fields)}
        out["peak_memory_kind"] = kind
        if self.step_flops is not None and step_time_s > 0:
            achieved = self.step_flops / step_time_s
            out.update(model_flops=self.step_flops, achieved_flops_per_s=achieved)
            if self.peak_flops_per_s:
                out["mfu"] = achieved / self.peak_flops_per_s
        out["eta_s"] = self.eta_s(step)
        return out

    def line(self, record: dict) -> str:
        """The step line's tail: MFU where known, then the ETA."""
        mfu = f" mfu {record['mfu'] * 100:.3g}%" if "mfu" in record else ""
        return f"{mfu} eta {eta_text(record['eta_s'])}"

    def board_write(self, record: dict) -> None:
        if self.board is None:
            return
        step = record["step"]
        for key in ("loss", "lr", "step_time_s", "samples_per_s", "achieved_flops_per_s", "mfu", "grad_norm"):
            if isinstance(record.get(key), (int, float)):
                self.board.add_scalar(f"train/{key}", record[key], step)
        if isinstance(record.get("val_loss"), float):  # an evaluation followed this step (runtime/execute/validation.py)
            self.board.add_scalar("val/loss", record["val_loss"], step)
        self.board.add_scalar("memory/peak_bytes_max_rank", max(record["peak_memory_bytes"]), step)
        self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def _tensorboard(run_dir: str):
    """A SummaryWriter on RUN_DIR/tensorboard when the tensorboard package is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package
    except ImportError:
        return None
    return SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
