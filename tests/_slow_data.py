"""A make_batch that never returns: a worker that hangs without printing (tests of timeouts)."""

import time


def sleepy_batch(step: int, batch_size: int, **kwargs):
    while True:
        time.sleep(60)
