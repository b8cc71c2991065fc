"""Crash consistency of the checkpoint persist: SIGKILL at >= 1000 seeded random points.

A compiled 2 x 2 GPT program's four rank shards (real optimizer state after a few steps, each
replica writing its share: Note [one writer per byte]) are committed with the runtime's protocol
(``runtime.resilience.checkpoint.commit_local``: shards, manifest, pruning, in the order the distributed
commit uses). Checkpoints of steps 1 and 2 exist; the
persist of step 3 runs in a forked child that SIGKILLs itself after a random number of bytes or
before a random operation (open, write, fsync, rename, mkdir, unlink, rmtree, directory fsync);
the points cycle over a byte of the shards, a byte of the manifest, and an operation.
After each kill, every rank's recovery view is computed and agreed on, as at start-up; the
checkpoint chosen must be step 2 or step 3 and equal, tensor for tensor, to what was snapshotted.
Every 10th trial also re-runs the persist over the debris and checks that step 3 commits.
With ``--compression lossless`` steps 2 and 3 are deltas (step 3 against step 2, step 2 against
the full step 1: Note [lossless deltas]), so every kill lands in a delta's persist and every
recovered step is read through its chain.

    python benchmarks/crash_consistency.py [--trials 1000] [--seed 0] [--compression none|lossless]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

import torch

from runtime.resilience import checkpoint as ck
from tests.drivers.checkpoint_drills import (count_commit, drill_writes, killed_commit, newest_for_all, random_point,
                                      same_state, trainers_at)
from runtime.resilience.checkpoint.delta import encode_snapshot
from runtime.program.spec import load_program


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--compression", choices=["none", "lossless"], default="none")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt

    root = tempfile.mkdtemp(prefix="crash_consistency_")
    folder = os.path.join(root, "program")
    plan = partitioner.compile(gpt(layers=4, width=64, heads=4, vocab=128, seq=16, dropout=0.1),
                               cluster=ClusterSpec.homogeneous(4, "cpu"), global_batch=8,
                               num_stages=2, dp=2, microbatches=2)
    plan.save(folder)
    program = load_program(folder)
    trainers = trainers_at(folder, 1)
    writes = drill_writes(trainers, program)
    base = os.path.join(root, "base")

    last: dict = {}  # the previous commit's shares (a delta's base), by rank

    def shares():  # what each rank writes now, and the whole state (what every load must equal)
        plain = [ck.snapshot(t, writes[t.rank]) for t in trainers]
        out = plain
        if args.compression == "lossless":
            out = [encode_snapshot(s, last.get("tensors", {}).get(s.rank), last.get("step")) for s in plain]
        last.update(step=plain[0].step, tensors={s.rank: s.tensors for s in plain})
        return out, [ck.snapshot(t) for t in trainers]

    ck.commit_local(base, shares()[0], program, keep=args.keep, writes=writes)
    for t in trainers:
        t.fake_step(1)
    old_share, old = shares()
    ck.commit_local(base, old_share, program, keep=args.keep, writes=writes)
    for t in trainers:
        t.fake_step(2)
    share, new = shares()
    total_bytes, total_ops = count_commit(base, share, program, keep=args.keep, writes=writes)
    shard_bytes = sum(len(ck.serialize(s)) for s in share)
    print(f"program: {program.world_size} shards, commit of step 3 = {total_bytes} bytes in "
          f"{total_ops} operations (shards, manifest, pruning with keep={args.keep}); compression "
          f"{args.compression}" + (f" (step 3 a delta on step {ck.read_manifest(base, 2).get('base_step') and 2})"
                                   if args.compression == "lossless" else ""))

    rng = random.Random(args.seed)
    outcomes = {"previous (step 2)": 0, "new (step 3)": 0}
    by_kind = {"shard byte": 0, "manifest byte": 0, "op": 0}
    bad = []
    t0 = time.perf_counter()
    for trial in range(args.trials):
        work = os.path.join(root, "trial")
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        point = random_point(rng, trial, total_bytes, total_ops, shard_bytes)
        kind = ("shard byte", "manifest byte", "op")[trial % 3]
        if not killed_commit(work, share, program, keep=args.keep, writes=writes, **point):
            bad.append((trial, point, "the child was not killed"))
            continue
        by_kind[kind] += 1
        step, loads = newest_for_all(work, program)
        if step not in (2, 3):
            bad.append((trial, point, f"recovered step {step}"))
            continue
        want = old if step == 2 else new
        if not all(same_state(loads[r], want[r]) for r in loads):
            bad.append((trial, point, f"step {step} does not hold what was snapshotted"))
            continue
        outcomes["previous (step 2)" if step == 2 else "new (step 3)"] += 1
        if trial % 10 == 0:
            ck.commit_local(work, share, program, keep=args.keep, writes=writes)
            step, loads = newest_for_all(work, program)
            if step != 3 or not all(same_state(loads[r], new[r]) for r in loads):
                bad.append((trial, point, "the retry did not commit step 3"))
    elapsed = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    print(f"{args.trials} SIGKILLed persists ({by_kind['shard byte']} after a random shard byte, "
          f"{by_kind['manifest byte']} after a random manifest byte, {by_kind['op']} before a random "
          f"operation) in {elapsed:.0f} s")
    print("recovered: " + ", ".join(f"{k} {v}" for k, v in outcomes.items()) + f", partial or wrong {len(bad)}")
    for row in bad[:10]:
        print("  BAD", row)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
