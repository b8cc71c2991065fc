"""What recompute buys and costs when it runs: peak memory per rank and step time, predicted vs measured.

    .venv/bin/python benchmarks/recompute.py [--steps 10] [--calibrate]

For each configuration: compile for 2 CPU devices whose memory makes the solver recompute some
regions, and write the plan's program ("recompute") and the same plan with recompute switched off
("plain": same stages, same weights). Both train under torchrun in one launch twice: once with
every rank's peak measured (runtime/observe/memory.py, Note [what a rank's peak counts]; live tensor
storages on CPU), then unmeasured for step time (median of the steps after the first, best of
--rounds launches that alternate which program trains first). Predicted
figures are the cost model's (partitioner.solver.evaluate.evaluate) for each assignment: by the
cpu preset, or with ``--calibrate`` by a profile measured here first (partitioner/calibrate/, its
recompute fixed term included: Note [recompute fixed cost]), which compiles and prices both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._torchrun import DRIVER, rows, torchrun  # noqa: E402


def jobs(folders, steps: int) -> list[str]:
    """tests/drivers/run_many.py's arguments: every folder trained ``steps`` steps in the same workers."""
    return [arg for i, folder in enumerate(folders) for arg in (["--"] if i else []) + [str(folder), "--steps", str(steps)]]


def configs():
    from partitioner.models.builtin import gpt

    return [
        ("gpt 4x32 seq 64 (the test's)", lambda: gpt(layers=4, width=32, heads=2, vocab=64, seq=64), 1_300_000),
        ("gpt 4x128 seq 128", lambda: gpt(layers=4, width=128, heads=4, vocab=256, seq=128), None),
    ]


def predicted(plan, workload, recompute: bool, profiles=()):
    """(step time s, peak bytes per stage) of the plan's assignment with or without its recompute."""
    from partitioner.config.cluster import ClusterSpec
    from partitioner.frontend.analysis import analyze
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.solver.evaluate import evaluate
    from partitioner.solver.problem import Assignment
    from partitioner.solver.device_layout import place_stages

    gm, _ = analyze(workload, granularity=plan.granularity)
    problem = build_problem(gm, workload.example_batch_size, profiles=profiles)
    cluster = ClusterSpec.from_dict(plan.cluster)
    regions = sorted(plan.regions, key=lambda r: r.id)
    assignment = Assignment(
        stage_of_region=tuple(r.stage for r in regions),
        recompute=tuple(r.recompute and recompute for r in regions),
        device_of_stage_replica=place_stages(cluster, plan.num_stages, plan.dp), num_stages=plan.num_stages,
        dp=plan.dp, num_microbatches=plan.num_microbatches, microbatch_size=plan.microbatch_size,
        schedule=plan.schedule)
    cost = evaluate(problem, cluster, assignment)
    return cost.step_time_s, [st.memory_bytes for st in cost.stages]


def main() -> None:
    import partitioner
    from partitioner.config.cluster import ClusterSpec

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="timed launches per configuration")
    parser.add_argument("--calibrate", action="store_true", help="price with a profile measured here first")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="recompute_bench_"))
    kib = 1024
    print(f"{'config':30} {'rank':>4} {'capacity':>9} | {'recompute: pred':>15} {'measured':>9} | "
          f"{'plain: pred':>11} {'measured':>9}   (KiB)")
    summary = []
    for name, build, capacity in configs():
        options = dict(global_batch=8, num_stages=2, microbatches=4)
        if args.calibrate:
            from partitioner.frontend.analysis import analyze
            from partitioner.calibrate import calibrate

            profile = calibrate(build(), analyze(build())[0])
            options["profiles"] = (profile,)
            print(f"{name}: calibrated, recompute_fixed_s {profile.recompute_fixed_s * 1e3:.3f} ms")
        if capacity is None:  # 80% of what the unconstrained plan needs
            free = partitioner.compile(build(), cluster=ClusterSpec.homogeneous(2, "cpu"), **options)
            capacity = int(0.8 * max(s.peak_memory_bytes for s in free.stages))
        cluster = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2, "memory_bytes": capacity}]})
        plan = partitioner.compile(build(), cluster=cluster, **options)
        plain = dataclasses.replace(plan, plan=dataclasses.replace(
            plan.plan, regions=tuple(dataclasses.replace(r, recompute=False) for r in plan.regions)))
        slug = "".join(c if c.isalnum() else "_" for c in name)
        folders = {"recompute": root / f"{slug}_r", "plain": root / f"{slug}_p"}
        plan.save(folders["recompute"])
        plain.save(folders["plain"])
        profiles = options.get("profiles", ())
        pred = {"recompute": predicted(plan, build(), True, profiles),
                "plain": predicted(plan, build(), False, profiles)}
        os.environ["PARTITIONER_MEASURE_MEMORY"] = "1"
        torchrun(2, [DRIVER, *jobs(folders.values(), 3)])
        os.environ.pop("PARTITIONER_MEASURE_MEMORY")
        peaks = {k: {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["measured_peak_bytes"]
                     for p in (f / "run").glob("memory_rank_*.json")} for k, f in folders.items()}
        rounds: dict[str, list[float]] = {k: [] for k in folders}
        for i in range(args.rounds):  # alternate which program trains first: the machine is shared
            order = list(folders.items())[::1 if i % 2 == 0 else -1]
            for _, f in order:  # a fresh run: not resumed from the previous run's checkpoint
                for sub in ("run", "checkpoints"):
                    shutil.rmtree(f / sub, ignore_errors=True)
            torchrun(2, [DRIVER, *jobs((f for _, f in order), args.steps)])
            for k, f in order:
                rounds[k].append(statistics.median(
                    [r["step_time_s"] for r in rows(str(f / "run" / "metrics.jsonl"))][1:]))
        times = {k: min(v) for k, v in rounds.items()}
        recomputed = [r.name for r in plan.regions if r.recompute]
        for rank in (0, 1):
            stage = next(s.index for s in plan.stages if rank in s.ranks)
            print(f"{name:30} {rank:>4} {capacity / kib:9.1f} | {pred['recompute'][1][stage] / kib:15.1f} "
                  f"{peaks['recompute'][rank] / kib:9.1f} | {pred['plain'][1][stage] / kib:11.1f} "
                  f"{peaks['plain'][rank] / kib:9.1f}")
        summary.append(f"{name}: recomputes {', '.join(recomputed)}; step time measured {times['recompute']:.4f} s "
                       f"vs {times['plain']:.4f} s plain ({times['recompute'] / times['plain'] - 1:+.1%}), "
                       f"predicted {pred['recompute'][0] * 1e3:.3f} ms vs {pred['plain'][0] * 1e3:.3f} ms "
                       f"({pred['recompute'][0] / pred['plain'][0] - 1:+.1%}); overhead measured "
                       f"{(times['recompute'] - times['plain']) * 1e3:.2f} ms, predicted "
                       f"{(pred['recompute'][0] - pred['plain'][0]) * 1e3:.2f} ms")
    print("\n".join(summary))
    print(f"measured peak: live tensor storages per rank (runtime/observe/memory.py); step time: best of {args.rounds} "
          f"alternating rounds of the median of {args.steps - 1} steps, 2 shared CPU cores (load average "
          f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end); folders: {root}")


if __name__ == "__main__":
    main()
