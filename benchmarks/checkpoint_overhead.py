"""What checkpointing costs, measured on this machine with a compiled 2-stage GPT program.

1. Snapshot stall as a share of step time, checkpointing every step and every 10 steps (target
   <= 1% at every 10 steps), from the runtime's own per-checkpoint figures
   (RUN_DIR/checkpoint_stats_rank_<r>.jsonl: stall_s, persist_s, bytes) and metrics.jsonl; plus
   the step-time change against a run without periodic checkpoints (the background persist
   shares the CPU with training).
2. Persist throughput (shard bytes / persist seconds: serialize, sha256, write, fsync, rename)
   against the raw fsync'd write throughput of the same directory, measured in the same run.
3. The interval Young/Daly picks for --mtbf 6h from the measured stall.
4. Recovery time: a rank SIGKILLed (--fail-at), torchrun restarts the job (--max-restarts 1);
   time from the kill to the end of the first resumed step.

    python benchmarks/checkpoint_overhead.py [--steps 40] [--width 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun import DRIVER, REPO  # noqa: E402
from _torchrun import rows as _rows  # noqa: E402
from _torchrun import torchrun as _torchrun  # noqa: E402


def raw_fsync_throughput(directory: str, total_mib: int = 64, chunk_mib: int = 1) -> float:
    """Bytes/s of writing ``total_mib`` MiB in ``chunk_mib`` chunks, then fsync (file and dir)."""
    path = os.path.join(directory, "raw_write_probe.bin")
    chunk = os.urandom(chunk_mib << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(total_mib // chunk_mib):
        os.write(fd, chunk)
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    elapsed = time.perf_counter() - t0
    os.remove(path)
    return (total_mib << 20) / elapsed


def idle_persist_throughput(folder: str, root: str, reps: int = 3) -> float:
    """Bytes/s of persisting rank 0's shard with nothing else running (median of ``reps``)."""
    import torch

    from runtime import checkpoint as ck
    from runtime.checkpoint_drills import FakeTrainer

    torch.set_num_threads(1)
    trainer = FakeTrainer(folder, 0)
    trainer.fake_step(0)
    snap = ck.snapshot(trainer)
    rates = []
    for i in range(reps):
        t0 = time.perf_counter()
        info = ck.persist_shard(os.path.join(root, f"idle_{i}"), snap)
        rates.append(info.bytes / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--workdir", help="default: a fresh temporary folder")
    args = parser.parse_args()

    import partitioner
    from partitioner.cluster import ClusterSpec
    from partitioner.models import gpt

    root = args.workdir or tempfile.mkdtemp(prefix="checkpoint_overhead_")
    folder = os.path.join(root, "program")
    model = gpt(layers=args.layers, width=args.width, heads=4, vocab=512, seq=64, dropout=0.1)
    n_params = sum(p.numel() for p in model.model.parameters())
    plan = partitioner.compile(model, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8,
                               num_stages=2, dp=1, microbatches=2)
    plan.save(folder)
    print(f"model: gpt layers={args.layers} width={args.width} ({n_params / 1e6:.2f} M parameters), "
          f"2 stages on 2 ranks, {args.steps} steps per configuration, gloo on {os.cpu_count()} cores")

    configs = {"none": ["--checkpoint-every", "0"], "every 1": ["--checkpoint-every", "1"],
               "every 10": ["--checkpoint-every", "10"], "mtbf 6h": ["--mtbf", "6h"]}
    job = []
    for name, flags in configs.items():
        tag = name.replace(" ", "_")
        job += [folder, "--steps", str(args.steps), "--run-dir", f"{root}/run_{tag}",
                "--checkpoint-dir", f"{root}/ck_{tag}", *flags, "--"]
    result = _torchrun(2, [DRIVER, *job])
    raw = raw_fsync_throughput(root)
    idle = idle_persist_throughput(folder, root)

    print("\n1. snapshot stall (copy to host memory; the only stall) vs step time")
    print(f"   {'config':<10} {'median step s':>13} {'stall ms':>9} {'stall/step time':>16} "
          f"{'step time vs none':>18}  (step times: a shared 2-core machine, noisy)")
    base_step = None
    persist_rows = []
    for name in configs:
        tag = name.replace(" ", "_")
        steps = [r["step_time_s"] for r in _rows(f"{root}/run_{tag}/metrics.jsonl")]
        median = statistics.median(steps[1:])
        base_step = base_step or median
        stats = []
        for r in range(2):
            path = f"{root}/run_{tag}/checkpoint_stats_rank_{r}.jsonl"
            stats.append(_rows(path) if os.path.exists(path) else [])
        # periodic checkpoints only (the final one after the last step stalls nothing that follows)
        periodic = [[s for s in rows if s["step"] < args.steps] for rows in stats]
        persist_rows += [s for rows in stats for s in rows]
        share = max(sum(s["stall_s"] for s in rows) for rows in periodic) / sum(steps)
        stall_ms = max((s["stall_s"] for rows in periodic for s in rows), default=0.0) * 1e3
        print(f"   {name:<10} {median:>13.4f} {stall_ms:>9.2f} {share:>16.3%} "
              f"{median / base_step - 1:>+18.1%}")
    with open(f"{root}/run_mtbf_6h/checkpoint_interval.json") as f:
        choice = json.load(f)

    print("\n2. persist throughput (serialize + sha256 + write + fsync + rename of one rank's shard)")
    total_bytes = sum(s["bytes"] for s in persist_rows)
    total_s = sum(s["persist_s"] for s in persist_rows)
    print(f"   shards: {len(persist_rows)} of {persist_rows[0]['bytes'] / 2**20:.1f} MiB; persist "
          f"{total_bytes / total_s / 2**20:.0f} MiB/s while training (the persist threads share the "
          f"CPUs with training), {idle / 2**20:.0f} MiB/s alone; raw fsync'd write "
          f"{raw / 2**20:.0f} MiB/s in the same folder ({total_bytes / total_s / raw:.0%} and "
          f"{idle / raw:.0%} of it)")

    print("\n3. --mtbf 6h: " + next((line.split("] ", 1)[1] for line in result.stderr.splitlines()
                                     if "checkpoint interval: every" in line), json.dumps(choice)))

    print("\n4. recovery: rank 1 SIGKILLed before step 12 (checkpoint every 5), --max-restarts 1")
    run_dir = f"{root}/run_kill"
    _torchrun(2, [os.path.join(folder, "train.py"), "--steps", "16", "--checkpoint-every", "5",
                  "--fail-at", "1:12:kill", "--run-dir", run_dir, "--checkpoint-dir", f"{root}/ck_kill"],
              max_restarts=1)
    fault = _rows(f"{run_dir}/faults.jsonl")[0]
    rows = _rows(f"{run_dir}/metrics.jsonl")
    resumed = [r for r in rows if r["time_unix"] > fault["time_unix"]]
    first = resumed[0]
    start = first["time_unix"] - first["step_time_s"]
    print(f"   resumed at step {first['step']} (lost {fault['step'] - first['step']} steps of work); "
          f"kill -> first resumed step done: {first['time_unix'] - fault['time_unix']:.1f} s "
          f"(restart, imports, rendezvous, process groups, checkpoint load: "
          f"{start - fault['time_unix']:.1f} s; the step: {first['step_time_s']:.2f} s)")
    print(f"\nfolder: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
