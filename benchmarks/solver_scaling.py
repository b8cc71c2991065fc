"""Solve time and optimality gap of the partition ILP on GPT-like chains.

    .venv/bin/python benchmarks/solver_scaling.py [--time-limit 10] [--workers 2]

Fine granularity (embedding, then attention and MLP of every layer as separate regions, then
the head): 2L + 2 regions. Width 4096, 32 heads, sequence 2048, vocabulary 50257 (formulas in
gpt_like.py), on 16 H100 (two nodes of 8), one pipeline (dp = 1), 32 microbatches of 1 sequence,
1F1B. Memory binds for the deep models, so recompute variables are in play. Target: 96 layers
on 16 stages proven optimal in under 10 s on two cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_like import gpt_like_problem  # noqa: E402

from partitioner.config.cluster import ClusterSpec  # noqa: E402
from partitioner.solver import SolverConfig, solve_candidate  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="*", default=[12, 24, 48, 96])
    parser.add_argument("--stages", type=int, nargs="*", default=[4, 8, 16])
    args = parser.parse_args()
    config = SolverConfig(time_limit_s=args.time_limit, num_workers=args.workers)
    cluster = ClusterSpec.homogeneous(16, "h100")
    microbatches = 32
    print(f"{'layers':>6} {'regions':>7} {'stages':>6} {'status':>9} {'solve_s':>8} {'gap':>8} "
          f"{'recompute':>9} {'step_s':>9} {'uniform_s':>9} {'lower_s':>9}")
    for layers in args.layers:
        problem = gpt_like_problem(layers=layers, width=4096, heads=32, seq=2048, vocab=50257)
        for stages in args.stages:
            start = time.perf_counter()
            solution, status, _ = solve_candidate(problem, cluster, num_stages=stages, dp=1,
                                                  num_microbatches=microbatches, global_batch=microbatches,
                                                  config=config)
            wall = time.perf_counter() - start
            if solution is None:
                print(f"{layers:>6} {problem.num_regions:>7} {stages:>6} {status:>9} {wall:>8.2f}")
                continue
            from partitioner.solver import evaluate_baselines

            uniform = evaluate_baselines(problem, cluster, num_stages=stages, dp=1, num_microbatches=microbatches,
                                         microbatch_size=1, schedule="1f1b",
                                         placement=solution.device_of_stage_replica).get("uniform")
            gap = (solution.objective - solution.bound) / solution.objective
            uniform_s = f"{uniform.step_time_s:.4f}{'' if uniform.fits_memory else '*'}" if uniform else "-"
            print(f"{layers:>6} {problem.num_regions:>7} {stages:>6} {status:>9} {wall:>8.2f} {gap:>8.2%} "
                  f"{sum(solution.recompute):>9} {solution.step_time_s:>9.4f} {uniform_s:>9} "
                  f"{solution.lower_bound_step_time_s:>9.4f}")
    print("solve_s: wall time of one candidate (model build + hint + CP-SAT + check); "
          "* = the baseline does not fit memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
