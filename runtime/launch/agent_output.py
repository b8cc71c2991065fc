"""torchrun's own failure report, said in one line (Note [torchrun's failure box]).

Note [torchrun's failure box]: when a worker exits non-zero, torchrun's agent prints its own
Python traceback (from torch/distributed/run.py down to ``raise ChildFailedError``) and a box
of every failed rank's exit code, after the ranks have already said why they stopped in one
line each (a full disk, a dead peer, a refused checkpoint). The traceback is the launcher's,
never the cause, and buries the rank's line under 40 lines from deep inside torch. So
`partitioner run` reads the agent's stderr (the workers', which they inherit, passes through
unchanged) and puts one line in place of the traceback and the box: each failed rank, with its
exit code or signal. A traceback whose exception is anything else (a worker's, or the agent's
own crash) is passed on whole, and so is everything when the stream ends inside an unfinished
block: nothing is hidden that is not the box.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from typing import IO, Callable, Iterable

_AGENT_FAILED = re.compile(r"^[EWI]\d{4} .*torch/distributed/elastic/multiprocessing/api\.py:\d+\] failed \(exitcode")
_RANK = re.compile(r"^\s+rank\s+:\s+(\d+)")
_EXIT = re.compile(r"^\s+exitcode\s+:\s+(-?\d+)(?:.*\((SIG\w+)\))?")
_RULE = "=" * 20
_MAX_HELD = 400  # lines held while deciding whose traceback it is; past that it is passed on


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def failed_ranks_line(ranks: dict[int, tuple[int, str | None]]) -> str:
    """One line for torchrun's box: ``ranks`` rank -> (exit code, signal name or None)."""
    said = [f"rank {rank} " + (f"was killed ({sig})" if sig else f"exited with code {code}")
            for rank, (code, sig) in sorted(ranks.items())]
    return (f"[run] torchrun: {', '.join(said) or 'a worker failed'}; each rank's own lines above say why "
            "(Note [torchrun's failure box])\n")


class AgentOutput:
    """Feed it stderr lines (with their newlines); it writes them on, torchrun's box as one line."""

    def __init__(self, write: Callable[[str], None]):
        self.write = write
        self.held: list[str] = []  # the agent's failure line(s) and a traceback not yet known to be its
        self.traceback = False  # whether ``held`` has reached a traceback
        self.box: dict[int, tuple[int, str | None]] | None = None  # ranks read from the box so far
        self.rules = 0  # the box's ===== lines seen
        self.rank: int | None = None

    def feed(self, line: str) -> None:
        if self.box is not None:
            self._in_box(line)
        elif self.traceback:
            self._in_traceback(line)
        elif line.startswith("Traceback (most recent call last):"):
            self.held.append(line)
            self.traceback = True
        elif _AGENT_FAILED.match(line):  # said by the box's line if a box follows (after a restart, none does)
            self.held.append(line)
        else:
            self.flush()
            self.write(line)

    def _in_traceback(self, line: str) -> None:
        self.held.append(line)
        if line.startswith((" ", "\t")) and len(self.held) < _MAX_HELD:
            return  # a frame
        if "ChildFailedError" in line:  # the agent's own traceback: the box follows
            self.held, self.traceback, self.box, self.rules = [], False, {}, 0
            return
        self.flush()

    def _in_box(self, line: str) -> None:
        if line.startswith(_RULE):
            self.rules += 1
            if self.rules == 2:
                self.write(failed_ranks_line(self.box))
                self.box = None
            return
        if (match := _RANK.match(line)) is not None:
            self.rank = int(match.group(1))
        elif (match := _EXIT.match(line)) is not None and self.rank is not None:
            code, sig = int(match.group(1)), match.group(2)
            if sig is None and code < 0:  # torch 2.11's box says "exitcode : -9" without the signal's name
                sig = _signal_name(-code)
            self.box[self.rank] = (code, sig)

    def flush(self) -> None:
        """Pass on whatever is held (the stream ended, or the held lines were not the agent's)."""
        for line in self.held:
            self.write(line)
        self.held, self.traceback = [], False
        if self.box is not None:  # a box cut short: say what it held
            self.write(failed_ranks_line(self.box))
            self.box = None


def forward_agent_output(lines: Iterable[str], write: Callable[[str], None]) -> None:
    """Every line of ``lines`` written on through AgentOutput, then whatever it held."""
    output = AgentOutput(write)
    for line in lines:
        output.feed(line)
    output.flush()


def with_one_line_box(text: str) -> str:
    """``text`` (an agent's captured stderr) with torchrun's traceback and box as one line."""
    out: list[str] = []
    forward_agent_output(text.splitlines(keepends=True), out.append)
    return "".join(out)


def _to_stderr(line: str) -> None:
    sys.stderr.write(line)
    sys.stderr.flush()


def start_forwarding(stream: IO[str], write: Callable[[str], None] = _to_stderr) -> threading.Thread:
    """A daemon thread forwarding an agent's piped stderr through AgentOutput (ours by default); it
    ends when the agent and every worker holding the pipe have exited: join it after them. Open
    the pipe with ``errors="replace"``: a worker's bytes that are not text must not stop it."""
    def forward() -> None:
        try:
            forward_agent_output(stream, write)
        except Exception:  # noqa: BLE001 - our stderr gone (a closed pipe): keep draining, or
            for _ in stream:  # the workers block on a full pipe and the job hangs
                pass

    thread = threading.Thread(target=forward, daemon=True, name="torchrun-stderr")
    thread.start()
    return thread
