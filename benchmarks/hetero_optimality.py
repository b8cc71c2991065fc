"""Is OPTIMAL a proof on heterogeneous multi-node clusters? Random chains on 2 x H100 (node 0) +
2 x A100-40GB (node 1), 4 stages, against exhaustive search over every contiguous split and
every device grid, costed by the project's ``evaluate`` (tests/_hetero_instances.py).

    .venv/bin/python benchmarks/hetero_optimality.py [--instances 15]

For each mode (exact: every placement solved, Note [exact placements]; relaxation: forced with
max_placements=1, the fastest-link class-choice model) it prints how many instances were proven
OPTIMAL, how many OPTIMAL results were not optimal (must be 0), the worst gap of the plan to the
exhaustive optimum, and the largest bound / optimum (must be <= 1, to the ILP's rounding).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _hetero_instances import exhaustive_optimum, het_cluster, random_chain  # noqa: E402

from partitioner.solver import SolverConfig, solve_candidate  # noqa: E402

M, B = 8, 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=15)
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    modes = {"exact": SolverConfig(allow_recompute=False, time_limit_s=args.time_limit),
             "relaxation": SolverConfig(allow_recompute=False, time_limit_s=args.time_limit, max_placements=1)}
    print(f"{'mode':<11} {'instances':>9} {'OPTIMAL':>7} {'wrong OPTIMAL':>13} {'worst gap':>9} "
          f"{'max bound/opt':>13} {'solve s':>8}")
    for mode, config in modes.items():
        proven = wrong = 0
        worst_gap, worst_bound, seconds, count = 0.0, 0.0, 0.0, 0
        for seed in range(args.instances):
            problem, cluster = random_chain(seed), het_cluster(memory_gib_a100=40 if seed % 3 else 12)
            optimum = exhaustive_optimum(problem, cluster, p=4, d=1, m=M, b=B)
            if math.isinf(optimum):
                continue
            start = time.perf_counter()
            solution, status, _ = solve_candidate(problem, cluster, num_stages=4, dp=1, num_microbatches=M,
                                                  global_batch=M * B, config=config)
            seconds += time.perf_counter() - start
            count += 1
            gap = solution.step_time_s / optimum - 1
            slack = solution.rounding_slack_units * solution.time_unit_s
            proven += status == "OPTIMAL"
            wrong += status == "OPTIMAL" and solution.step_time_s > optimum + slack
            worst_gap = max(worst_gap, gap)
            worst_bound = max(worst_bound, solution.bound * solution.time_unit_s / optimum)
        print(f"{mode:<11} {count:>9} {proven:>7} {wrong:>13} {worst_gap:>9.2%} {worst_bound:>13.6f} "
              f"{seconds:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
