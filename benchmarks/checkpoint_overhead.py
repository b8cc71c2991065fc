"""What checkpointing costs, measured on this machine with a compiled 2-stage GPT program.

1. Snapshot stall as a share of step time, checkpointing every step and every 10 steps (target
   <= 1% at every 10 steps), from the runtime's own per-checkpoint figures
   (RUN_DIR/checkpoint_stats_rank_<r>.jsonl: stall_s, persist_s, bytes) and metrics.jsonl; plus
   the step-time change against a run without periodic checkpoints (the background persist
   shares the CPU with training).
2. Persist throughput (shard bytes / persist seconds: header, streamed tensor buffers hashed while
   written, fsync, rename) against the raw fsync'd write throughput of the same directory,
   measured in the same run, alternating (targets: >= 80% alone, >= 60% while training).
3. The interval Young/Daly picks for --mtbf 6h from the measured stall.
4. Recovery time: a rank SIGKILLed (--fail-at), torchrun restarts the job (--max-restarts 1);
   time from the kill to the end of the first resumed step.
5. Writer balance (Note [one writer per byte]): a 1-stage x dp 2 program of the same model, in
   the same launch; bytes each rank writes per checkpoint, max/mean, and the total against every
   replica writing everything.
6. Silent data corruption check (Note [replica digests]) of that dp 2 run at the default K: the
   measured seconds per check over K steps against the median step time (target <= 1%), beside
   the cost model's figure (partitioner/solver/sdc_cost.py).
7. Lossless incremental checkpoints (--checkpoint-compression lossless, every 2 steps, a full one
   every 8): bytes per checkpoint against the plain shards of the same program, compression
   (encode) throughput, end-to-end persist time, and restore throughput (reading the newest
   checkpoint through its delta chain against reading a plain one).

    python benchmarks/checkpoint_overhead.py [--steps 40] [--width 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import hashlib
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

from runtime.resilience.sdc import DEFAULT_EVERY  # noqa: E402


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


def idle_persist_vs_raw(folder: str, root: str, reps: int = 5) -> tuple[float, float, int]:
    """(persist bytes/s, raw fsync'd bytes/s, shard bytes) with nothing else of ours running:
    rank 0's shard persisted and the raw probe run alternately, ``reps`` times each, medians (the
    machine's other load hits both alike)."""
    import torch

    from runtime.resilience import checkpoint as ck
    from tests.drivers.checkpoint_drills import FakeTrainer

    torch.set_num_threads(1)
    trainer = FakeTrainer(folder, 0)
    trainer.fake_step(0)
    snap = ck.snapshot(trainer)
    rates, raws, unhashed, hashes = [], [], [], []
    pieces = ck.shard_pieces(snap)
    for i in range(reps):
        raws.append(raw_fsync_throughput(root))
        t0 = time.perf_counter()
        info = ck.persist_shard(os.path.join(root, f"idle_{i}"), snap)
        rates.append(info.bytes / (time.perf_counter() - t0))
        t0 = time.perf_counter()  # what the persist's two halves cost apart: the streamed write ...
        ck.write_pieces_atomic(os.path.join(root, f"idle_{i}", "unhashed"), pieces, digest=False)
        unhashed.append(info.bytes / (time.perf_counter() - t0))
        t0 = time.perf_counter()  # ... and the sha256 on one core
        h = hashlib.sha256()
        for p in pieces:
            h.update(p)
        hashes.append(info.bytes / (time.perf_counter() - t0))
    IDLE_PARTS.update(unhashed=statistics.median(unhashed), sha256=statistics.median(hashes))
    return statistics.median(rates), statistics.median(raws), info.bytes


IDLE_PARTS: dict = {}


def writer_balance(root: str, steps: int) -> None:
    """Section 5: bytes per rank per checkpoint of the dp 2 run."""
    per_rank = {}
    for r in range(2):
        rows = [s for s in _rows(f"{root}/run_dp2/checkpoint_stats_rank_{r}.jsonl") if s["step"] < steps]
        per_rank[r] = statistics.median(s["bytes"] for s in rows)
    mean = sum(per_rank.values()) / len(per_rank)
    full = _rows(f"{root}/dp2_full_bytes.jsonl")[0]["bytes"]
    print(f"   bytes per checkpoint: " + ", ".join(f"rank {r} {b / 2**20:.2f} MiB" for r, b in per_rank.items())
          + f"; max/mean {max(per_rank.values()) / mean:.3f}; total {sum(per_rank.values()) / 2**20:.2f} MiB "
            f"against {full / 2**20:.2f} MiB with every replica writing everything "
            f"({sum(per_rank.values()) / full:.0%})")


def sdc_overhead(root: str, folder: str) -> None:
    from partitioner.solver.plan import Plan
    from partitioner.solver.sdc_cost import replica_check_s_per_step

    checks = [json.load(open(f"{root}/run_dp2/sdc_stats_rank_{r}.json")) for r in range(2)]
    per_check = statistics.median(s for c in checks for s in c["seconds"])
    step = statistics.median(r["step_time_s"] for r in _rows(f"{root}/run_dp2/metrics.jsonl")[1:])
    share = per_check / (DEFAULT_EVERY * step)
    plan = Plan.load(folder)
    predicted = replica_check_s_per_step(plan, DEFAULT_EVERY)
    print(f"   {sum(c['checks'] for c in checks) // 2} checks per rank, median {per_check * 1e3:.2f} ms each; "
          f"median step {step:.4f} s; per step at K={DEFAULT_EVERY}: {per_check / DEFAULT_EVERY * 1e3:.3f} ms = "
          f"{share:.3%} of a step (target <= 1%: {'met' if share <= 0.01 else 'MISSED'}); cost model "
          f"{predicted * 1e3:.3f} ms/step ({predicted / plan.predicted['step_time_s']:.3%} of the predicted step)")


def lossless(root: str, folder: str, steps: int) -> None:
    from runtime.resilience import checkpoint as ck
    from runtime.program.spec import load_program

    plain = [s for r in range(2) for s in _rows(f"{root}/run_every_1/checkpoint_stats_rank_{r}.jsonl")]
    rows = [s for r in range(2) for s in _rows(f"{root}/run_lossless/checkpoint_stats_rank_{r}.jsonl")]
    deltas = [s for s in rows if s["base_step"] is not None]
    fulls = [s for s in rows if s["base_step"] is None]
    med = statistics.median
    plain_bytes = med(s["bytes"] for s in plain)
    print(f"   bytes per rank's shard (median): plain {plain_bytes / 2**20:.2f} MiB; lossless full "
          f"{med(s['bytes'] for s in fulls) / 2**20:.2f} MiB ({med(s['bytes'] for s in fulls) / plain_bytes:.0%}), "
          f"lossless delta {med(s['bytes'] for s in deltas) / 2**20:.2f} MiB "
          f"({med(s['bytes'] for s in deltas) / plain_bytes:.0%}); over the run "
          f"{sum(s['bytes'] for s in rows) / sum(s['tensor_bytes'] for s in rows):.0%} of the tensor bytes "
          f"({len(fulls)} full, {len(deltas)} deltas)")
    enc = sum(s["tensor_bytes"] for s in rows) / sum(s["encode_s"] for s in rows)
    print(f"   compression {enc / 2**20:.0f} MiB/s of tensor bytes (in the persist thread, while training); "
          f"end-to-end persist (encode + write + fsync + commit gather) median {med(s['persist_s'] for s in rows):.3f} s "
          f"lossless vs {med(s['persist_s'] for s in plain):.3f} s plain (every-1 run)")
    program = load_program(folder)
    needed = ck.state_names(program, program.layout.stages_of_rank[0])
    times = {}
    for name, ckpt in (("lossless", f"{root}/ck_lossless"), ("plain", f"{root}/ck_every_1")):
        step = ck.list_step_dirs(ckpt)[0]
        t0 = time.perf_counter()
        loaded = ck.load_for_rank(ckpt, step, program, 0, needed)
        times[name] = (time.perf_counter() - t0, step, ck.read_manifest(ckpt, step).get("base_step"))
    nbytes = sum(t.numel() * t.element_size() for t in loaded.params.values()) + sum(
        v.numel() * v.element_size() for st in loaded.optim.values() for v in st.values())
    (lt, ls, lb), (pt, _, _) = times["lossless"], times["plain"]
    print(f"   restore of rank 0's state ({nbytes / 2**20:.1f} MiB): lossless step {ls} (a delta on {lb}) "
          f"{nbytes / lt / 2**20:.0f} MiB/s, {lt:.3f} s; plain {nbytes / pt / 2**20:.0f} MiB/s, {pt:.3f} s "
          "(verify, read, decode the chain, check every tensor's sha256)")


def _full_bytes_dp2(folder: str, root: str) -> None:
    """What one checkpoint of the dp 2 program would be if every replica wrote its whole state."""
    from runtime.resilience import checkpoint as ck
    from tests.drivers.checkpoint_drills import trainers_at

    total = sum(len(ck.serialize(ck.snapshot(t))) for t in trainers_at(folder, 1))
    with open(f"{root}/dp2_full_bytes.jsonl", "w") as f:
        f.write(json.dumps({"bytes": total}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--workdir", help="default: a fresh temporary folder")
    args = parser.parse_args()

    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt

    root = args.workdir or tempfile.mkdtemp(prefix="checkpoint_overhead_")
    folder = os.path.join(root, "program")
    model = gpt(layers=args.layers, width=args.width, heads=4, vocab=512, seq=64, dropout=0.1)
    n_params = sum(p.numel() for p in model.model.parameters())
    plan = partitioner.compile(model, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8,
                               num_stages=2, dp=1, microbatches=2)
    plan.save(folder)
    dp2 = os.path.join(root, "program_dp2")
    partitioner.compile(model, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8,
                        num_stages=1, dp=2, microbatches=2).save(dp2)
    print(f"model: gpt layers={args.layers} width={args.width} ({n_params / 1e6:.2f} M parameters), "
          f"2 stages on 2 ranks, {args.steps} steps per configuration, gloo on {os.cpu_count()} cores")

    configs = {"none": ["--checkpoint-every", "0"], "every 1": ["--checkpoint-every", "1"],
               "every 10": ["--checkpoint-every", "10"], "mtbf 6h": ["--mtbf", "6h"]}
    job = []
    for name, flags in configs.items():
        tag = name.replace(" ", "_")
        job += [folder, "--steps", str(args.steps), "--run-dir", f"{root}/run_{tag}",
                "--checkpoint-dir", f"{root}/ck_{tag}", *flags, "--"]
    job += [folder, "--steps", str(args.steps), "--run-dir", f"{root}/run_lossless", "--checkpoint-dir",
            f"{root}/ck_lossless", "--checkpoint-every", "2", "--checkpoint-compression", "lossless",
            "--keep-checkpoints", "2", "--"]
    job += [dp2, "--steps", str(args.steps), "--run-dir", f"{root}/run_dp2", "--checkpoint-dir",
            f"{root}/ck_dp2", "--checkpoint-every", "10"]
    result = _torchrun(2, [DRIVER, *job])
    idle, raw, idle_bytes = idle_persist_vs_raw(folder, root)
    _full_bytes_dp2(dp2, root)

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

    print("\n2. persist throughput (header + streamed tensors hashed while written + fsync + rename of one "
          "rank's shard)")
    total_bytes = sum(s["bytes"] for s in persist_rows)
    total_s = sum(s["persist_s"] for s in persist_rows)
    training, alone = total_bytes / total_s / raw, idle / raw
    print(f"   shards: {len(persist_rows)} of {persist_rows[0]['bytes'] / 2**20:.1f} MiB; persist "
          f"{total_bytes / total_s / 2**20:.0f} MiB/s while training (the persist threads share the "
          f"CPUs with training), {idle / 2**20:.0f} MiB/s alone ({idle_bytes / 2**20:.1f} MiB shard); raw "
          f"fsync'd write {raw / 2**20:.0f} MiB/s in the same folder (64 MiB, median of 5 alternating "
          f"with the persist)")
    print(f"   its halves alone: the streamed write without the hash {IDLE_PARTS['unhashed'] / 2**20:.0f} MiB/s "
          f"({IDLE_PARTS['unhashed'] / raw:.0%} of raw), sha256 of the same bytes on one core "
          f"{IDLE_PARTS['sha256'] / 2**20:.0f} MiB/s: the persist runs them in two threads, so it is bound "
          "by the slower where a core is free for each")
    print(f"   persist / raw: {alone:.0%} alone (target >= 80%: {'met' if alone >= 0.8 else 'MISSED'}), "
          f"{training:.0%} while training (target >= 60%: {'met' if training >= 0.6 else 'MISSED'}); "
          "a machine shared with other jobs: both figures are noisy")

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
    print("\n5. writer balance, 1 stage x dp 2 (each name written by one replica, Note [one writer per byte])")
    writer_balance(root, args.steps)
    print(f"\n6. replica digest check, 1 stage x dp 2, every {DEFAULT_EVERY} steps (the default K) and before "
          "each checkpoint")
    sdc_overhead(root, dp2)
    print("\n7. lossless incremental checkpoints (XOR delta against the previous commit, byte planes, zstd "
          "level 1; every 2 steps, a full one every 8)")
    lossless(root, folder, args.steps)
    print(f"\nfolder: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
