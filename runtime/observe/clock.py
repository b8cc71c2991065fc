"""Seconds of device work, not of its launch (Note [timing on a device]).

Note [timing on a device]
    A CUDA op returns once its kernel is queued, so ``time.perf_counter()`` around a stage call
    measures Python's launch time: the GPU's backlog lands in whichever later call waits for it.
    Two clocks, picked by the device type (``clock_for``):
    - ``EventClock`` (cuda): a ``mark()`` records a CUDA event on the current stream; ``add(a, b,
      ...)`` remembers the pair and ``settle()`` reads every pair's ``elapsed_time`` after the
      step's own final synchronization (the loss's ``float``), so timing adds no sync to the step.
      A pair's seconds are the stream's time between the two points: the kernels in between and
      any gap where the GPU waited for Python to launch more (what a launch-bound stage costs).
      A receive the schedule waits on before a stage call is a stream wait queued before the
      first mark, so it is not in the stage's time, as on CPU.
    - ``HostClock`` (cpu and anything else): perf_counter, added at once.
    ``sync_now(device)`` is the other way, for a loop that times one thing at a time
    (``--calibrate``, partitioner/calibrate/measure.py): wait for the device, then read the host
    clock.
"""

from __future__ import annotations

import time

import torch


class HostClock:
    """perf_counter marks, each span added when given (Note [timing on a device])."""

    kind = "perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def add(self, start, end, into: list, index: int) -> None:
        into[index] += end - start

    def settle(self) -> None:
        pass

    def discard(self) -> None:
        pass


class EventClock:
    """CUDA event marks on the current stream, spans read at ``settle()`` (Note [timing on a device])."""

    kind = "cuda_events"

    def __init__(self):
        self.pending: list[tuple] = []

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start, end, into: list, index: int) -> None:
        self.pending.append((start, end, into, index))

    def settle(self) -> None:
        """Add every pending span; call after a synchronization that covers the last mark (the
        wait below is then free)."""
        for start, end, into, index in self.pending:
            end.synchronize()
            into[index] += start.elapsed_time(end) / 1000.0  # elapsed_time is in milliseconds
        self.pending.clear()

    def discard(self) -> None:
        """Forget spans taken outside a step (a canary's or an evaluation's call of a timed stage)."""
        self.pending.clear()


def clock_for(device: torch.device | str):
    """The clock that times work on ``device`` (Note [timing on a device])."""
    return EventClock() if torch.device(device).type == "cuda" else HostClock()


def sync_now(device: torch.device | str) -> float:
    """perf_counter after the device has finished what was queued on it (Note [timing on a device])."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
