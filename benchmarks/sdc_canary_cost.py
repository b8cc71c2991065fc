"""What compute canaries cost a step (Note [compute canaries] in runtime/resilience/canary.py),
measured beside the plan's price (Note [canary price] in partitioner/solver/canary_cost.py).

A compiled GPT (dropout on) on 2 stages x dp 2 (4 ranks, gloo) and on 1 stage x dp 2, each
trained with canaries off and with --sdc-canary-every K in one launch (the same workers, so the
same warm-up); per layout one table row: the median step time without and with canaries, the
measured canary seconds per step (two ways: the step-time difference of the means, and each
rank's own canary seconds from RUN_DIR/canary_stats_rank_<r>.json, slowest rank, over K) and the
plan's predicted ``sdc_canary_s_per_step`` with the re-run seconds it expects the bubbles to
absorb (``sdc_canary_bubble_s``).

    python benchmarks/sdc_canary_cost.py [--steps 24] [--every 4] [--layers 2] [--width 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun import DRIVER  # noqa: E402
from _torchrun import rows as _rows  # noqa: E402
from _torchrun import torchrun as _torchrun  # noqa: E402


def _step_times(run_dir: str) -> list[float]:
    return [r["step_time_s"] for r in _rows(os.path.join(run_dir, "metrics.jsonl"))][1:]  # the first warms up


def _canary_s(run_dir: str, world: int) -> float:
    """The slowest rank's mean seconds per canary (the step waits for it)."""
    means = []
    for r in range(world):
        with open(os.path.join(run_dir, f"canary_stats_rank_{r}.json")) as f:
            seconds = json.load(f)["seconds"]
        means.append(statistics.mean(seconds) if seconds else 0.0)
    return max(means)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--workdir", help="default: a fresh temporary folder")
    args = parser.parse_args()

    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import gpt
    from partitioner.solver.plan import Plan
    from runtime.features.canaries import EVERY as CANARY

    root = args.workdir or tempfile.mkdtemp(prefix="sdc_canary_cost_")
    model = gpt(layers=args.layers, width=args.width, heads=4, vocab=256, seq=32, dropout=0.1)
    layouts = {"2 stages x dp 2": (4, 2), "1 stage x dp 2": (2, 1)}
    print(f"model: gpt layers={args.layers} width={args.width}, {args.steps} steps a run, canary every "
          f"{args.every} steps, gloo on {os.cpu_count()} cores")
    print(f"{'layout':<16} {'step off s':>10} {'step on s':>10} {'measured s/step':>16} {'own s/step':>11} "
          f"{'predicted s/step':>17} {'bubble s':>9}")
    for name, (world, stages) in layouts.items():
        folders = {}
        for tag, every in (("off", 0), ("on", args.every)):
            folders[tag] = os.path.join(root, f"{world}_{tag}")
            partitioner.compile(model, cluster=ClusterSpec.homogeneous(world, "cpu"), global_batch=8,
                                num_stages=stages, dp=2, microbatches=2,
                                training={"sdc_every": 0, CANARY.key: every}).save(folders[tag])
        job = []
        for tag, folder in folders.items():
            job += [folder, "--steps", str(args.steps), "--run-dir", f"{root}/run_{world}_{tag}",
                    "--checkpoint-dir", f"{root}/ck_{world}_{tag}", "--checkpoint-every", "0", "--quiet", "--"]
        _torchrun(world, [DRIVER, *job[:-1]])
        off, on = _step_times(f"{root}/run_{world}_off"), _step_times(f"{root}/run_{world}_on")
        measured = statistics.mean(on) - statistics.mean(off)
        own = _canary_s(f"{root}/run_{world}_on", world) / args.every
        predicted = Plan.load(folders["on"]).predicted
        print(f"{name:<16} {statistics.median(off):>10.4f} {statistics.median(on):>10.4f} {measured:>16.5f} "
              f"{own:>11.5f} {predicted['sdc_canary_s_per_step']:>17.6f} {predicted['sdc_canary_bubble_s']:>9.6f}")
    print("measured: mean step with canaries - mean step without; own: the slowest rank's canary seconds / K")
    return 0


if __name__ == "__main__":
    sys.exit(main())
