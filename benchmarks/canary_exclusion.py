"""A compute canary's exclusion re-planned without the bad host (`partitioner run --elastic`, Note
[excluding a host] in runtime/resilience/exclusion.py), against the same job without the fault,
measured on this machine and printed side by side in one run.

A compiled 1-stage GPT (dropout on) at dp 4 on 4 ranks as two simulated hosts (--hosts 0,0,1,1),
canaries every 2 steps, a checkpoint every step, the memory tier on. Two runs:

    clean    no fault: 4 ranks train every step
    exclude  --fault-matmul 3:3:permanent: caught at step 3, rolled back, caught again, host 1
             excluded, host 0's 2 ranks re-plan (1 stage x dp 2) and resume from the disk at the
             last agreeing canary

For each: the job's wall time, the canary findings (canary.jsonl), the step resumed
after the exclusion, the seconds from the exclusion (exclude.json's time) to the restored state
and to the end of the first step the survivors train, and the losses against the one-process oracle.

    python benchmarks/canary_exclusion.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _elastic_job import run_elastic  # noqa: E402 - after the path above
from _torchrun import rows  # noqa: E402


def _run(folder: str, root: str, name: str, *, steps: int, fault: str | None) -> dict:
    run_dir, ckpt = os.path.join(root, f"run_{name}"), os.path.join(root, f"ck_{name}")
    wall_s = run_elastic(folder, run_dir, ckpt, steps=steps, name=name,
                         flags=["--checkpoint-every", "1", "--host-timeout", "3",
                                *(["--fault-matmul", fault] if fault else [])])
    metrics = rows(os.path.join(run_dir, "metrics.jsonl"))
    losses = {}
    for r in metrics:
        losses[r["step"]] = r["loss"]
    out = {"wall_s": wall_s, "findings": len(rows(os.path.join(run_dir, "canary.jsonl"))),
           "losses": [losses[s] for s in range(steps)],
           "resumed": "-", "restored_s": "-", "first_new_step_s": "-"}
    excl = [r for r in rows(os.path.join(run_dir, "recovery.jsonl")) if r.get("kind") == "elastic"]
    if excl:
        at = json.load(open(os.path.join(run_dir, "exclude.handled.json")))["time_unix"]
        first = min((r for r in metrics if r["time_unix"] > at), key=lambda r: r["time_unix"])
        out.update(resumed=excl[0]["step"], restored_s=max(r["since_loss_s"] for r in excl),
                   first_new_step_s=first["time_unix"] - at)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("PARTITIONER_NO_CALIBRATE", "1")  # the cpu preset: figures that do not move with the cache
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt
    from runtime.execute.reference import train_reference_from_folder
    from runtime.features.canaries import EVERY as CANARY

    root = tempfile.mkdtemp(prefix="exclusion_bench_")
    try:
        folder = os.path.join(root, "dp4")
        partitioner.compile(gpt(layers=2, width=32, heads=2, vocab=64, seq=16, dropout=0.1),
                            cluster=ClusterSpec.homogeneous(4, "cpu", devices_per_node=2), global_batch=8,
                            num_stages=1, dp=4, microbatches=2,
                            training={"memory_tier": "auto", "sdc_every": 0, CANARY.key: 2}).save(folder)
        runs = {"clean": _run(folder, root, "clean", steps=args.steps, fault=None),
                "exclude": _run(folder, root, "exclude", steps=args.steps, fault="3:3:permanent")}
        import torch

        torch.set_num_threads(1)  # as the ranks compute
        ref, _, _ = train_reference_from_folder(folder, args.steps)
        print(f"1 stage x dp 4 on hosts 0,0,1,1, canaries every 2 steps, {args.steps} steps; the exclusion "
              "re-plans onto host 0 (1 stage x dp 2)")
        print(f"{'':40}{'clean':>10}{'exclude':>10}")
        for label, key, fmt in (("job wall time (s)", "wall_s", "{:.1f}"), ("canary findings",
                                "findings", "{}"), ("step resumed after the exclusion", "resumed", "{}"),
                                ("exclusion -> state restored (s)", "restored_s", "{:.1f}"),
                                ("exclusion -> first new step end (s)", "first_new_step_s", "{:.1f}")):
            vals = [fmt.format(r[key]) if not isinstance(r[key], str) else r[key] for r in runs.values()]
            print(f"{label:40}{vals[0]:>10}{vals[1]:>10}")
        for name, r in runs.items():
            print(f"{name}: max |loss - oracle| {max(abs(a - b) for a, b in zip(r['losses'], ref)):.2e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
