"""Predicted step time of our plan next to the uniform and parameter-balanced splits and the
lower bound, on synthetic GPT-like problems (formulas in gpt_like.py).

    .venv/bin/python benchmarks/partition_quality.py [--time-limit 10]

Every figure comes from the same float cost model (partitioner.solver.evaluate.evaluate), 1F1B.
Each baseline is priced at its own best (stages, dp, microbatches, recompute) among the
configurations the row allows (Note [fair baselines] in partitioner/solver/fair_baselines.py):
devices in cluster order, on mixed classes the fastest class first, and "uniform" there gives each
stage blocks in proportion to its device's speed; a baseline that fits no configuration shows
"no-fit" and no ratio. Lower bound: the smallest over every allowed candidate of perfectly
divisible work on the fastest devices + memory-forced recompute + the data-parallel all-reduce
(Note [whole-space lower bound] in partitioner/solver/solve.py); it leaves out communication
beyond latencies, which every plan pays. The two heterogeneous rows are two nodes (H100s on
node 0, A100s on node 1): our plan is searched over every placement of stages on devices (Note
[exact placements]), its status says whether that search was proven.

The interleaved rows (``--interleaved-only`` prints just them) put 1F1B over the devices next to
interleaved 1F1B at v = 2 and 4 stages per rank on the same model, cluster and microbatches (Note
[interleaved pricing] in partitioner/solver/interleaved.py), sublayer granularity: the step time the
solver prices (the worst stage's forward and backward at every stage: never below torch's order),
the step time with the pipeline replaced by torch's own order simulated over the plan's stage
times (runtime/schedule.py timed_actions), and whether it fits memory.

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
from partitioner.errors import PartitionInfeasibleError  # noqa: E402
from partitioner.solver import SolverConfig, evaluate, solve  # noqa: E402
from runtime.schedule import timed_actions  # noqa: E402


def scenarios(granularity: str):
    yield ("GPT-2 small (124M, V=50257), 2 x A100-40GB", gpt2_small(granularity),
           ClusterSpec.homogeneous(2, "a100-40gb"), dict(num_stages=2, dp=1, microbatches=16, global_batch=16))
    yield ("GPT-2 small, 4 x A100-40GB (the head alone > W/p)", gpt2_small(granularity),
           ClusterSpec.homogeneous(4, "a100-40gb"), dict(num_stages=4, dp=1, microbatches=16, global_batch=16))
    yield ("Llama-like 7B (32 layers, s=4096), 8 x H100", llama_like(granularity), ClusterSpec.homogeneous(8, "h100"),
           dict(num_stages=8, dp=1, microbatches=32, global_batch=32))
    yield ("Llama-like 7B, 16 x H100 (2 nodes), solver picks stages x dp", llama_like(granularity),
           ClusterSpec.homogeneous(16, "h100"), dict(global_batch=64, microbatches=None, num_stages=None, dp=None))
    two_by_two = ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 2, "node": 0},
                                                  {"kind": "a100-40gb", "count": 2, "node": 1}]})
    yield ("GPT-2 small, 2 x H100 (node 0) + 2 x A100-40GB (node 1), 4 stages",
           gpt2_small(granularity), two_by_two, dict(num_stages=4, dp=1, microbatches=16, global_batch=16))
    hetero = ClusterSpec.from_dict({"group": [{"kind": "h100", "count": 4, "node": 0},
                                              {"kind": "a100-40gb", "count": 4, "node": 1}]})
    yield ("GPT-like 2.7B (32 layers, h=2560, s=2048), 4 x H100 (node 0) + 4 x A100-40GB (node 1)",
           gpt_like_problem(layers=32, width=2560, heads=32, seq=2048, vocab=50257, granularity=granularity), hetero,
           dict(num_stages=8, dp=1, microbatches=32, global_batch=32))


def interleaved_scenarios():
    yield "GPT-2 small, 4 x A100-40GB, 16 microbatches", gpt2_small("fine"), ClusterSpec.homogeneous(4, "a100-40gb"), 16
    yield "Llama-like 7B, 8 x H100, 32 microbatches", llama_like("fine"), ClusterSpec.homogeneous(8, "h100"), 32
    yield "Llama-like 7B, 8 x H100, 8 microbatches", llama_like("fine"), ClusterSpec.homogeneous(8, "h100"), 8


def torch_order_step_s(problem, cluster, solution) -> float:
    """The plan's step time with its pipeline term replaced by torch's order over its stage times."""
    cost = evaluate(problem, cluster, solution.assignment)
    fwd = [st.forward_s for st in cost.stages]
    bwd = [st.time_s - st.forward_s for st in cost.stages]
    actions = timed_actions("interleaved", solution.assignment.pipeline_ranks, solution.num_stages,
                            solution.num_microbatches, lambda kind, s: fwd[s] if kind == "F" else bwd[s])
    return cost.step_time_s - cost.pipeline_s + max(end for *_, end in actions)


def interleaved_rows(time_limit_s: float) -> None:
    print("\ninterleaved 1F1B vs 1F1B (dp 1, pipeline over every device, sublayer granularity)")
    print(f"{'':52} {'1f1b_s':>8} {'v':>2} {'inter_s':>8} {'torch_s':>8} {'1f1b/int':>8} {'status':>9} fits")
    for title, problem, cluster, m in interleaved_scenarios():
        ranks = cluster.num_devices
        one = solve(problem, cluster, m, num_stages=ranks, dp=1, microbatches=m,
                    config=SolverConfig(time_limit_s=time_limit_s))
        for v in (2, 4):
            config = SolverConfig(time_limit_s=time_limit_s, local_stages=v)
            try:
                sol = solve(problem, cluster, m, num_stages=ranks * v, dp=1, microbatches=m, schedule="interleaved",
                            config=config)
            except PartitionInfeasibleError:
                print(f"{title:52} {one.step_time_s:>8.4f} {v:>2} {'no-fit':>8} {'-':>8} {'-':>8} {'-':>9} no")
                continue
            print(f"{title:52} {one.step_time_s:>8.4f} {v:>2} {sol.step_time_s:>8.4f} "
                  f"{torch_order_step_s(problem, cluster, sol):>8.4f} {one.step_time_s / sol.step_time_s:>8.3f} "
                  f"{sol.status:>9} yes")
            title = ""
    print("1f1b/int > 1: interleaved predicted faster; torch_s: the same plan with torch's order simulated "
          "over its stage times (what the worst-stage price bounds)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--interleaved-only", action="store_true", help="print only the interleaved rows")
    args = parser.parse_args()
    if args.interleaved_only:
        interleaved_rows(args.time_limit)
        return 0
    config = SolverConfig(time_limit_s=args.time_limit, max_microbatches=64)
    header = (f"{'ours_s':>9} {'sublayer_s':>10} {'uniform_s':>10} {'param_bal_s':>11} {'lower_s':>9} "
              f"{'uni/ours':>8} {'par/ours':>8} {'ours/lb':>7} {'sub/lb':>7}")
    for (title, problem, cluster, kwargs), (_, coarse, _, coarse_kwargs) in zip(scenarios("op"), scenarios("fine")):
        global_batch = kwargs.pop("global_batch")
        solution = solve(problem, cluster, global_batch, config=config, **kwargs)
        # The same request at sublayer granularity (attention and MLP as whole regions).
        coarse_kwargs.pop("global_batch")
        sublayer = solve(coarse, cluster, global_batch, config=config, **coarse_kwargs)
        baselines = solution.baseline_details  # each at its own best (Note [fair baselines])
        print(f"\n{title}: {problem.num_regions} regions (op granularity) -> {solution.num_stages} stages x dp "
              f"{solution.dp}, {solution.num_microbatches} microbatches of {solution.microbatch_size}, solver "
              f"{solution.status} in {solution.solve_time_s:.2f} s ({len(solution.candidates)} candidates, gap "
              f"{1 - solution.bound / solution.objective:.1%}), {sum(solution.recompute)} regions recompute; "
              f"sublayer granularity: {coarse.num_regions} regions -> {sublayer.num_stages} x dp {sublayer.dp}, "
              f"{sublayer.status}")
        for name, base in baselines.items():
            print(f"  {name}: its best is {base.num_stages} stages x dp {base.dp}, {base.num_microbatches} "
                  f"microbatches{', recompute' if base.recompute else ''}"
                  f"{'' if base.fits_memory else ' (fits no configuration)'}")
        print(header)

        def cell(name, width):
            base = baselines.get(name)
            if base is None:
                return f"{'-':>{width}}", "-"
            if not base.fits_memory:
                return f"{'no-fit':>{width}}", "-"
            return f"{base.step_time_s:>{width}.4f}", f"{base.step_time_s / solution.step_time_s:.3f}"

        uniform, uniform_ratio = cell("uniform", 10)
        balanced, balanced_ratio = cell("param_balanced", 11)
        lower = solution.lower_bound_step_time_s
        print(f"{solution.step_time_s:>9.4f} {sublayer.step_time_s:>10.4f} {uniform} {balanced} {lower:>9.4f} "
              f"{uniform_ratio:>8} {balanced_ratio:>8} {solution.step_time_s / lower:>7.3f} "
              f"{sublayer.step_time_s / sublayer.lower_bound_step_time_s:>7.3f}")
    print("\nratios > 1 mean ours is faster; no-fit = the baseline fits memory in no allowed configuration;"
          "\nsub/lb: the sublayer plan against its own lower bound (the same space, so the same bound)")
    interleaved_rows(args.time_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
