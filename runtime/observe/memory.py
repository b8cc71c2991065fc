"""A rank's peak memory, measured while it trains, next to what the plan predicted.

On CUDA the caching allocator counts (``torch.cuda.max_memory_allocated``). On CPU nothing does
(tracemalloc sees none of torch's allocations), so ``LiveBytes`` follows every storage an op
creates until it is freed; it costs a few microseconds per op, so it runs only when asked
(``train.py --measure-memory`` or ``PARTITIONER_MEASURE_MEMORY=1``).

Note [what a rank's peak counts]: the tensors alive at the start of training (parameters, buffers,
and any gradients or optimizer state restored from a checkpoint) plus the peak of everything made
after: gradients, optimizer state, receive buffers, saved activations of the microbatches in flight
and the transients of forward, backward and the optimizer step; what the plan's
``peak_memory_bytes`` predicts. Checkpoint snapshots are host copies made after a step (a GPU
never holds them), so the checkpoint hooks run unmeasured.

Note [what a GPU holds beyond the tensors]: ``max_memory_allocated`` counts the tensors only. What
runs a GPU out of memory is more: the caching allocator's reserved segments (freed blocks it keeps,
fragmentation, rounding: ``max_memory_reserved``), and outside the allocator the CUDA context,
cuBLAS/cuDNN workspaces and NCCL's buffers (one set per communicator). So a CUDA rank also records
the allocator's reserved peak and the device-wide used bytes (``torch.cuda.mem_get_info``: total
minus free, other processes on the GPU included), read at the end of the run (the memory report)
and after every step (metrics.jsonl, Note [peak memory per step] in runtime/observe/watch.py).
The device-wide figure is a reading, not a peak: nothing samples it during a step. The plan's
``capacity_bytes`` is the device's memory less the headroom for all of that (Note [usable
memory] in partitioner/config/device_presets.py): a reserved peak above it says the headroom is
too small for this run, even when the allocated peak is below.
"""

from __future__ import annotations

import json
import os

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from runtime.exchange import all_gather_json
from runtime.program.spec import load_plan

ENV = "PARTITIONER_MEASURE_MEMORY"


def _storages(t: torch.Tensor):
    """The storages holding ``t``'s bytes on this rank.

    Note [a DTensor's bytes]: a wrapper
    subclass (a tensor-parallel stage's DTensor parameters, activations and gradients) has no
    storage of its own (its ``untyped_storage().data_ptr()`` raises); its bytes are its inner
    tensors' (a DTensor's local shard), found through ``__tensor_flatten__`` (whose names may hold
    other things too: a DTensor's device mesh)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for inner in (getattr(t, name) for name in names):
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    elif t.device.type != "meta":
        yield t.untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created while active (Note [measuring a region] in
    partitioner/calibrate/).

    Every op's outputs are recorded by storage (views and in-place results share one); a storage
    counts until it is freed, checked through a weak reference at each op. Tensors made before the
    mode (parameters, inputs) are not counted. Works on any device, CPU included, where
    tracemalloc sees nothing of torch's allocations. Backward ops run under it too."""

    def __init__(self):
        super().__init__()

        self._ref = StorageWeakRef
        self.live: dict = {}
        self.current = 0
        self.peak = 0
        self.recording = True

    def already_counted(self, tensors) -> None:
        """Register tensors made before the mode (parameters, optimizer state, inputs) as seen, with
        0 bytes: a caller counts them itself, and their views made under the mode are no new bytes."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for storage in _storages(t):
                    self.live[(storage.data_ptr(), storage.device.type)] = (self._ref(storage), 0)

    @staticmethod
    def _keys(t: torch.Tensor):
        return [(storage.data_ptr(), storage.device.type) for storage in _storages(t)]

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        if not self.recording:
            return out
        # A view or an in-place result shares its input's storage: nothing was allocated. Without
        # this, the transpose `linear` takes of a parameter made before the mode counts the whole
        # parameter again for as long as autograd keeps the view.
        inputs = {key for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) for key in self._keys(t)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for storage in _storages(t):
                key = (storage.data_ptr(), storage.device.type)
                if key not in self.live and key not in inputs and storage.nbytes():
                    self.live[key] = (self._ref(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def requested(flag: bool) -> bool:
    """--measure-memory, or the environment asks for it (a launch that passes no flags)."""
    return flag or os.environ.get(ENV, "") not in ("", "0")


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for s in _storages(t):
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total


class PeakMemory:
    """Measures one rank from ``start()`` to ``stop()`` (Note [what a rank's peak counts])."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.device = trainer.device
        self.mode: LiveBytes | None = None
        self.static_bytes = 0
        self.peak_bytes = 0
        self.figures: dict = {}  # on CUDA: reserved and device-wide bytes (cuda_memory_figures)

    def start(self) -> "PeakMemory":
        t = self.trainer
        state = [v for st in t.optimizer.state.values() for v in st.values()]
        self.static_bytes = _storage_bytes([*(p for m in t.modules for p in m.parameters()),
                                            *(b for m in t.modules for b in m.buffers()),
                                            *(p.grad for m in t.modules for p in m.parameters()), *state])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.mode = LiveBytes()
            self.mode.__enter__()
        return self

    def unmeasured(self, hook):
        """``hook`` (an after-step hook: checkpoint snapshots) run without being counted."""
        if hook is None or self.mode is None:
            return hook

        def call(*args):
            self.mode.recording = False
            try:
                hook(*args)
            finally:
                self.mode.recording = True

        return call

    def stop(self) -> int:
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.figures = cuda_memory_figures(self.device)
        elif self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.peak_bytes = self.static_bytes + self.mode.peak
            self.mode = None
        return self.peak_bytes


def cuda_memory_figures(device: torch.device) -> dict:
    """The allocator's peaks and the device-wide use now (Note [what a GPU holds beyond the tensors])."""
    free, total = torch.cuda.mem_get_info(device)
    return {"measured_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "device_used_bytes": int(total - free), "device_total_bytes": int(total)}


def plan_figures(folder: str, stages: list[int]) -> tuple[int | None, int | None]:
    """(predicted peak, capacity) of a rank holding ``stages``, from plan.json's stage table
    (absent in hand-written folders)."""
    table = {s.get("index"): s for s in load_plan(folder).get("stages", []) if isinstance(s, dict)}
    if not all(k in table for k in stages) or not stages:
        return None, None
    return (sum(int(table[k]["peak_memory_bytes"]) for k in stages),
            min(int(table[k]["memory_capacity_bytes"]) for k in stages))


def _mib(num_bytes) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.2f} MiB"


def report(meter: PeakMemory, *, folder: str, rank: int, run_dir: str) -> None:
    """Write run_dir/memory_rank_<r>.json on every rank; rank 0 prints one line for all ranks.
    A collective over the world: every rank calls it at the same point."""
    t = meter.trainer
    predicted, capacity = plan_figures(folder, list(t.stage_ids))
    row = {"rank": rank, "stages": list(t.stage_ids),
           "method": "cuda max_memory_allocated" if meter.device.type == "cuda" else "live tensor storages",
           "measured_peak_bytes": meter.peak_bytes, "static_bytes": meter.static_bytes,
           "predicted_peak_bytes": predicted, "capacity_bytes": capacity,
           **meter.figures}  # Note [what a GPU holds beyond the tensors]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"memory_rank_{rank}.json"), "w") as f:
        json.dump(row, f, indent=1, sort_keys=True)
    rows = all_gather_json(row, meter.device)  # Note [no pickle between ranks] in runtime/exchange.py
    if rank == 0:
        cells = []
        for r in rows:
            over = r["capacity_bytes"] is not None and r["measured_peak_bytes"] > r["capacity_bytes"]
            reserved = r.get("measured_peak_reserved_bytes")
            beyond = "" if reserved is None else (
                f" (reserved {_mib(reserved)}, device used {_mib(r['device_used_bytes'])}"
                + (", reserved over capacity" if r["capacity_bytes"] is not None and reserved > r["capacity_bytes"]
                   else "") + ")")
            cells.append(f"rank {r['rank']} {_mib(r['measured_peak_bytes'])} / {_mib(r['predicted_peak_bytes'])}"
                         f" / {_mib(r['capacity_bytes'])}" + (" OVER CAPACITY" if over else "") + beyond)
        print("peak memory per rank, measured / predicted / capacity: " + "; ".join(cells), flush=True)
