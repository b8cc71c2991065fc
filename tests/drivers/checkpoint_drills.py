"""Drills of the checkpoint protocol in one process, for the crash-consistency tests and benchmarks:
a RankTrainer-shaped stand-in built from a program folder (no process group), and persists that
SIGKILL themselves at a chosen byte or operation (runtime.resilience.checkpoint.FaultPoint).

Lives in runtime, beside what it drills, so tests and benchmarks share it without importing each
other; generated programs never import it.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import zlib

import torch

from runtime.resilience import checkpoint as ck
from runtime.resilience.checkpoint.delta import encode_snapshot
from runtime.resilience.checkpoint.writers import write_cost, writes_of_ranks
from runtime.program.spec import Program, load_program
from runtime.resilience.recovery import agree_newest
from runtime.execute.stage import build_stage
from runtime.execute.train import RankTrainer, make_optimizer


class FakeTrainer:
    """What runtime.resilience.checkpoint reads and writes of a RankTrainer, for one rank of ``folder``."""

    named_parameters = RankTrainer.named_parameters
    named_mutable_buffers = RankTrainer.named_mutable_buffers

    def __init__(self, folder: str, rank: int, program: Program | None = None):
        self.folder, self.rank = folder, rank
        self.program = program or load_program(folder)
        layout = self.program.layout
        self.stage_ids = layout.stages_of_rank[rank]
        self.replica = layout.replica_of_rank[rank]
        self.modules = [build_stage(folder, s, "cpu") for s in self.stage_ids]
        unique = list({id(p): p for m in self.modules for p in m.parameters()}.values())
        self.optimizer, self.lr_scheduler = make_optimizer(unique, self.program.optimizer)
        self.steps_done = 0

    def fake_step(self, seed: int) -> None:
        """An optimizer step with gradients drawn from ``seed`` (the same for every copy of a name)."""
        for name, p in self.named_parameters().items():
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1


def trainers_at(folder: str, steps: int) -> list[FakeTrainer]:
    program = load_program(folder)
    out = [FakeTrainer(folder, r, program) for r in range(program.world_size)]
    for t in out:
        for s in range(steps):
            t.fake_step(s)
    return out


def random_point(rng, trial: int, total_bytes: int, total_ops: int, shard_bytes: int) -> dict:
    """A kill point for ``killed_commit``, cycling over three kinds: a random byte of the shards,
    a random byte of the manifest (after every shard byte), a random operation."""
    kind = trial % 3
    if kind == 0:
        return {"after_bytes": rng.randrange(1, shard_bytes + 1)}
    if kind == 1:
        # (the manifest's length varies by a few bytes with its timestamp: stay clear of its end)
        return {"after_bytes": rng.randrange(shard_bytes + 1, total_bytes - 16)}
    return {"before_op": rng.randrange(0, total_ops)}


def drill_writes(trainers, program: Program) -> dict[int, frozenset[str]]:
    """What each rank of ``trainers`` writes (Note [one writer per byte]), as the Checkpointer
    computes it across ranks."""
    nbytes: dict[str, int] = {}
    for t in trainers:
        nbytes.update(write_cost(t))
    return writes_of_ranks(program, nbytes)


def lossless_snaps(trainers, writes, base: dict | None, base_step: int | None) -> list:
    """Each rank's share encoded as the Checkpointer encodes it (Note [lossless deltas]): against
    ``base`` (rank -> the tensors of its last committed share), or full when None."""
    out = []
    for t in trainers:
        share = ck.snapshot(t, None if writes is None else writes[t.rank])
        out.append(encode_snapshot(share, None if base is None else base[t.rank], base_step))
    return out


def count_commit(ckpt_dir: str, snaps, program, *, keep: int, writes=None) -> tuple[int, int]:
    """(bytes, operations) one commit_local performs from the state ``ckpt_dir`` is in (done on a
    scratch copy); the shards are the first sum(len(ck.serialize(s))) of those bytes."""
    scratch = ckpt_dir.rstrip("/") + ".count"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(ckpt_dir, scratch)
    counter = ck.FaultPoint(action="raise")
    ck.commit_local(scratch, snaps, program, keep=keep, fault=counter, writes=writes)
    shutil.rmtree(scratch, ignore_errors=True)
    return counter.bytes_done, counter.ops_done


def killed_commit(ckpt_dir: str, snaps, program, *, keep: int, after_bytes=None, before_op=None,
                  timeout_s: float = 30.0, writes=None) -> bool:
    """Run commit_local in a forked child that SIGKILLs itself at the given point; True if it
    died there (False: the point lay beyond the end and the commit finished)."""
    pid = os.fork()
    if pid == 0:  # child: no pytest teardown, no atexit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # the "[fault] killing ..." line, once per trial
        try:
            ck.commit_local(ckpt_dir, snaps, program, keep=keep, writes=writes,
                            fault=ck.FaultPoint(after_bytes=after_bytes, before_op=before_op))
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    deadline = time.time() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"persist child {pid} did not finish in {timeout_s} s")
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL, (
            f"persist child died of signal {os.WTERMSIG(status)}, not SIGKILL (after_bytes={after_bytes}, "
            f"before_op={before_op})")
        return True
    assert os.WEXITSTATUS(status) == 0, f"persist child failed with exit code {os.WEXITSTATUS(status)}"
    return False


def newest_for_all(ckpt_dir: str, program: Program) -> tuple[int | None, dict]:
    """What recovery would pick (every rank's view, then the agreement) and each rank's load."""
    views, loads = [], {}
    layout = program.layout
    for rank in range(program.world_size):
        needed = ck.state_names(program, layout.stages_of_rank[rank])
        valid, _ = ck.find_valid(ckpt_dir, program, rank, needed)
        views.append(valid)
    step = agree_newest(views)
    if step is not None:
        for rank in range(program.world_size):
            needed = ck.state_names(program, layout.stages_of_rank[rank])
            loads[rank] = ck.load_for_rank(ckpt_dir, step, program, rank, needed)
    return step, loads


def same_state(loaded: ck.LoadedCheckpoint, snap: ck.Snapshot) -> bool:
    """Every parameter and optimizer tensor of ``loaded`` equals the snapshot's (a whole one, taken
    without ``writes``), bit for bit."""
    for name, t in loaded.params.items():
        if not torch.equal(t, snap.tensors[f"param/{name}"]):
            return False
        for key, v in loaded.optim.get(name, {}).items():
            if not torch.equal(v, snap.tensors[f"optim/{name}/{key}"]):
                return False
    return loaded.step == snap.step

