"""What the precision policy and sharded optimizer state cost and save: peak memory per rank and
step time, predicted vs measured, for one model under fp32, bf16-mixed and bf16-mixed with the
AdamW state sharded over the replicas (ZeRO-1).

    .venv/bin/python benchmarks/precision.py [--steps 8] [--rounds 2]

The model is compiled three times for 2 CPU devices as 1 stage x dp 2 (so sharding has replicas
to shard over): --precision fp32, bf16-mixed with --shard-optimizer off, and bf16-mixed with
--shard-optimizer on. The three programs train in one torchrun launch with every rank's peak
measured (runtime/observe/memory.py, live tensor storages on CPU), then in --rounds unmeasured launches
that alternate the order, for step time (median of the steps after the first, best round).
Predicted figures are the plan's (partitioner inspect). On CPU, bf16 matmuls are fast only with
AMX (Note [flops per dtype] in partitioner/config/device_presets.py); the non-matmul ops and autocast's casts
are not, so bf16 may be slower here than the prediction: the figures say what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._torchrun import DRIVER, rows, torchrun  # noqa: E402

MODEL = "gpt:layers=4,width=128,heads=4,vocab=256,seq=128"
POLICIES = [("fp32", "fp32", "off"), ("bf16-mixed", "bf16-mixed", "off"),
            ("bf16-mixed + sharded", "bf16-mixed", "on")]


def jobs(folders, steps: int) -> list[str]:
    return [arg for i, folder in enumerate(folders) for arg in (["--"] if i else []) + [str(folder), "--steps", str(steps)]]


def main() -> None:
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import load_workload

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="timed launches (alternating order)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="precision_bench_"))
    folders, plans = {}, {}
    for name, precision, shard in POLICIES:
        compiled = partitioner.compile(load_workload(MODEL), cluster=ClusterSpec.homogeneous(2, "cpu"),
                                       global_batch=8, num_stages=1, dp=2, microbatches=2, precision=precision,
                                       shard_optimizer=shard, training={"model_spec": MODEL})
        folders[name] = root / "".join(c if c.isalnum() else "_" for c in name)
        compiled.save(folders[name])
        plans[name] = compiled.plan
    os.environ["PARTITIONER_MEASURE_MEMORY"] = "1"
    torchrun(2, [DRIVER, *jobs(folders.values(), 3)])
    os.environ.pop("PARTITIONER_MEASURE_MEMORY")
    peaks = {k: {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["measured_peak_bytes"]
                 for p in (f / "run").glob("memory_rank_*.json")} for k, f in folders.items()}
    rounds: dict[str, list[float]] = {k: [] for k in folders}
    for i in range(args.rounds):
        order = list(folders.items())[::1 if i % 2 == 0 else -1]
        for _, f in order:
            for sub in ("run", "checkpoints"):
                shutil.rmtree(f / sub, ignore_errors=True)
        torchrun(2, [DRIVER, *jobs((f for _, f in order), args.steps)])
        for k, f in order:
            rounds[k].append(statistics.median([r["step_time_s"] for r in rows(str(f / "run" / "metrics.jsonl"))][1:]))
    kib = 1024
    print(f"model {MODEL}, 1 stage x dp 2 on 2 CPU devices, global batch 8, 2 microbatches")
    print(f"{'policy':22} {'rank':>4} {'pred peak KiB':>14} {'measured KiB':>13} {'meas/pred':>9} | "
          f"{'optim KiB':>10} {'pred ms/step':>12} {'measured ms/step':>16}")
    base = min(rounds["fp32"])
    base_peak = max(peaks["fp32"].values())
    for name, _, _ in POLICIES:
        plan = plans[name]
        stage = plan.stages[0]
        for rank in sorted(peaks[name]):
            print(f"{name:22} {rank:>4} {stage.peak_memory_bytes / kib:14.1f} {peaks[name][rank] / kib:13.1f} "
                  f"{peaks[name][rank] / stage.peak_memory_bytes:9.2f} | {stage.memory.optimizer_bytes / kib:10.1f} "
                  f"{plan.predicted['step_time_s'] * 1e3:12.3f} {min(rounds[name]) * 1e3:16.3f}")
    for name, _, _ in POLICIES[1:]:
        print(f"{name} vs fp32: measured peak {max(peaks[name].values()) / base_peak - 1:+.1%}, "
              f"step time {min(rounds[name]) / base - 1:+.1%} (predicted "
              f"{plans[name].predicted['step_time_s'] / plans['fp32'].predicted['step_time_s'] - 1:+.1%})")
    print(f"measured peak: live tensor storages per rank (runtime/observe/memory.py); step time: best of {args.rounds} "
          f"alternating rounds of the median of {args.steps - 1} steps, 2 shared CPU cores (machine shared with "
          f"other jobs); folders: {root}")


if __name__ == "__main__":
    main()
