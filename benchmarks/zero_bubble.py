"""Zero-bubble schedules, predicted and measured, side by side: 1f1b vs zb vs zbv on this machine,
and the bubble of a 1,024-GPU plan at scale (Note [zero-bubble pricing] in
partitioner/solver/zero_bubble.py).

    .venv/bin/python benchmarks/zero_bubble.py [--steps 8] [--rounds 2] [--scale] [--scale-only]

Here: the demo GPT (4 layers, width 128, seq 64) on 2 CPU ranks, global batch 16, 8 microbatches:
1f1b over 2 stages, zb over 4 stages (2 per rank, s % 2), zbv over 4 stages (a V), each compiled
with this machine's profile (what `partitioner compile` prices with) and trained under torchrun
(one thread per rank, no checkpoints) for --steps steps; the run's summary.json gives the median
step after the first; the fastest of --rounds rounds counts (other work on a shared machine only
adds time). Printed per schedule: predicted step, measured step, their ratio, the predicted
pipeline bubble, and "order": the pipeline alone (no all-reduce or other step terms) as torch's own
action order runs over each stage's own F, B and W time (the HTML timeline's makespan,
``partitioner.inspect.timeline``), where the price raises every stage to the worst stage's (Note
[zero-bubble pricing]).

--scale: Megatron-LM's 76.1B row (arXiv 2104.04473 Table 1: 1,024 A100s, tp 8 x pp 4 x dp 32,
global batch 1792; benchmarks/published_runs.py) compiled at the paper's tp and dp under 1f1b (4
stages) and zbv (8 stages, 2 per pipeline rank), with the predicted bubble and step of each: the
bubble the zero-bubble schedules remove at scale.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _torchrun import torchrun  # noqa: E402

GLOBAL_BATCH, MICROBATCHES, RANKS = 16, 8, 2
# (schedule, stages)
PLANS = [("1f1b", 2), ("zb", 4), ("zbv", 4)]


def compile_here(root: Path) -> list[dict]:
    from partitioner import compile as compile_plan
    from partitioner.config.cluster import ClusterSpec
    from partitioner.inspect.timeline import timeline
    from partitioner.models.builtin import gpt

    workload = gpt(layers=4, width=128, heads=4, vocab=512, seq=64)
    out = []
    for schedule, stages in PLANS:
        plan = compile_plan(workload, cluster=ClusterSpec.homogeneous(RANKS, "cpu"), global_batch=GLOBAL_BATCH,
                            num_stages=stages, dp=1, microbatches=MICROBATCHES, schedule=schedule)
        folder = root / schedule
        plan.save(folder)
        out.append({"schedule": schedule, "stages": stages, "folder": str(folder),
                    "predicted_s": plan.predicted["step_time_s"], "bubble": plan.predicted["bubble_fraction"],
                    "order_s": timeline(plan.plan)["makespan_s"], "measured_s": []})
        print(f"  compiled {schedule}: {stages} stages, predicted {plan.predicted['step_time_s'] * 1e3:.1f} ms", flush=True)
    return out


def measure(plans: list[dict], *, steps: int, rounds: int) -> None:
    for r in range(rounds):
        for entry in plans:
            run_dir = os.path.join(entry["folder"], "run")
            shutil.rmtree(run_dir, ignore_errors=True)
            torchrun(RANKS, [os.path.join(entry["folder"], "train.py"), "--steps", str(steps), "--no-checkpoint",
                             "--quiet"])
            summary = json.loads(Path(run_dir, "summary.json").read_text())
            entry["measured_s"].append(summary["measured_step_time_s"])
            print(f"  round {r + 1}: {entry['schedule']:5} {summary['measured_step_time_s'] * 1e3:8.1f} ms/step "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)


def scale_rows(time_limit_s: float) -> list[dict]:
    from published_runs import ROWS, cluster_of, workload_of

    from partitioner import compile as compile_plan
    from partitioner.inspect.timeline import timeline
    from partitioner.solver import SolverConfig

    row = next(r for r in ROWS if r[0] == "76.1B")
    name, _heads, _hidden, _layers, tp, pp, gpus, batch, _ = row
    out = []
    for schedule, stages in (("1f1b", pp), ("zbv", 2 * pp)):
        compiled = compile_plan(workload_of(row), cluster=cluster_of(gpus), global_batch=batch, precision="fp16-mixed",
                                num_stages=stages, dp=gpus // (tp * pp), tensor_parallel=tp, schedule=schedule,
                                solver_config=SolverConfig(time_limit_s=time_limit_s))
        p = compiled.plan.predicted
        out.append({"schedule": schedule, "stages": stages, "microbatches": compiled.plan.num_microbatches,
                    "step_s": p["step_time_s"], "bubble": p["bubble_fraction"],
                    "order_s": timeline(compiled.plan)["makespan_s"]})
        print(f"  compiled {name} {schedule}", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scale", action="store_true", help="also the 76.1B, 1,024-GPU row's bubble")
    parser.add_argument("--scale-only", action="store_true", help="only the 1,024-GPU row")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per --scale compile")
    args = parser.parse_args(argv)
    if not args.scale_only:
        with tempfile.TemporaryDirectory(prefix="zero_bubble_") as tmp:
            plans = compile_here(Path(tmp))
            measure(plans, steps=args.steps, rounds=args.rounds)
        print(f"\nthis machine: demo GPT on {RANKS} CPU ranks, global batch {GLOBAL_BATCH}, {MICROBATCHES} microbatches "
              f"(fastest of {args.rounds} rounds of {args.steps} steps)")
        print(f"{'schedule':>8} {'stages':>6} {'predicted':>10} {'measured':>10} {'ratio':>6} {'bubble':>7} {'order':>9}")
        for e in plans:
            measured = min(e["measured_s"])
            print(f"{e['schedule']:>8} {e['stages']:>6} {e['predicted_s'] * 1e3:8.1f}ms {measured * 1e3:8.1f}ms "
                  f"{e['predicted_s'] / measured:6.2f} {e['bubble'] * 100:6.1f}% {e['order_s'] * 1e3:7.1f}ms")
    if args.scale or args.scale_only:
        rows = scale_rows(args.time_limit)
        print("\nat scale: Megatron-LM 76.1B (Table 1), 1,024 a100-80gb, tp 8 x 4 pipeline ranks x dp 32, "
              "global batch 1792, fp16-mixed (predicted)")
        print(f"{'schedule':>8} {'stages':>6} {'microbatches':>12} {'step':>9} {'bubble':>7} {'order':>8}")
        for r in rows:
            print(f"{r['schedule']:>8} {r['stages']:>6} {r['microbatches']:>12} {r['step_s']:8.3f}s "
                  f"{r['bubble'] * 100:6.1f}% {r['order_s']:7.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
