"""A host lost for good, recovered by re-planning (`partitioner run --elastic`, Note [elastic run]),
from memory against from disk, measured on this machine and printed side by side in one run.

A compiled 2 x 2 GPT program with dropout on 4 ranks as two simulated hosts (--hosts 0,0,1,1, one
torchrun elastic agent each, the 2-host loopback setup); host 1 lost for good before step 5
(--fail-host 1:5:permanent); disk checkpoints every 3 steps. Two runs of the same program:

    memory   the memory tier's copy mode: the survivors hand their slots (and the copies of host 1's
             ranks they held) over to the re-planned program (Note [memory handover])
    disk     --memory-tier off: the re-planned program reshards the newest disk checkpoint (step 3),
             and re-trains the steps after it

For each: the time from the host's loss (the fault's record, RUN_DIR/faults.jsonl) to the end of
the first step the re-planned program trains (metrics.jsonl), its parts (the host timeout and the
restarted workers' start-up, the restore from the tier, recovery.jsonl's elastic row), the step
recovered and the steps re-trained; the re-plan itself in this process; and each run's losses
against the one-process oracle.

    python benchmarks/elastic_recovery.py [--steps 8] [--host-timeout 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _elastic_job import run_elastic  # noqa: E402 - after the path above
from _torchrun import rows  # noqa: E402
FAIL_BEFORE = 5


def _run(folder: str, root: str, name: str, *, steps: int, memory: bool, host_timeout: float) -> dict:
    run_dir, ckpt = os.path.join(root, f"run_{name}"), os.path.join(root, f"ck_{name}")
    run_elastic(folder, run_dir, ckpt, steps=steps, name=name,
                flags=["--checkpoint-every", "3", "--fail-host", f"1:{FAIL_BEFORE}:permanent", "--host-timeout",
                       str(host_timeout), *([] if memory else ["--memory-tier", "off"])])
    fired = rows(os.path.join(run_dir, "faults.jsonl"))
    if not fired:
        raise SystemExit(f"{name}: the host fault did not fire (see {run_dir})")
    lost = max(r["time_unix"] for r in fired)
    elastic = [r for r in rows(os.path.join(run_dir, "recovery.jsonl")) if r.get("kind") == "elastic"]
    metrics = rows(os.path.join(run_dir, "metrics.jsonl"))
    first = min((r for r in metrics if r["time_unix"] > lost), key=lambda r: r["time_unix"])
    losses = {}
    for r in metrics:
        losses[r["step"]] = r["loss"]
    return {"lost": lost, "first_new_step_s": first["time_unix"] - lost,
            "restored_s": max(r["since_loss_s"] for r in elastic), "restore_s": max(r["restore_s"] for r in elastic),
            "step": elastic[0]["step"], "tier": elastic[0]["tier"],
            "disk_shards_read": sum(r["disk_shards_read"] for r in elastic),
            "retrained": FAIL_BEFORE - elastic[0]["step"], "losses": [losses[s] for s in range(steps)],
            "first_step_s": first["step_time_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--host-timeout", type=float, default=3.0)
    args = parser.parse_args()
    os.environ.setdefault("PARTITIONER_NO_CALIBRATE", "1")  # the cpu preset: figures that do not move with the cache
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt
    from partitioner.replan import replan
    from runtime.execute.reference import train_reference_from_folder

    root = tempfile.mkdtemp(prefix="elastic_bench_")
    try:
        folder = os.path.join(root, "p22")
        partitioner.compile(gpt(layers=4, width=32, heads=2, vocab=64, seq=16, dropout=0.1),
                            cluster=ClusterSpec.homogeneous(4, "cpu", devices_per_node=2), global_batch=8,
                            num_stages=2, dp=2, microbatches=4, training={"memory_tier": "auto"}).save(folder)
        t0 = time.perf_counter()
        planned = replan(folder, [0, 1])
        replan_s = time.perf_counter() - t0
        runs = {}
        for name, memory in (("memory", True), ("disk", False)):
            runs[name] = _run(folder, root, name, steps=args.steps, memory=memory, host_timeout=args.host_timeout)
            if name == "memory":  # the next run re-plans into the same folder beside DIR
                shutil.rmtree(folder + ".elastic-h0", ignore_errors=True)
        ref, _, _ = train_reference_from_folder(folder, args.steps)
        print(f"host 1 of 2 lost for good before step {FAIL_BEFORE}, 4 -> 2 ranks: {planned.summary()}")
        print(f"re-plan in this process: {replan_s * 1e3:.0f} ms (written beside DIR before the agents start)")
        print(f"{'':34}{'memory':>12}{'disk':>12}")
        m, d = runs["memory"], runs["disk"]
        for label, key, fmt in (("loss -> first new step end (s)", "first_new_step_s", "{:.1f}"),
                                ("loss -> state restored (s)", "restored_s", "{:.1f}"),
                                ("  of which the restore (ms)", "restore_s", "{:.0f}"),
                                ("step recovered", "step", "{}"), ("source", "tier", "{}"),
                                ("disk shards read", "disk_shards_read", "{}"),
                                ("steps re-trained", "retrained", "{}"),
                                ("first new step's time (s)", "first_step_s", "{:.2f}")):
            scale = 1e3 if key == "restore_s" else 1
            vals = [fmt.format(r[key] * scale if isinstance(r[key], float) else r[key]) for r in (m, d)]
            print(f"{label:34}{vals[0]:>12}{vals[1]:>12}")
        for name, r in runs.items():
            worst = max(abs(a - b) for a, b in zip(r["losses"], ref))
            per_step = " ".join(f"{abs(a - b):.1e}" for a, b in zip(r["losses"], ref))
            print(f"{name}: max |loss - oracle| {worst:.2e} (per step: {per_step})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
