"""The disk tier's checkpoint points: the snapshot at a step boundary, the persist in a background
thread, and the distributed commit (``Checkpointer``, what the trainer drives; its recovery side is
runtime/resilience/recovery.py).

Note [distributed commit]: at a checkpoint point every rank copies the state it writes (Note [one
writer per byte] in runtime/resilience/checkpoint/writers.py: its share of the replicated state, and its own
RNG states) to host memory (``runtime.resilience.checkpoint.state.snapshot``, the only stall) and hands it to a
background thread, which
writes the rank's shard durably and then all-gathers (step, bytes, sha256, ok) over a gloo group
of its own (created with the collective timeout, so a dead peer is an error, not a hang). Rank 0
writes the manifest only when every rank's shard is durable, then prunes old checkpoints. The
next checkpoint point first joins the previous persist, so persists never overlap and every rank
runs the same sequence of gathers.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

from runtime.errors import CommitRefused, one_line_error
from runtime.parallel.control import control_group
from runtime.resilience.checkpoint.delta import FULL_EVERY, MAX_FULL_EVERY, encode_snapshot
from runtime.resilience.checkpoint.interval import young_daly_interval
from runtime.resilience.checkpoint.manifest import ShardInfo, clean_debris, manifest_for, persist_shard, prune, write_manifest
from runtime.resilience.checkpoint.shard import shard_filename
from runtime.resilience.checkpoint.state import Snapshot, snapshot
from runtime.resilience.checkpoint.writers import all_names, write_cost, writes_of_ranks
from runtime.resilience.faults import FaultPoint, PersistFault, SimulatedCrash, first_attempt, say


class Checkpointer:
    """Checkpoint points: ``after_step`` is RankTrainer.run's hook; ``finish`` leaves a committed
    checkpoint of the last step. See Note [distributed commit].

    every: checkpoint when (steps done) % every == 0; 0 with ``mtbf_s`` set: snapshot after the
    first step, then choose ``every`` by Young/Daly from that stall (max over ranks) and the step
    time; 0 without MTBF: only the last step."""

    def __init__(self, trainer, ckpt_dir: str, *, every: int = 0, keep: int = 3,
                 mtbf_s: float | None = None, timeout=None, start_step: int = 0,
                 persist_fault: PersistFault | None = None, stats_path: str | None = None,
                 compression: str = "none", full_every: int = FULL_EVERY):
        if not 1 <= int(full_every) <= MAX_FULL_EVERY:  # Note [lossless deltas]: chains stay short
            raise ValueError(f"full_every {full_every}: give 1..{MAX_FULL_EVERY} (--checkpoint-full-every)")
        self.trainer, self.ckpt_dir, self.keep = trainer, ckpt_dir, keep
        self.every, self.mtbf_s = int(every or 0), mtbf_s
        self.rank = trainer.rank
        self.world = dist.get_world_size()
        if self.rank == 0:
            # start-up, before the first persist (no rank can persist before a step, which needs
            # rank 0): what a crash or a full disk left (discarded_step_N, *.tmp) goes first, so a
            # full disk does not crash-loop on its own debris
            for path in clean_debris(ckpt_dir):
                say(0, f"removed {path} (left by an earlier attempt)")
        # gloo even under nccl: the gathered tensors are tiny and live on the CPU.
        self.group = dist.new_group(list(range(self.world)), timeout=timeout, backend="gloo")
        self.writes = self._agree_writers()
        self.persist_fault = persist_fault if (persist_fault and persist_fault.rank == self.rank
                                               and first_attempt()) else None
        self.stats_path = stats_path
        self.compression, self.full_every = compression, int(full_every)
        self.base: tuple[int, dict] | None = None  # (step, tensors) of the last commit (Note [lossless deltas])
        self.chain = 0  # deltas since the last full checkpoint
        self.last_step = start_step  # newest step that has (or is getting) a checkpoint
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stats: list[dict] = []
        self.committed: list[int] = []
        self.choice: dict | None = None
        if self.rank == 0:
            if self.every:
                say(0, f"checkpoint every {self.every} steps into {ckpt_dir} (keeping {keep})")
            elif mtbf_s:
                say(0, f"checkpoint interval: chosen by Young/Daly after the first snapshot "
                        f"(MTBF {mtbf_s:.0f} s)")
            else:
                say(0, f"no --checkpoint-every or --mtbf: checkpointing only the last step into {ckpt_dir}")

    def _agree_writers(self) -> dict[int, frozenset[str]]:
        """Every rank's share of the state (Note [one writer per byte]): each rank knows the sizes
        of its own names only, so one all-reduce (max) of a vector indexed by every name of the
        program gives every rank the same sizes, and so the same assignment."""
        program = self.trainer.program
        names = all_names(program)
        mine = write_cost(self.trainer)
        sizes = torch.tensor([mine.get(n, -1) for n in names], dtype=torch.int64)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.group)
        return writes_of_ranks(program, {n: max(0, int(b)) for n, b in zip(names, sizes.tolist())})

    # --- checkpoint points --------------------------------------------------------------------

    def after_step(self, step: int, loss: float, step_time_s: float) -> None:
        done = step + 1
        if self.every and done % self.every == 0:
            self.checkpoint(done)
        elif not self.every and self.mtbf_s:
            stall = self.checkpoint(done)
            self._choose_interval(stall, step_time_s)

    def _choose_interval(self, stall_s: float, step_time_s: float) -> None:
        # every rank must pick the same K. The control group, not self.group: the persist thread
        # gathers on self.group right now (Note [the control group] in runtime/parallel/control.py)
        figures = torch.tensor([stall_s, step_time_s], dtype=torch.float64, device="cpu")
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=control_group())
        stall_s, step_time_s = figures.tolist()
        self.every, info = young_daly_interval(stall_s, self.mtbf_s, step_time_s)
        self.choice = {"every": self.every, "stall_s": stall_s, "step_time_s": step_time_s,
                       "mtbf_s": self.mtbf_s, **info}
        if self.rank == 0:
            say(0, f"checkpoint interval: every {self.every} steps ({info['tau_s']:.3g} s; Young/Daly "
                    f"sqrt(2 x stall {stall_s * 1e3:.3g} ms x MTBF {self.mtbf_s:.0f} s) = "
                    f"{info['young_daly_s']:.3g} s at {step_time_s:.3g} s/step); expected time lost: "
                    f"{info['overhead']:.2%} in snapshots + {info['expected_rework_s']:.3g} s of rework "
                    f"per failure = {info['expected_lost_fraction']:.2%} of the run")

    def checkpoint(self, done: int) -> float:
        """Snapshot now (returns the stall in seconds) and persist in the background."""
        self._join()
        snap = snapshot(self.trainer, self.writes[self.rank])
        assert snap.step == done, (snap.step, done)
        self.last_step = done
        self.thread = threading.Thread(target=self._persist, args=(snap,), daemon=True,
                                       name=f"checkpoint-persist-{done}")
        self.thread.start()
        return snap.stall_s

    def due(self, done: int) -> bool:
        """Whether ``after_step`` checkpoints after ``done`` steps (runtime/resilience/sdc.py checks first)."""
        return bool(self.every and done % self.every == 0) or bool(not self.every and self.mtbf_s)

    def settle(self) -> None:
        """Wait for the persist in flight (a rollback, runtime/resilience/sdc.py, starts after it)."""
        self._join()

    def rolled_back(self, step: int) -> None:
        """The trainer went back to the checkpoint of ``step``: the next checkpoint points follow it."""
        self._join()
        self.last_step = step
        self.base, self.chain = None, 0  # the kept base may be newer than the rollback: start full

    def finish(self) -> None:
        """Leave a committed checkpoint of the last step (then wait for its persist)."""
        if self.trainer.steps_done > 0 and self.trainer.steps_done != self.last_step:
            self.checkpoint(self.trainer.steps_done)
        self._join()
        if self.stats_path and self.stats:
            os.makedirs(os.path.dirname(self.stats_path), exist_ok=True)
            with open(self.stats_path, "a") as fh:
                for row in self.stats:
                    fh.write(json.dumps(row) + "\n")
        if self.choice and self.rank == 0 and self.stats_path:
            with open(os.path.join(os.path.dirname(self.stats_path), "checkpoint_interval.json"), "w") as fh:
                json.dump(self.choice, fh, indent=1)

    def _join(self) -> None:
        if self.thread is not None:
            t0 = time.perf_counter()
            self.thread.join()
            waited = time.perf_counter() - t0
            if waited > 0.05 and self.stats:
                self.stats[-1]["join_wait_s"] = waited
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"rank {self.rank}: checkpoint persist failed: {err}") from err

    # --- the background persist (Note [distributed commit]) ----------------------------------

    def _persist(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        info, failure = None, None
        try:
            fault = None
            if self.persist_fault is not None and self.persist_fault.step == snap.step:
                fault = FaultPoint(after_bytes=self.persist_fault.after_bytes)
            written, base_step = snap, None
            if self.compression == "lossless":
                base = self.base if self.base is not None and self.chain + 1 < self.full_every else None
                base_step = base[0] if base else None
                t1 = time.perf_counter()
                written = encode_snapshot(snap, base[1] if base else None, base_step)
                encode_s = time.perf_counter() - t1
            info = persist_shard(self.ckpt_dir, written, fault)
        except Exception as exc:  # noqa: BLE001 - reported through the gather, then re-raised
            failure = exc
        persist_s = time.perf_counter() - t0
        try:
            row = torch.zeros(35, dtype=torch.int64)
            row[0] = snap.step
            if info is not None:
                row[1], row[2] = info.bytes, 1
                row[3:] = torch.tensor(list(bytes.fromhex(info.sha256)), dtype=torch.int64)
            rows = [torch.zeros_like(row) for _ in range(self.world)]
            dist.all_gather(rows, row, group=self.group)
            if failure is not None:
                raise failure
            stat = {"step": snap.step, "rank": self.rank, "stall_s": snap.stall_s,
                    "persist_s": persist_s, "bytes": info.bytes, "gather_s": time.perf_counter() - t0 - persist_s,
                    "tensor_bytes": sum(t.numel() * t.element_size() for t in snap.tensors.values())}
            if self.compression == "lossless":
                stat.update(encode_s=encode_s, base_step=base_step)
            if self.rank == 0:
                bad = [r for r, t in enumerate(rows) if int(t[2]) != 1 or int(t[0]) != snap.step]
                if bad:
                    raise CommitRefused(f"ranks {bad} did not persist their shard of step {snap.step} (each "
                                        "says why); the checkpoint is not committed")
                infos = [ShardInfo(shard_filename(r), r, int(t[1]),
                                      bytes(int(x) for x in t[3:].tolist()).hex())
                         for r, t in enumerate(rows)]
                t1 = time.perf_counter()
                write_manifest(self.ckpt_dir, manifest_for(snap.step, infos, self.trainer.program, self.writes,
                                                           base_step=base_step, compression=self.compression))
                prune(self.ckpt_dir, keep=self.keep, newest=snap.step)
                stat["commit_s"] = time.perf_counter() - t1
            self.committed.append(snap.step)
            if self.compression == "lossless":  # the next checkpoint's base: what just committed
                self.chain = 0 if base_step is None else self.chain + 1
                self.base = (snap.step, snap.tensors)
            self.stats.append(stat)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next _join
            if one_line_error(exc) is None:  # a full disk says where in one line (the rank prints it)
                traceback.print_exc()
            self.error = exc
            if self.rank == 0 and not isinstance(exc, SimulatedCrash):
                try:  # every rank is past its write of this step (the gather): free what it left
                    clean_debris(self.ckpt_dir, up_to=snap.step)
                except Exception:  # noqa: BLE001 - the persist error is the one to report
                    pass
