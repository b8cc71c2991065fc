"""torchrun's failure traceback and box, said in one line by `partitioner run` (Note [torchrun's
failure box] in runtime/launch/agent_output.py). golden/torchrun_failure_box.txt is what torch
2.13's agent printed when rank 1 was SIGKILLed and rank 0 then stopped with exit 1 (paths
shortened)."""

from __future__ import annotations

from pathlib import Path

from runtime.launch.agent_output import forward_agent_output, with_one_line_box

BOX = (Path(__file__).resolve().parent.parent / "golden" / "torchrun_failure_box.txt").read_text()
RANK_LINES = ("[rank 1] fault injection: kill before step 1\n"
              "[rank 0] a peer rank died at step 1 (Connection reset by peer); no restarts left\n")


def said(text: str) -> str:
    out: list[str] = []
    forward_agent_output(text.splitlines(keepends=True), out.append)
    return "".join(out)


def test_the_box_becomes_one_line_after_the_ranks_own_lines():
    out = said(RANK_LINES + BOX + "after\n")
    assert out.startswith(RANK_LINES) and out.endswith("after\n"), out
    assert "Traceback" not in out and "ChildFailedError" not in out and "=====" not in out, out
    assert "failed (exitcode" not in out  # the agent's log line of the same failure
    box_line = out[len(RANK_LINES):-len("after\n")]
    assert box_line.startswith("[run] torchrun: rank 0 exited with code 1, rank 1 was killed (SIGKILL);"), box_line
    assert box_line.count("\n") == 1


def test_a_workers_own_traceback_is_passed_on_whole():
    worker = ('Traceback (most recent call last):\n  File "/job/train.py", line 3, in <module>\n    main()\n'
              "ValueError: a bad batch\n")
    assert said(worker + "next\n") == worker + "next\n"
    chained = worker + "\nDuring handling of the above exception, another exception occurred:\n\n" + worker
    assert said(chained) == chained


def test_a_stream_ending_inside_a_block_loses_nothing_but_the_box():
    cut = BOX.split("raise ChildFailedError(")[0]  # the agent died mid-traceback: every line stays
    assert said(cut) == cut
    half_box = BOX.split("Root Cause")[0]  # the box cut short: what it held is said
    out = said(half_box)
    assert "Traceback" not in out and "rank 1 was killed (SIGKILL)" in out and "rank 0" not in out, out


def test_a_traceback_that_never_ends_is_passed_on():
    frames = "Traceback (most recent call last):\n" + '  File "x.py", line 1, in f\n' * 1000
    assert said(frames) == frames


def test_verify_shows_the_ranks_lines_not_the_box():
    """verify's failure message is the captured output's last lines: with the box as one line,
    they hold what the ranks said."""
    tail = with_one_line_box(RANK_LINES + BOX).strip().splitlines()[-8:]
    assert tail[:2] == RANK_LINES.strip().splitlines() and tail[-1].startswith("[run] torchrun: rank 0"), tail


def test_bytes_that_are_not_text_and_a_closed_stderr_never_stop_the_draining():
    """A worker's stray bytes are replaced, and a write that fails (our stderr closed) leaves the
    thread reading the pipe to its end: a full pipe would block the workers and hang the job."""
    import os

    from runtime.launch.agent_output import start_forwarding

    for write_fails in (False, True):
        read_fd, write_fd = os.pipe()
        got: list[str] = []

        def write(line: str) -> None:
            if write_fails:
                raise BrokenPipeError(32, "Broken pipe")
            got.append(line)

        thread = start_forwarding(os.fdopen(read_fd, errors="replace"), write)
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(b"\xff\xfe not text\n" + (b"x" * 1000 + b"\n") * 200 + BOX.encode())
        thread.join(timeout=30)
        assert not thread.is_alive()
        if not write_fails:
            assert got[0] == "\ufffd\ufffd not text\n" and got[-1].startswith("[run] torchrun: rank 0"), got[-1]


def test_torch_2_11s_box_names_the_signal_by_its_negative_exit_code():
    """torch 2.11's agent writes "exitcode  : -9 (pid: N)" without "(SIGKILL)" (the same failure,
    seen running tests/dist/test_runtime_dist.py under torch 2.11)."""
    old = BOX.replace("exitcode  : -9 (pid: 5220)  (SIGKILL)", "exitcode  : -9 (pid: 5220)")
    assert "exitcode  : -9 (pid: 5220)\n" in old
    out = said(RANK_LINES + old)
    assert "rank 1 was killed (SIGKILL)" in out and "rank 0 exited with code 1" in out, out
