"""Progress of `partitioner compile` on stderr: one line per named step (model, trace, passes,
calibrate, solve, write) with its time, and the solver's candidates done/total with the incumbent
step time and the bound as they improve.

On a terminal each update overwrites the current line (``\\r``) and a finished step leaves one
line; otherwise every update is its own plain line (solver updates only when the incumbent or
the bound moves, or every few seconds). ``verbose`` adds the solver's per-candidate lines.
"""

from __future__ import annotations

import shutil
import sys
import time

_OPEN: list["CompileProgress"] = []  # printers with an unfinished \r line (see end_open_lines)


def end_open_lines() -> None:
    """End any progress line left open on a terminal (before an error message is printed)."""
    for printer in list(_OPEN):
        printer.close(failed=True)


class CompileProgress:
    """A ``progress`` callback for compile(): str messages start steps (their first word names
    the step; a message whose first word is the current step's is a detail of it), solver
    updates (solver.solve.SolveProgress) update the solve step."""

    def __init__(self, stream=None, *, quiet: bool = False, verbose: bool = False, tty: bool | None = None,
                 prefix: str = "[compile] ", plain_every_s: float = 5.0, tty_every_s: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        self.quiet, self.verbose, self.prefix = quiet, verbose, prefix
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.plain_every_s, self.tty_every_s = plain_every_s, tty_every_s
        self.started = time.perf_counter()
        self.step: str | None = None
        self.step_text = ""
        self.step_started = 0.0
        self.step_detail = ""
        self.times: list[tuple[str, float]] = []
        self.shown = False  # a \r line is on screen
        self.last_print = 0.0
        self.last_key = None

    # --- the callback -----------------------------------------------------------------------------

    def __call__(self, message) -> None:
        if self.quiet:
            return
        if hasattr(message, "candidate_line"):  # a SolveProgress
            self._solver(message)
            return
        text = str(message)
        name = text.replace(":", " ").split(" ", 1)[0]
        if name and name == self.step:
            self.step_detail = text
            self._emit(text, keep=not self.tty)
        else:
            self._begin(name, text)

    def close(self, *, failed: bool = False) -> None:
        """End the current step (its time), or on failure just end the open line."""
        if self in _OPEN:
            _OPEN.remove(self)
        if self.quiet:
            return
        if failed:
            if self.shown:
                self.stream.write("\n")
                self.stream.flush()
                self.shown = False
            return
        self._end()
        if self.times:
            steps = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.times)
            self._emit(f"done in {time.perf_counter() - self.started:.1f} s ({steps})", keep=True)

    # --- steps ------------------------------------------------------------------------------------

    def _begin(self, name: str, text: str) -> None:
        self._end()
        self.step, self.step_text, self.step_detail = name, text, ""
        self.step_started = time.perf_counter()
        self.last_key = None
        if self not in _OPEN:
            _OPEN.append(self)
        self._emit(f"{text} ...", keep=not self.tty)

    def _end(self) -> None:
        if self.step is None:
            return
        seconds = time.perf_counter() - self.step_started
        self.times.append((self.step, seconds))
        line = f"{self.step_text} ... {seconds:.2f} s"
        if self.step_detail:
            line += f"; {self.step_detail.split(': ', 1)[-1]}"
        self._emit(line, keep=True)
        self.step = None

    def _solver(self, event) -> None:
        now = time.perf_counter()
        redraw = False
        if self.verbose and event.candidate is not None:
            self._emit(event.candidate_line(), keep=True)
            redraw = True  # the status line went up with it
        status = str(event)
        key = (event.incumbent_s, event.bound_s)
        self.step_detail = status
        if self.step is None:  # solve() called without a "solve" step message
            self._begin("solve", "solve")
            self.step_detail = status
        if self.tty:
            if event.finished or redraw or now - self.last_print >= self.tty_every_s:
                self._emit(f"{status} ({now - self.step_started:.1f} s)", keep=False)
        elif event.finished or key != self.last_key or now - self.last_print >= self.plain_every_s:
            if not event.finished:  # the step's closing line states the final one
                self._emit(status, keep=True)
        self.last_key = key

    # --- output -----------------------------------------------------------------------------------

    def _emit(self, text: str, *, keep: bool) -> None:
        """keep: a line of its own; otherwise (terminal) the line the next update overwrites."""
        line = self.prefix + text
        if self.tty:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            if not keep and len(line) > width:
                line = line[:max(1, width - 3)] + "..."
            self.stream.write("\r\x1b[K" + line + ("\n" if keep else ""))
            self.shown = not keep
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.last_print = time.perf_counter()
