"""make_batch functions for the tests of timeouts and failures: one that never returns (a worker that
hangs without printing), one that fails."""

import time


def sleepy_batch(step: int, batch_size: int, entered: str | None = None, **kwargs):
    """``entered``: a file created on entry, so a test knows the worker got this far."""
    if entered:
        open(entered, "w").close()
    while True:
        time.sleep(60)


def failing_batch(step: int, batch_size: int, **kwargs):
    """A make_batch that fails on its first call, as a user's data can."""
    raise ValueError(f"no batch {step}: the corpus file is empty")


def paced_batch(step: int, batch_size: int, delay_s: float = 0.5, **kwargs):
    """runtime.data.synthetic's token_batch, ``delay_s`` late: a run that stays alive a known while."""
    from runtime.data.synthetic import token_batch  # lazy: loads torch, only in a worker

    time.sleep(delay_s)
    return token_batch(step, batch_size, **kwargs)
