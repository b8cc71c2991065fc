"""The control group: one gloo group over the world for the runtime's small host-side bookkeeping
collectives, and the start-up barrier.

Note [the control group]: NCCL serves only CUDA tensors, and the runtime's bookkeeping (which
checkpoint steps each rank can restore, the checkpoint stall and step time) is a few host numbers
read back on the host; it goes over this gloo group, made once at start-up after
``create_groups`` on every rank in the same order, rather than device tensors on the default
group, because (1) gloo raises in Python when a peer dies, so recovery says "a peer rank died" in
one line (Note [a dead peer] in runtime/launch/rank.py) where NCCL's watchdog would abort; (2)
gloo's ``monitored_barrier`` takes the timeout the start-up barrier needs; (3) a bookkeeping
gather never waits behind the device's kernels. Only the main thread uses it: the Checkpointer's
background persist and the memory tier have gloo groups of their own (two threads on one group
could pair collectives in another order on each rank). Every gloo group spans the whole world:
with the default group bound to a device, torch has a rank outside a new subgroup join an NCCL
split that a gloo subgroup's members never make.

Note [start-up barrier]: the ranks reach their first collective at different times: stage
compilation (per rank, Note [compiled stages] in runtime/execute/compile_stages.py), pretrained weights,
a checkpoint restore. A collective waits only ``collective_timeout_s`` (60 s by default), and under
NCCL an expired wait aborts the process. So ``startup_barrier`` waits for every rank with
STARTUP_TIMEOUT_S before the first collective after the stages are built and again before step 1:
skew up to half an hour is waited out; a rank that died is still an error at once (gloo sees its
connection close).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

STARTUP_TIMEOUT_S = 1800.0
_made: list = []  # [(the default group it was made for, the control group)]: the newest only


def make_control_group(timeout: timedelta):
    """Create the control group (collective: every rank, right after ``create_groups``)."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timeout, backend="gloo")
    _made[:] = [(dist.group.WORLD, group)]
    return group


def release() -> None:
    """Forget the control group, with the default group it was made for: called before
    ``destroy_process_group``, so the held groups do not keep the world's store (and its port)
    alive into a next world made in this process (a test, a notebook)."""
    _made.clear()


def control_group():
    """The control group of the current default group. None (the default group itself) when none
    was made and the default group is gloo (a test's or a notebook's hand-made world)."""
    if _made and _made[0][0] is dist.group.WORLD:
        return _made[0][1]
    if dist.get_backend() == "gloo":
        return None
    raise RuntimeError("no control group was made for this process group: call "
                       "runtime.parallel.control.make_control_group right after create_groups on every rank")


def startup_barrier(timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Every rank waits here for every other, up to ``timeout_s`` (Note [start-up barrier])."""
    if dist.get_world_size() < 2:
        return
    dist.monitored_barrier(group=control_group(), timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
