"""The cost model against published GPU runs: Megatron-LM PTD-P's GPT table (Narayanan et al.,
SC'21, arXiv 2104.04473, Table 1), each row pinned to the paper's layout, then solved freely.

    .venv/bin/python benchmarks/published_runs.py [--rows 1.7B,3.6B] [--free] [--korthikanti] [--time-limit 60]

The paper trains GPT models (vocabulary 51,200, sequence 2048) in fp16 on DGX A100 80GB nodes
(8 GPUs on NVLink/NVSwitch, 8 x 200 Gb/s InfiniBand per node) and reports teraFLOP/s per GPU,
counting model FLOPs per iteration as 96 B s l h^2 (1 + s/6h + V/16lh) (their Appendix: with
activation recomputation, one more forward). The measured step is that count / (TFLOP/s x GPUs).

What we compile is our built-in GPT at the row's shape, like for like where we can make it so:
- ``attn=eager``: attention with the scores written out (Megatron in 2021 had no flash attention;
  its fused scale-mask-softmax kernel still read and wrote the scores in HBM), attention and
  hidden dropout 0.1 as in their scripts, fp16-mixed, learned positions, untied head (theirs is
  tied: the head's FLOPs are the same);
- the paper's tp, pp, dp and global batch pinned (``--tp --stages --dp``); the microbatch count
  is the solver's, and what to recompute is the solver's in "predicted" and pinned to every
  region in "full recompute" (``--recompute full``, Note [recompute a user pins] in
  partitioner/solver/recompute_cost.py: the paper recomputed every layer, and its measured time
  includes that forward: that column is the like-for-like one);
- the cluster: 8 a100-80gb per node, NVLink 300 GB/s (the issue's figure; NCCL's all-reduce bus
  bandwidth on DGX A100 is about 230 GB/s), 25 GB/s per GPU between nodes (one 200 Gb/s NIC each).
Not like for like: our schedule is torch's 1F1B (the paper's larger rows ran its interleaved
schedule), our kernels are torch eager's (theirs fused bias+GeLU and softmax), our optimizer is
AdamW in fp32 without their fused fp16 master-weight kernels, and our memory model charges fp32
activations under autocast (conservative).

Printed per row: measured step, predicted step and their ratio (the target: within 15%), the
step of the program compiled with ``--recompute full`` and its ratio, the predicted breakdown
(compute incl. recompute, tensor-parallel collectives inside it, the pipeline's bubble, the
data-parallel all-reduce, the rest) of the solver's plan, and whether it fits. ``--free``
then lets the solver choose tp x pp x dp, microbatches and recompute on the row's GPUs and prints
its layout and predicted step next to the paper's.
"""

from __future__ import annotations

import argparse
import sys
import time

GIB = 2**30
VOCAB, SEQ = 51200, 2048

# (name, heads, hidden, layers, tp, pp, gpus, global batch, measured TFLOP/s per GPU) - Table 1
ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
]


# Korthikanti et al. 2022 (arXiv 2205.05198), Table 3: their layouts (sequence 2048, microbatch 1, 80 GB
# A100s), which we compile pinned with --recompute full (their baseline) to see whether they fit:
# (name, heads, hidden, layers, tp, pp, gpus, global batch)
KORTHIKANTI_ROWS = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4),
    ("175B", 96, 12288, 96, 8, 8, 64, 64),
    ("530B", 128, 20480, 105, 8, 35, 280, 280),
    ("1T", 160, 25600, 128, 8, 64, 512, 512),
]


def model_flops_per_iteration(batch: int, layers: int, hidden: int) -> float:
    """The paper's count (with recomputation): 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def measured_step_s(row) -> float:
    _, _, hidden, layers, _, _, gpus, batch, tflops = row
    return model_flops_per_iteration(batch, layers, hidden) / (tflops * 1e12 * gpus)


def cluster_of(gpus: int):
    from partitioner.config.cluster import ClusterSpec

    return ClusterSpec.from_dict({
        "group": [{"kind": "a100-80gb", "count": gpus, "devices_per_node": 8}],
        "links": {"intra_node": {"bandwidth_gbytes_per_s": 300, "latency_s": 5e-6},
                  "inter_node": {"bandwidth_gbytes_per_s": 25, "latency_s": 1e-5}}})


def workload_of(row):
    from partitioner.models.builtin import gpt

    _, heads, hidden, layers, *_ = row
    return gpt(layers=layers, width=hidden, heads=heads, vocab=VOCAB, seq=SEQ, dropout=0.1, attn="eager",
               batch=1, device="meta")


def breakdown(compiled):
    """The predicted step's terms (seconds) re-evaluated from the plan's own problem and layout."""
    from partitioner.solver.evaluate import evaluate
    from partitioner.solver.precision_cost import cluster_for_precision
    from partitioner.frontend.tp_support import grouped

    plan = compiled.plan
    cluster = grouped(cluster_for_precision(cluster_of(plan.world_size), plan.decisions.precision), plan.tensor_parallel)
    cost = evaluate(compiled.problem, cluster, compiled.assignment,
                    sdc_every=plan.decisions.sdc_every, global_norm=True)
    a = compiled.assignment
    slowest = max(cost.stages, key=lambda s: s.time_s)
    return {
        "pipeline_s": cost.pipeline_s,
        "compute_s": a.num_microbatches * slowest.compute_s,
        "bubble_s": cost.pipeline_s - a.num_microbatches * slowest.time_s,
        "dp_allreduce_s": cost.dp_allreduce_s,
        "rest_s": cost.step_time_s - cost.pipeline_s - cost.dp_allreduce_s,
        "recomputed": sum(a.recompute), "regions": len(a.recompute),
        # a tensor group is planned as one device of tp times the memory: per GPU is 1/tp of it
        "peak_gib": max(s.memory_bytes for s in cost.stages) / GIB / plan.tensor_parallel,
        "capacity_gib": min(s.capacity_bytes for s in cost.stages) / GIB / plan.tensor_parallel,
    }


def compile_row(row, *, pinned: bool, time_limit_s: float, recompute: str = "auto"):
    """The row's program as ``partitioner compile`` makes it: at the paper's layout when ``pinned``,
    with ``recompute`` as --recompute pins it (auto: the solver's choice)."""
    from partitioner import compile
    from partitioner.solver import SolverConfig

    name, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    options = dict(num_stages=pp, dp=gpus // (tp * pp), tensor_parallel=tp) if pinned else {}
    return compile(workload_of(row), cluster=cluster_of(gpus), global_batch=batch, precision="fp16-mixed",
                   solver_config=SolverConfig(time_limit_s=time_limit_s), training={"recompute": recompute},
                   **options)


def full_recompute_step_s(row, time_limit_s: float) -> float | None:
    """The paper's program, like for like: its layout and every region recomputed (--recompute
    full), the microbatches the solver's; None when that does not fit."""
    from partitioner.errors import PartitionInfeasibleError

    try:
        return compile_row(row, pinned=True, time_limit_s=time_limit_s, recompute="full").plan.predicted["step_time_s"]
    except PartitionInfeasibleError:
        return None


def korthikanti_layouts(time_limit_s: float) -> None:
    """Each Korthikanti layout at its tp x pp x dp with every layer recomputed: the predicted step and
    peak per GPU where it fits, else the refusal, which names the terms that overflow."""
    from partitioner.errors import PartitionInfeasibleError

    print("\nKorthikanti et al. 2022 (arXiv 2205.05198) Table 3 layouts, pinned, --recompute full")
    for name, heads, hidden, layers, tp, pp, gpus, batch in KORTHIKANTI_ROWS:
        row = (name, heads, hidden, layers, tp, pp, gpus, batch, 0)
        try:
            compiled = compile_row(row, pinned=True, time_limit_s=time_limit_s, recompute="full")
        except PartitionInfeasibleError as exc:
            print(f"{name:>5} tp {tp} x pp {pp} x dp {gpus // (tp * pp)}: does not fit: {str(exc).splitlines()[0]}")
            continue
        b = breakdown(compiled)
        print(f"{name:>5} tp {tp} x pp {pp} x dp {gpus // (tp * pp)}: predicted step "
              f"{compiled.plan.predicted['step_time_s']:.2f}s, {compiled.assignment.num_microbatches} microbatches, "
              f"peak {b['peak_gib']:.1f} of {b['capacity_gib']:.1f} GiB per GPU", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--free", action="store_true", help="also let the solver choose the layout")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per compile")
    parser.add_argument("--korthikanti", action="store_true",
                        help="also compile Korthikanti et al. 2022's layouts (22B to 1T) with --recompute full")
    args = parser.parse_args(argv)
    from partitioner.errors import PartitionInfeasibleError

    rows = [r for r in ROWS if not args.rows or r[0] in args.rows.split(",")]
    print("Megatron-LM PTD-P, Table 1 (arXiv 2104.04473), pinned to the paper's tp x pp x dp; fp16-mixed, a100-80gb")
    print("predicted: the solver's plan at the paper's layout (its own microbatches and recompute); "
          "full recompute: compiled at that layout with --recompute full, as the paper ran (like for like)")
    print(f"{'model':>7} {'tp':>2} {'pp':>2} {'dp':>3} {'mb':>3} {'measured':>9} {'predicted':>9} {'ratio':>6}  "
          f"{'full recompute':>14} {'ratio':>6}  {'compute':>8} {'bubble':>7} {'dp a-r':>7} {'rest':>6} {'recomp':>7} "
          f"{'GiB/GPU peak/cap':>16}  compile")
    ratios, like_for_like = [], []
    for row in rows:
        name, _, _, _, tp, pp, gpus, _, _ = row
        started = time.perf_counter()
        measured = measured_step_s(row)
        try:
            compiled = compile_row(row, pinned=True, time_limit_s=args.time_limit)
        except PartitionInfeasibleError as exc:
            print(f"{name:>7} {tp:>2} {pp:>2} {gpus // (tp * pp):>3} {'':>3} {measured:>8.2f}s  does not fit: "
                  f"{str(exc).splitlines()[0][:100]}")
            continue
        b = breakdown(compiled)
        predicted = compiled.plan.predicted["step_time_s"]
        ratios.append((name, predicted / measured))
        full = full_recompute_step_s(row, args.time_limit)
        if full is not None:
            like_for_like.append((name, full / measured))
        full_text = f"{full:>13.2f}s {full / measured:>5.2f}x" if full is not None else f"{'does not fit':>21}"
        print(f"{name:>7} {tp:>2} {pp:>2} {compiled.plan.dp:>3} {compiled.assignment.num_microbatches:>3} {measured:>8.2f}s "
              f"{predicted:>8.2f}s {predicted / measured:>5.2f}x  {full_text}  {b['compute_s']:>7.2f}s {b['bubble_s']:>6.2f}s "
              f"{b['dp_allreduce_s']:>6.2f}s {b['rest_s']:>5.2f}s {b['recomputed']:>3}/{b['regions']:<3} "
              f"{b['peak_gib']:>5.1f}/{b['capacity_gib']:<5.1f}  {time.perf_counter() - started:.0f}s",
              flush=True)
    for label, pairs in (("predicted", ratios), ("full recompute", like_for_like)):
        within = [n for n, r in pairs if abs(r - 1) <= 0.15]
        missed = [f"{n} {r:.2f}x" for n, r in pairs if abs(r - 1) > 0.15]
        print(f"{label}: within 15% of the measured step on {len(within)} of {len(rows)} rows"
              + (f"; missed: {', '.join(missed)}" if missed else ""))
    if args.korthikanti:
        korthikanti_layouts(args.time_limit)
    if args.free:
        print("\nfree solves: the solver chooses tp x pp x dp, microbatches, recompute on the row's GPUs")
        print(f"{'model':>7} {'paper tp x pp x dp':>18} {'measured':>9}  {'ours tp x pp x dp':>17} {'mb':>4} "
              f"{'predicted':>9} {'vs measured':>11}  status")
        for row in rows:
            name, _, _, _, tp, pp, gpus, _, _ = row
            measured = measured_step_s(row)
            try:
                compiled = compile_row(row, pinned=False, time_limit_s=args.time_limit)
            except PartitionInfeasibleError as exc:
                print(f"{name:>7} does not fit: {str(exc).splitlines()[0][:100]}")
                continue
            plan = compiled.plan
            predicted = plan.predicted["step_time_s"]
            ours = f"{plan.tensor_parallel} x {plan.num_stages} x {plan.dp}"
            print(f"{name:>7} {f'{tp} x {pp} x {gpus // (tp * pp)}':>18} {measured:>8.2f}s  {ours:>17} "
                  f"{compiled.assignment.num_microbatches:>4} {predicted:>8.2f}s {predicted / measured:>10.2f}x  "
                  f"{plan.solver.get('status')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
