"""Silent data corruption across data-parallel replicas: the replicas of a stage hold bit-identical
parameters and optimizer state, so every K steps they compare a digest of them, and a mismatch rolls
the job back to the newest checkpoint taken while they still agreed.

Note [replica digests]: replicas run the same optimizer step on all-reduced gradients, so their
parameters and AdamW state are equal to the bit (tests/dist check resumed runs against that). A
rank's digest is, for its parameters and separately for its optimizer state, the int64 sum of the
tensors' bit patterns read as int32 words (int16 or uint8 for narrower dtypes), on the device
where the tensors live: one pass over memory, no host copy. A single flipped bit changes one word
by +-2^k (k < 32), which no int64 sum wraps to zero, so one flip is always seen; more flips could
cancel only by coincidence. Every rank's two numbers go to every rank in one all_gather (16 bytes
per rank); every rank compares each data-parallel group alike, so all of them see the same
finding at the same step. With three or more replicas the odd one out is the replica outside the
majority; with two, both are named.

A check runs after every K-th step (``sdc_every``, a plan setting priced by
partitioner/solver/sdc_cost.py), after a step that a disk checkpoint follows (so every checkpoint
is one whose digests agreed), and after the last step. It runs before the checkpoint points of
the same step, so a disagreeing state is never checkpointed. On a finding every rank raises
``SilentDataCorruption``; runtime/launch/rank.py rolls back (``roll_back``: the newest checkpoint at or
before the last agreeing check, Note [recovery agreement]) and trains on. Findings go to the log
and RUN_DIR/sdc.jsonl.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.resilience import checkpoint as ck
from runtime.resilience.faults import say
from runtime.resilience.recovery import recover

DEFAULT_EVERY = 20  # K when the plan does not say (benchmarks/checkpoint_overhead.py measures its cost)

# Note [no replica check on sharded state]: with sharded optimizer state (ZeRO-1) each piece of a
# parameter is updated once, by the replica that owns it, and all-gathered into every replica: a
# bit flipped in any copy pollutes that step's gradients, the owners' updates carry it, and the
# gather makes every replica equal again, so replicas agree bit for bit on a corrupted state (and
# AdamW's moments exist once, on the owner: nothing to compare). Redundancy the check could read
# does not exist there. So a sharded program runs no replica check (compile sets sdc_every 0, its
# cost is not priced), and asking for one (--sdc-every K > 0, --flip-bit) is refused before any
# worker starts, with the fix, rather than run and see nothing.


def sharded_refusal(what: str) -> str:
    """Why ``what`` (a flag) does not run on a program with sharded optimizer state, and the fix."""
    return (f"{what}: the replica check cannot see corruption when the optimizer state is sharded (ZeRO-1: "
            "each piece is updated by its owner and gathered into every replica, so all replicas agree on a "
            "corrupted state; Note [no replica check on sharded state] in runtime/resilience/sdc.py): drop the flag "
            "(--sdc-every 0), or recompile with --shard-optimizer off to run the check")


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """int64 sum of ``t``'s bit patterns (Note [replica digests]), a 0-d tensor on t's device."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    size = flat.element_size()
    word = torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8
    return flat.contiguous().view(word).sum(dtype=torch.int64)


def rank_digest(trainer) -> torch.Tensor:
    """[parameters, optimizer state] digests of ``trainer``'s state, int64, on its device."""
    params = optim = None
    from runtime.parallel.tensor_parallel import local  # a DTensor: this rank's piece (Note [tensor-parallel stages])

    for name, p in sorted(trainer.named_parameters().items()):
        d = tensor_digest(local(p))
        params = d if params is None else params + d
        for key, v in sorted((trainer.optimizer.state.get(p) or {}).items()):
            if isinstance(v, torch.Tensor) and v.numel() > 1:  # exp_avg, exp_avg_sq (not the step count)
                d = tensor_digest(local(v))
                optim = d if optim is None else optim + d
    zero = torch.zeros((), dtype=torch.int64, device=trainer.device)
    return torch.stack([zero if params is None else params, zero if optim is None else optim])


@dataclass(frozen=True)
class Finding:
    """One data-parallel group whose replicas disagree."""

    stages: tuple[int, ...]
    ranks: tuple[int, ...]          # the group, by replica
    what: str                       # "parameters", "optimizer state" or both
    odd_ranks: tuple[int, ...]      # outside the majority (every rank of the group without one)

    def text(self, step: int, replica_of) -> str:
        where = f"stage {','.join(map(str, self.stages))} (ranks {list(self.ranks)})"
        if len(self.odd_ranks) < len(self.ranks):
            who = ", ".join(f"rank {r} (replica {replica_of[r]})" for r in self.odd_ranks)
            blame = f"odd one out by majority: {who}"
        else:
            blame = f"{len(self.ranks)} replicas, no majority: cannot tell which one is wrong"
        return f"silent data corruption: {self.what} of {where} disagree after step {step}; {blame}"


def find_mismatches(rows: list[list[int]], dp_groups, stages_of_rank) -> list[Finding]:
    """The groups of ``dp_groups`` whose ranks' digest rows differ (Note [replica digests])."""
    out = []
    for group in dp_groups:
        if len(group) < 2:
            continue
        values = [tuple(rows[r]) for r in group]
        if len(set(values)) == 1:
            continue
        parts = [name for i, name in enumerate(("parameters", "optimizer state"))
                 if len({v[i] for v in values}) > 1]
        common, count = Counter(values).most_common(1)[0]
        odd = tuple(r for r, v in zip(group, values) if v != common) if count * 2 > len(group) else tuple(group)
        out.append(Finding(tuple(stages_of_rank[group[0]]), tuple(group), " and ".join(parts), odd))
    return out


class SilentDataCorruption(Exception):
    """Raised on every rank when replicas disagree; ``last_agreed``: steps done at the last check
    that agreed (what a rollback may go back to)."""

    def __init__(self, step: int, findings: list[Finding], last_agreed: int, replica_of):
        self.step, self.findings, self.last_agreed = step, findings, last_agreed
        super().__init__("; ".join(f.text(step, replica_of) for f in findings))


class ReplicaCheck:
    """The check as a RankTrainer.run ``after_step`` hook (Note [replica digests]).

    every: K; also_at(done) -> bool: checkpoint points (a check precedes each); last_step: the
    run's --steps (checked too); start_step: where this run starts (a resumed checkpoint was
    checked when it was written)."""

    def __init__(self, trainer, every: int, *, run_dir: str, also_at=None, last_step: int | None = None,
                 start_step: int = 0):
        self.trainer, self.every, self.run_dir = trainer, int(every), run_dir
        self.also_at, self.last_step = also_at, last_step
        self.last_agreed = start_step
        self.layout = trainer.program.layout
        self.seconds: list[float] = []

    def due(self, done: int) -> bool:
        return (done % self.every == 0 or done == self.last_step
                or (self.also_at is not None and self.also_at(done)))

    def after_step(self, step: int, loss: float, step_time_s: float) -> None:
        done = step + 1
        if self.due(done):
            self.check(done)

    def check(self, done: int) -> None:
        t0 = time.perf_counter()
        mine = rank_digest(self.trainer)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        rows = torch.stack(gathered).cpu().tolist()
        self.seconds.append(time.perf_counter() - t0)
        findings = find_mismatches(rows, self.layout.dp_groups, self.layout.stages_of_rank)
        if not findings:
            self.last_agreed = done
            return
        exc = SilentDataCorruption(done, findings, self.last_agreed, self.layout.replica_of_rank)
        if self.trainer.rank == 0:
            say(0, str(exc))
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "sdc.jsonl"), "a") as fh:
                for f in findings:
                    fh.write(json.dumps({"step": done, "stages": list(f.stages), "ranks": list(f.ranks),
                                         "what": f.what, "odd_ranks": list(f.odd_ranks),
                                         "odd_replicas": [self.layout.replica_of_rank[r] for r in f.odd_ranks]
                                         if len(f.odd_ranks) < len(f.ranks) else [],
                                         "last_agreed_step": self.last_agreed, "time_unix": time.time()}) + "\n")
        raise exc

    def finish(self) -> None:
        """RUN_DIR/sdc_stats_rank_<r>.json: how many checks, and their seconds (the benchmark's)."""
        if not self.seconds:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, f"sdc_stats_rank_{self.trainer.rank}.json"), "w") as fh:
            json.dump({"every": self.every, "checks": len(self.seconds), "seconds": self.seconds}, fh)


def roll_back(trainer, exc: SilentDataCorruption, *, ckpt_dir: str | None, checkpointer, memory,
              check: ReplicaCheck) -> int:
    """After ``exc`` on every rank: restore the newest checkpoint at or before ``exc.last_agreed``
    valid on every rank (collective), set newer ones aside, and return the step to train from."""
    if checkpointer is None or ckpt_dir is None:
        raise RuntimeError(f"{exc}; this run writes no checkpoints (--no-checkpoint): nothing to roll back "
                           "to, the job stops") from exc

    checkpointer.settle()  # the persist in flight (possibly of a step after the corruption) ends first
    if memory is not None:
        memory.settle()
    # rank 0 commits (manifest, pruning) after the others' persists end: nobody lists the
    # checkpoints before every rank, rank 0 included, has settled
    dist.barrier()
    older = [s for s in ck.list_step_dirs(ckpt_dir) if s <= exc.last_agreed]
    step = recover(trainer, ckpt_dir, not_after=exc.last_agreed) if older else 0
    if step == 0:
        raise RuntimeError(f"{exc}; no checkpoint at or before step {exc.last_agreed} (the last check whose "
                           f"digests agreed) to roll back to: the job stops; checkpoint at least every "
                           f"{check.every} steps (--checkpoint-every) so a rollback has one") from exc
    checkpointer.rolled_back(step)
    if memory is not None:
        memory.store.invalidate_newer(step)  # what memory held past the rollback step is void
    check.last_agreed = step
    if trainer.rank == 0:
        say(0, f"rolled back to the checkpoint of step {step} (digests agreed there); training on")
        with open(os.path.join(check.run_dir, "sdc.jsonl"), "a") as fh:
            fh.write(json.dumps({"rolled_back_to": step, "detected_at": exc.step, "time_unix": time.time()}) + "\n")
    return step
