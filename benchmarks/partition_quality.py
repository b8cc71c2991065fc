"""Predicted step time of our plan next to the uniform and parameter-balanced splits and the
lower bound, on synthetic GPT-like problems (formulas in gpt_like.py).

    .venv/bin/python benchmarks/partition_quality.py [--time-limit 10]

Every figure comes from the same float cost model (partitioner.solver.evaluate.evaluate) at the
same stages, dp, microbatches and schedule (1F1B); baselines place stage s on the devices in
cluster order (what a hand-written torchrun launch does) and never recompute. Lower bound
(bounds.lower_bound_step_time_s): perfectly divisible work, (m + p - 1) * W / p on identical
devices, balanced stages (m + p - 1) / sum_s(1 / W_s) on these heterogeneous ones; it leaves
out communication, memory (recompute) and the data-parallel all-reduce, which every plan pays.

"ours" is solved at "op" granularity (a region per matmul: passes/regions.py), the "sublayer"
column at attention/MLP granularity, to show what the finer regions buy. The baselines split
whole layers, so granularity does not change them.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_like import gpt2_small, gpt_like_problem, llama_like  # noqa: E402

from partitioner.cluster import ClusterSpec  # noqa: E402
from partitioner.solver import SolverConfig, evaluate_baselines, place_stages, solve  # noqa: E402


def scenarios(granularity: str):
    yield ("GPT-2 small (124M, V=50257), 2 x A100-40GB", gpt2_small(granularity),
           ClusterSpec.homogeneous(2, "a100-40gb"), dict(num_stages=2, dp=1, microbatches=16, global_batch=16))
    yield ("GPT-2 small, 4 x A100-40GB (the head alone > W/p)", gpt2_small(granularity),
           ClusterSpec.homogeneous(4, "a100-40gb"), dict(num_stages=4, dp=1, microbatches=16, global_batch=16))
    yield ("Llama-like 7B (32 layers, s=4096), 8 x H100", llama_like(granularity), ClusterSpec.homogeneous(8, "h100"),
           dict(num_stages=8, dp=1, microbatches=32, global_batch=32))
    yield ("Llama-like 7B, 16 x H100 (2 nodes), solver picks stages x dp", llama_like(granularity),
           ClusterSpec.homogeneous(16, "h100"), dict(global_batch=64, microbatches=None, num_stages=None, dp=None))
    hetero = ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 4, "node": 0},
                                              {"kind": "a100-40gb", "count": 4, "node": 1}]})
    yield ("GPT-like 2.7B (32 layers, h=2560, s=2048), 4 x H100 + 4 x A100-40GB",
           gpt_like_problem(layers=32, width=2560, heads=32, seq=2048, vocab=50257, granularity=granularity), hetero,
           dict(num_stages=8, dp=1, microbatches=32, global_batch=32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    config = SolverConfig(time_limit_s=args.time_limit, max_microbatches=64)
    header = (f"{'ours_s':>9} {'sublayer_s':>10} {'uniform_s':>10} {'param_bal_s':>11} {'lower_s':>9} "
              f"{'uni/ours':>8} {'par/ours':>8} {'ours/lb':>7} {'sub/lb':>7}")
    for (title, problem, cluster, kwargs), (_, coarse, _, coarse_kwargs) in zip(scenarios("op"), scenarios("fine")):
        global_batch = kwargs.pop("global_batch")
        solution = solve(problem, cluster, global_batch, config=config, **kwargs)
        # The same request at sublayer granularity (attention and MLP as whole regions).
        coarse_kwargs.pop("global_batch")
        sublayer = solve(coarse, cluster, global_batch, config=config, **coarse_kwargs)
        placement = place_stages(cluster, solution.num_stages, solution.dp)
        baselines = evaluate_baselines(problem, cluster, num_stages=solution.num_stages, dp=solution.dp,
                                       num_microbatches=solution.num_microbatches,
                                       microbatch_size=solution.microbatch_size, schedule=solution.schedule,
                                       placement=placement)
        print(f"\n{title}: {problem.num_regions} regions (op granularity) -> {solution.num_stages} stages x dp "
              f"{solution.dp}, {solution.num_microbatches} microbatches of {solution.microbatch_size}, solver "
              f"{solution.status} in {solution.solve_time_s:.2f} s ({len(solution.candidates)} candidates), "
              f"{sum(solution.recompute)} regions recompute; sublayer granularity: {coarse.num_regions} regions -> "
              f"{sublayer.num_stages} x dp {sublayer.dp}, {sublayer.status}")
        print(header)

        def cell(name, width):
            base = baselines.get(name)
            if base is None:
                return f"{'-':>{width}}", "-"
            text = f"{base.step_time_s:.4f}{'' if base.fits_memory else '*'}"
            return f"{text:>{width}}", f"{base.step_time_s / solution.step_time_s:.3f}"

        uniform, uniform_ratio = cell("uniform", 10)
        balanced, balanced_ratio = cell("param_balanced", 11)
        lower = solution.lower_bound_step_time_s
        print(f"{solution.step_time_s:>9.4f} {sublayer.step_time_s:>10.4f} {uniform} {balanced} {lower:>9.4f} "
              f"{uniform_ratio:>8} {balanced_ratio:>8} {solution.step_time_s / lower:>7.3f} "
              f"{sublayer.step_time_s / sublayer.lower_bound_step_time_s:>7.3f}")
    print("\n* = the baseline does not fit in memory (its time is shown anyway); ratios > 1 mean ours is faster;"
          "\nsub/lb: the sublayer plan against its own lower bound (the same unless the solver picked another"
          " stages x dp)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
