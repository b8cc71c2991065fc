"""Compiled stages against eager ones: the median step of the same plan run both ways, side by side
in one run, with the compile's seconds apart (Note [compiled stages] in runtime/execute/compile_stages.py).

    .venv/bin/python benchmarks/compiled_stages.py [--steps 20] [--json out.json]

Four plans on 2 CPU ranks, global batch 8 in 2 microbatches: the demo's GPT (`make demo`:
layers 4, width 128, 4 heads, seq 64, vocab 256) and hf-llama (2 layers, width 128, 4 heads, vocab
512, seq 64), each as 2 pipeline stages and as tp 2 (one stage). Each plan is compiled twice, the
second with compile_stages (a refused plan's row says why); all folders train in one
torchrun launch (tests/drivers/run_many.py, one thread per rank, no checkpoints beyond the last),
each twice with the modes alternating. The step is the lower of its two runs' medians after the
first step (RUN_DIR/summary.json); compile_s is the first run's warm-up before step 1 (rank 0's
stage_times): 60-130 s per program with a cold inductor cache here, a few seconds once
~/.cache or /tmp/torchinductor_$USER holds the graphs. The ratio
is eager / compiled: above 1 compiled is faster, below 1 it is a slowdown, printed as such. The
machine is 2 CPU cores shared with other jobs (the load average is printed): on a GPU the
per-op launch overhead that compilation removes is a different size. The plans are priced by this
machine's profile (``--priced-by machine``, the default: eager plans by its eager fit, compiled ones
by its compiled fit, Note [compiled machine fit]) or by the cpu preset (``--priced-by preset``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _torchrun import DRIVER, torchrun  # noqa: E402

GLOBAL_BATCH, MICROBATCHES = 8, 2
MODELS = {"demo gpt": ("gpt", dict(layers=4, width=128, heads=4, seq=64, vocab=256)),
          "hf-llama": ("hf_llama", dict(layers=2, width=128, heads=4, vocab=512, seq=64, batch=2))}
LAYOUTS = {"2 stages": dict(num_stages=2), "tp 2": dict(num_stages=1, tensor_parallel=2)}


def compile_folders(root: Path, priced_by: str = "machine") -> dict:
    """((case, "eager" | "compiled") -> folder, case -> why the compiled plan was refused)."""
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models import builtin

    folders, refusals = {}, {}
    for model, (builder, spec) in MODELS.items():
        for layout, options in LAYOUTS.items():
            for mode in ("eager", "compiled"):
                try:
                    plan = partitioner.compile(getattr(builtin, builder)(**spec), cluster=ClusterSpec.homogeneous(2, "cpu"),
                                               global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES,
                                               machine_profile="auto" if priced_by == "machine" else "preset",
                                               training={"compile_stages": mode == "compiled"}, **options)
                except ValueError as refused:  # a combination compiled stages refuse: its row says why
                    refusals[f"{model}, {layout}"] = str(refused).split(" (Note")[0]
                    continue
                folder = root / f"{model}-{layout}-{mode}".replace(" ", "_")
                plan.save(folder)
                folders[(f"{model}, {layout}", mode)] = folder
    return folders, refusals


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)  # 6 moved the ratios by up to 0.25 between runs
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--priced-by", choices=("machine", "preset"), default="machine",
                        help="what prices the plans: this machine's profile (the compiled plans by its compiled fit, "
                             "Note [compiled machine fit]; measured the first time) or the cpu preset")
    args = parser.parse_args(argv)
    if args.priced_by == "machine":
        os.environ.pop("PARTITIONER_NO_CALIBRATE", None)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="compiled-bench-") as tmp:
        folders, refusals = compile_folders(Path(tmp), args.priced_by)
        # each folder trains twice, the two modes alternating, and keeps its quieter run: the two
        # cores are shared, and a neighbour's burst during one run would decide the ratio
        jobs = [a for repeat in (1, 2) for folder in folders.values()
                for a in ("--", str(folder), "--steps", str(args.steps), "--run-dir", str(folder / f"run{repeat}"),
                          "--checkpoint-dir", str(folder / f"checkpoints{repeat}"))]
        torchrun(2, [DRIVER, *jobs[1:]], timeout=1800)
        load = os.getloadavg()[0]
        rows = []
        def step_s(folder: Path) -> float:
            return min(json.loads((folder / f"run{r}" / "summary.json").read_text())["measured_step_time_s"]
                       for r in (1, 2))

        def predicted_s(folder: Path) -> float:  # the plan's price (Note [compiled regions priced])
            return json.loads((folder / "run1" / "summary.json").read_text())["predicted_step_time_s"]

        for case in dict.fromkeys(case for case, _ in folders):
            row = {"case": case, "eager_step_s": step_s(folders[(case, "eager")]), "compiled_step_s": None,
                   "eager_predicted_s": predicted_s(folders[(case, "eager")]), "compiled_predicted_s": None,
                   "compile_s": None, "graph_breaks": None, "refused": refusals.get(case)}
            if (case, "compiled") in folders:
                compiled = folders[(case, "compiled")]
                row["compiled_step_s"], row["compiled_predicted_s"] = step_s(compiled), predicted_s(compiled)
                # the first run's warm-up: a cold inductor cache compiles, a warm one mostly loads
                times = json.loads((compiled / "run1" / "stage_times_rank_0.json").read_text())
                row["compile_s"], row["graph_breaks"] = times.get("compile_s"), times.get("graph_breaks")
            rows.append(row)
    print(f"{'plan (2 CPU ranks, batch 8, 2 microbatches)':<44} {'eager ms':>9} {'compiled ms':>12} "
          f"{'eager/compiled':>15} {'compile s':>10} {'graph breaks':>13}")
    for r in rows:
        if r["compiled_step_s"] is None:
            print(f"{r['case']:<44} {r['eager_step_s'] * 1e3:>9.1f}   compiled refused: {r['refused']}")
            continue
        ratio = r["eager_step_s"] / r["compiled_step_s"]
        verdict = f"{ratio:.2f}x" + ("" if ratio >= 1 else " (slowdown)")
        print(f"{r['case']:<44} {r['eager_step_s'] * 1e3:>9.1f} {r['compiled_step_s'] * 1e3:>12.1f} "
              f"{verdict:>15} {r['compile_s'] or 0:>10.1f} {r['graph_breaks']!s:>13}")
    print(f"load average {load:.1f} on {os.cpu_count()} cores; {args.steps} steps per run, two runs each: the lower "
          "median after the first step")
    print(f"predicted (the plan's price, by the {'machine profile' if args.priced_by == 'machine' else 'cpu preset'}"
          ") against measured, ms:")
    for r in rows:
        if r["compiled_step_s"] is not None:
            print(f"  {r['case']:<42} eager {r['eager_predicted_s'] * 1e3:.1f} -> {r['eager_step_s'] * 1e3:.1f}, "
                  f"compiled {r['compiled_predicted_s'] * 1e3:.1f} -> {r['compiled_step_s'] * 1e3:.1f}")
    for r in rows:
        if r["compiled_step_s"] is not None and r["compiled_step_s"] > r["eager_step_s"]:
            r["slowdown_cause"] = slowdown_cause(r, args.priced_by, load)
            print(f"slowdown, {r['case']}: {r['slowdown_cause']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def slowdown_cause(row: dict, priced_by: str, load: float) -> str:
    """Why compiled lost on this row: what the price saw, or that it did not see it."""
    priced = (f"priced {row['compiled_predicted_s'] * 1e3:.1f} ms compiled against {row['eager_predicted_s'] * 1e3:.1f} "
              "eager")
    if row["compiled_predicted_s"] < row["eager_predicted_s"]:
        return (f"not foreseen ({priced}): a cost outside the fit (the stage's hooks and keyed draws around "
                f"its graph) or the neighbours' load (load average {load:.1f})")
    if priced_by != "machine":
        return f"foreseen by the cpu preset ({priced})"
    from partitioner.calibrate.machine import MachineKey, load_cached

    profile, _why = load_cached(MachineKey.here())  # the one that priced the plans, not measured again
    eager, compiled = (profile.measured, profile.compiled) if profile is not None else (None, None)
    if compiled is None:
        return f"foreseen ({priced}), by the eager fit"
    compiled_rate, eager_rate = 1e-9 / compiled.forward.s_per_matmul_flop, 1e-9 / eager.forward.s_per_matmul_flop
    slower = ("its slower matmuls" if compiled_rate < eager_rate else "its per-call costs, though its matmuls are not slower")
    return (f"foreseen ({priced}): this machine's compiled fit runs matmuls at {compiled_rate:.0f} GFLOP/s "
            f"forward against eager {eager_rate:.0f}; {slower} outweigh the per-op saving "
            f"({compiled.forward.op_overhead_s * 1e6:.0f}/{compiled.backward.op_overhead_s * 1e6:.0f} us against "
            f"{eager.forward.op_overhead_s * 1e6:.0f}/{eager.backward.op_overhead_s * 1e6:.0f} us, forward/backward)")


if __name__ == "__main__":
    main()
