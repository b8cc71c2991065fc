"""Predicted step time of our plan next to the uniform and parameter-balanced splits and the
lower bound, on synthetic GPT-like problems (formulas in gpt_like.py).

    .venv/bin/python benchmarks/partition_quality.py [--time-limit 10]

Every figure comes from the same float cost model (partitioner.solver.check.evaluate) at the
same stages, dp, microbatches and schedule (1F1B); baselines place stage s on the devices in
cluster order (what a hand-written torchrun launch does) and never recompute. Lower bound:
(m - 1) * B_fluid + W, which is (m + p - 1) * W / p on identical devices.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_like import gpt2_small, gpt_like_problem, llama_like  # noqa: E402

from partitioner.cluster import ClusterSpec  # noqa: E402
from partitioner.solver import SolverConfig, evaluate_baselines, place_stages, solve  # noqa: E402


def scenarios():
    yield ("GPT-2 small (124M, V=50257), 4 x A100-40GB", gpt2_small(), ClusterSpec.homogeneous(4, "a100-40gb"),
           dict(num_stages=4, dp=1, microbatches=16, global_batch=16))
    yield ("Llama-like 7B (32 layers, s=4096), 8 x H100", llama_like(), ClusterSpec.homogeneous(8, "h100"),
           dict(num_stages=8, dp=1, microbatches=32, global_batch=32))
    yield ("Llama-like 7B, 16 x H100 (2 nodes), solver picks stages x dp", llama_like(),
           ClusterSpec.homogeneous(16, "h100"), dict(global_batch=64, microbatches=None, num_stages=None, dp=None))
    hetero = ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 4, "node": 0},
                                              {"kind": "a100-40gb", "count": 4, "node": 1}]})
    yield ("GPT-like 2.7B (32 layers, h=2560, s=2048), 4 x H100 + 4 x A100-40GB",
           gpt_like_problem(layers=32, width=2560, heads=32, seq=2048, vocab=50257), hetero,
           dict(num_stages=8, dp=1, microbatches=32, global_batch=32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    config = SolverConfig(time_limit_s=args.time_limit, max_microbatches=64)
    header = (f"{'ours_s':>9} {'uniform_s':>10} {'param_bal_s':>11} {'lower_s':>9} "
              f"{'uni/ours':>8} {'par/ours':>8} {'ours/lb':>7}")
    for title, problem, cluster, kwargs in scenarios():
        global_batch = kwargs.pop("global_batch")
        solution = solve(problem, cluster, global_batch, config=config, **kwargs)
        placement = place_stages(cluster, solution.num_stages, solution.dp)
        baselines = evaluate_baselines(problem, cluster, num_stages=solution.num_stages, dp=solution.dp,
                                       num_microbatches=solution.num_microbatches,
                                       microbatch_size=solution.microbatch_size, schedule=solution.schedule,
                                       placement=placement)
        print(f"\n{title}: {problem.num_regions} regions -> {solution.num_stages} stages x dp {solution.dp}, "
              f"{solution.num_microbatches} microbatches of {solution.microbatch_size}, solver {solution.status} "
              f"in {solution.solve_time_s:.2f} s ({len(solution.candidates)} candidates), "
              f"{sum(solution.recompute)} regions recompute")
        print(header)

        def cell(name, width):
            base = baselines.get(name)
            if base is None:
                return f"{'-':>{width}}", "-"
            text = f"{base.step_time_s:.4f}{'' if base.fits_memory else '*'}"
            return f"{text:>{width}}", f"{base.step_time_s / solution.step_time_s:.3f}"

        uniform, uniform_ratio = cell("uniform", 10)
        balanced, balanced_ratio = cell("param_balanced", 11)
        print(f"{solution.step_time_s:>9.4f} {uniform} {balanced} {solution.lower_bound_step_time_s:>9.4f} "
              f"{uniform_ratio:>8} {balanced_ratio:>8} {solution.step_time_s / solution.lower_bound_step_time_s:>7.3f}")
    print("\n* = the baseline does not fit in memory (its time is shown anyway); ratios > 1 mean ours is faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
