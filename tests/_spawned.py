"""Ranks of a test's own process group, spawned (not forked: torch's threads) and bounded in time."""

from __future__ import annotations

import multiprocessing as mp


def run_ranks(target, args_of_rank, *, world: int = 2, timeout_s: float = 120) -> None:
    """Run ``target(*args_of_rank(r))`` in ``world`` spawned processes; a hang is killed and fails
    the test (it does not keep the suite waiting), as does any rank's non-zero exit."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of_rank(r)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * world
