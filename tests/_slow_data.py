"""A make_batch that never returns: a worker that hangs without printing (tests of timeouts)."""

import time


def sleepy_batch(step: int, batch_size: int, entered: str | None = None, **kwargs):
    """``entered``: a file created on entry, so a test knows the worker got this far."""
    if entered:
        open(entered, "w").close()
    while True:
        time.sleep(60)
