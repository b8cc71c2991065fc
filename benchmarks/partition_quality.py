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

The last rows are a Llama-70B-like model (compile_large.py's configuration, traced on the meta
device: its tensor-parallel figures come from passes/tp_roles.py) on 64 H100 (8 per node),
searched without and with tensor parallelism (Note [one enumeration] in partitioner/solver/space.py,
Note [tensor-parallel pricing] in partitioner/solver/tensor_groups.py), under bf16-mixed (the
H100 default) and fp32: tp x pp x dp with sharded optimizer state allowed, all of which the
runtime runs (Note [what tensor parallelism runs with]). Megatron-LM's published layout for 70B
is tp 8 within a node, pipeline across nodes.
The interleaved rows (``--interleaved-only`` prints just them) put 1F1B over the devices next to
interleaved 1F1B at v = 2 and 4 stages per rank on the same model, cluster and microbatches (Note
[interleaved pricing] in partitioner/solver/interleaved.py), sublayer granularity: the step time the
solver prices (the worst stage's forward and backward at every stage: never below torch's order),
the step time with the pipeline replaced by torch's own order simulated over the plan's stage
times (runtime/execute/schedule.py timed_actions), and whether it fits memory.

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

from partitioner.config.cluster import ClusterSpec  # noqa: E402
from partitioner.errors import PartitionInfeasibleError  # noqa: E402
from partitioner.solver import SolverConfig, evaluate, solve  # noqa: E402
from runtime.execute.schedule import timed_actions  # noqa: E402


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


def llama70b_problems():
    """{precision: (problem, cluster)} of compile_large.py's Llama-70B on 64 H100, as compile() builds them."""
    from compile_large import llama70b

    from partitioner.frontend.analysis import annotate, target_bytes_of, trace_keyed
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.compiler import _param_elem_bytes
    from partitioner.solver.precision_cost import cluster_for_precision, precision_problem

    from partitioner.calibrate.datasheet import datasheet_profiles

    workload = llama70b(4096)
    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity="block", loss_outside_graph=True)
    cluster = ClusterSpec.homogeneous(64, "h100")
    out = {}
    for precision in ("bf16-mixed", "fp32"):  # priced by the H100's roofline (Note [accelerator roofline])
        base = build_problem(gm, workload.example_batch_size, target_bytes=target_bytes_of(workload),
                             profiles=datasheet_profiles(cluster, precision))
        out[precision] = (precision_problem(base, precision, _param_elem_bytes(workload.model)),
                          cluster_for_precision(cluster, precision))
    return out


def llama70b_rows(time_limit_s: float) -> None:
    from partitioner.solver.tensor_groups import degrees_to_search

    print("\nLlama-70B-like (80 layers, h=8192, 64 heads, s=4096), 64 x H100 (8 per node), global batch 512,"
          " solver picks everything; optimizer state sharding auto")
    print(f"  {'precision':<10} {'search':<38} {'step_s':>8} {'fits':>4}  {'layout (tp x pp x dp, microbatches)':<44}"
          f" {'status':<9} {'solve_s':>7} {'candidates':>10}")
    config = SolverConfig(time_limit_s=time_limit_s)
    for precision, (problem, cluster) in llama70b_problems().items():
        degrees = degrees_to_search(cluster, lambda tp: 64 % tp == 0)  # the heads
        searches = [("pp x dp (tp 1)", dict(tp_degrees=(1,))),
                    ("tp x pp x dp", dict(tp_degrees=degrees, tp_dp=True, tp_shard=True))]
        for name, kwargs in searches:
            try:
                sol = solve(problem, cluster, 512, config=config, shard="auto", **kwargs)
            except ValueError as err:  # PartitionInfeasibleError: fits no plan
                print(f"  {precision:<10} {name:<38} {'-':>8} {'no':>4}  {str(err)[:60]}")
                continue
            layout = (f"tp {sol.tensor_parallel} x pp {sol.num_stages} x dp {sol.dp}, {sol.num_microbatches} mb"
                      f"{', sharded state' if sol.shard_optimizer else ''}{', recompute' if any(sol.recompute) else ''}")
            print(f"  {precision:<10} {name:<38} {sol.step_time_s:>8.3f} {'yes':>4}  {layout:<44} {sol.status:<9} "
                  f"{sol.solve_time_s:>7.1f} {len(sol.candidates):>10}")
    print("  Megatron-LM's published layout for 70B: tp 8 within a node x pipeline across nodes")
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
    parser.add_argument("--only-70b", action="store_true", help="only the Llama-70B tensor-parallel rows")
    parser.add_argument("--interleaved-only", action="store_true", help="print only the interleaved rows")
    args = parser.parse_args()
    if args.only_70b or args.interleaved_only:
        if args.only_70b:
            llama70b_rows(args.time_limit)
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
    llama70b_rows(args.time_limit)
    interleaved_rows(args.time_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
