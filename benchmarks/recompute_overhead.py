"""What a recomputed region costs one microbatch beyond plain, by checkpoint mechanism, and the
fixed term that leaves for the cost model (Note [recompute fixed cost] in
partitioner/solver/recompute_cost.py, Note [cheap checkpointing] in runtime/recompute.py).

    .venv/bin/python benchmarks/recompute_overhead.py [--repeats 60] [--rounds 5]

For each GPT of benchmarks/recompute.py, at its plan's microbatch: stage 0 of a 2-stage plan is
built twice, every block region recomputed and none, and one forward + backward of a microbatch
is timed in this process (one thread; CPU time of the thread, which a loaded machine inflates
less than wall time; median of ``--repeats``, best of ``--rounds`` interleaved rounds) under

    plain        no region recomputed
    before       torch.utils.checkpoint non-reentrant, RNG state saved (the runtime until now)
    runtime      runtime.recompute.checkpointed as it is (reentrant, no RNG state)

and prints the extra ms per recomputed region, the block's forward as the uncalibrated cost model
prices it (its FLOPs at the cpu preset's rate), the rerun forward alone as measured, and the
fixed term: extra - priced forward (what the preset's ``recompute_fixed_s`` stands for).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time_stage(folder: Path, inputs, repeats: int) -> tuple[float, tuple]:
    """(median CPU seconds of one forward + backward of stage 0 built from ``folder``, its output's
    shape: stage 0 ends with a block, so that is the hidden state a block reads)."""
    import torch

    from runtime import randomness
    from runtime.stage import build_stage

    module = build_stage(str(folder), 0)
    module.train()
    grad, times = None, []
    for i in range(repeats + 5):
        randomness.set_context(seed=1, step=0, first_sample=0, microbatch=i)
        start = time.thread_time()
        out = module(*inputs)
        if grad is None:
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
        out.backward(grad)
        if i >= 5:
            times.append(time.thread_time() - start)
        for p in module.parameters():
            p.grad = None
    return statistics.median(times), tuple(out.shape)


def _rerun_forward_s(folder: Path, method: str, shape, repeats: int) -> float:
    """Median CPU seconds of one recomputed region's forward alone, with grad (what the rerun runs)."""
    import torch

    from runtime import randomness
    from runtime.stage import build_stage

    module = build_stage(str(folder), 0)
    x = torch.randn(shape, requires_grad=True)
    times = []
    for i in range(repeats + 5):
        randomness.set_context(seed=1, step=0, first_sample=0, microbatch=i)
        start = time.thread_time()
        getattr(module, method)(x)
        if i >= 5:
            times.append(time.thread_time() - start)
    return statistics.median(times)


def main() -> None:
    import torch
    from torch.utils.checkpoint import checkpoint

    import partitioner
    import runtime.recompute as rc
    from benchmarks.recompute import configs
    from partitioner.analysis import analyze, build_problem
    from partitioner.cluster import DEVICE_PRESETS, ClusterSpec
    from partitioner.solver.problem import region_times_s

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="recompute_overhead_"))
    runtime_checkpoint = rc.checkpoint

    def before(fn, *a, **_):  # the runtime until now: non-reentrant, RNG state saved and restored
        return checkpoint(fn, *a, use_reentrant=False, preserve_rng_state=True)

    print(f"{'config':30} {'b':>2} {'regions':>7} | {'plain':>7} | extra per region: {'before':>7} {'runtime':>7} | "
          f"{'fwd priced':>10} {'rerun fwd':>9} | {'fixed: before':>13} {'runtime':>7}   (ms)")
    for name, build, _ in configs():
        workload = build()
        cluster = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2, "memory_bytes": 2**40}]})
        plan = partitioner.compile(workload, cluster=cluster, global_batch=8, num_stages=2, microbatches=4)
        blocks = [r.name for r in plan.regions if r.stage == 0 and r.name.startswith("block")]
        folders = {}
        for kind, chosen in (("plain", set()), ("recompute", set(blocks))):
            folders[kind] = root / f"{''.join(c if c.isalnum() else '_' for c in name)}_{kind}"
            dataclasses.replace(plan, plan=dataclasses.replace(plan.plan, regions=tuple(
                dataclasses.replace(r, recompute=r.name in chosen) for r in plan.regions))).save(folders[kind])
        b = plan.microbatch_size
        tokens = workload.make_batch(0, b)[0] if workload.make_batch else workload.example_args
        gm, _ = analyze(build(), granularity=plan.granularity)
        problem = build_problem(gm, workload.example_batch_size)
        region = next(r for r in problem.regions if r.name == blocks[0])
        priced = region_times_s(region, cluster.devices[0], b)[0]
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for kind, folder, mechanism in (("plain", folders["plain"], runtime_checkpoint),
                                            ("before", folders["recompute"], before),
                                            ("runtime", folders["recompute"], runtime_checkpoint)):
                rc.checkpoint = mechanism
                t, hidden = _time_stage(folder, tuple(tokens), args.repeats)
                best[kind] = min(best.get(kind, float("inf")), t)
        rc.checkpoint = runtime_checkpoint
        rerun = min(_rerun_forward_s(folders["recompute"], "recompute_" + blocks[0].replace(".", "_"), hidden,
                                     args.repeats) for _ in range(args.rounds))
        n = len(blocks)
        extra = {k: (best[k] - best["plain"]) / n for k in ("before", "runtime")}
        ms = 1e3
        print(f"{name:30} {b:>2} {n:>7} | {best['plain'] * ms:7.3f} | {'':17} {extra['before'] * ms:7.3f} "
              f"{extra['runtime'] * ms:7.3f} | {priced * ms:10.3f} {rerun * ms:9.3f} | "
              f"{(extra['before'] - priced) * ms:13.3f} {(extra['runtime'] - priced) * ms:7.3f}")
    print(f"cpu preset recompute_fixed_s: {DEVICE_PRESETS['cpu'].recompute_fixed_s * 1e3:.3f} ms; CPU time of one "
          f"thread, best of {args.rounds} rounds of the median of {args.repeats}; the machine may be shared")


if __name__ == "__main__":
    main()
