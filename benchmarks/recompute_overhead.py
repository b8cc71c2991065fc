"""What a recomputed region costs one microbatch beyond plain, by checkpoint mechanism, and the
fixed term that leaves for the cost model (Note [recompute fixed cost] in
partitioner/solver/recompute_cost.py, Note [cheap checkpointing] in runtime/execute/recompute.py).

    .venv/bin/python benchmarks/recompute_overhead.py [--iterations 200]

For each GPT of benchmarks/recompute.py, at its plan's microbatch: stage 0 of a 2-stage plan is
built twice, every block region recomputed and none, and one forward + backward of a microbatch
is timed in this process (one thread; CPU time of the thread, which a loaded machine inflates
less than wall time; each round times every variant back to back, and the figures are medians
over rounds of the differences against plain in the same round) under

    plain        no region recomputed
    before       torch.utils.checkpoint non-reentrant, RNG state saved (the runtime until now)
    runtime      runtime.execute.recompute.checkpointed as it is (reentrant, no RNG state)

and prints the extra ms per recomputed region, the block's forward as the uncalibrated cost model
prices it (its FLOPs at the cpu preset's rate), the rerun forward alone as measured (with grad),
and two fixed terms (Note [recompute fixed cost]): extra - the priced forward, what the FLOP model
leaves unpriced (what the cpu preset's ``recompute_fixed_s`` stands for), and extra - the
measured rerun, the checkpoint's own cost (what a calibrated profile's term comes to, its fitted
forward pricing the rerun's per-op dispatch).
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


def _forward_backward_s(module, inputs, grad, microbatch: int) -> tuple[float, object]:
    """(CPU seconds of one forward + backward of ``module``, its output)."""
    from runtime.execute import randomness

    randomness.set_context(seed=1, step=0, first_sample=0, microbatch=microbatch)
    start = time.thread_time()
    out = module(*inputs)
    out.backward(grad)
    seconds = time.thread_time() - start
    for p in module.parameters():
        p.grad = None
    return seconds, out


def _paired(plain, recompute, method: str, inputs, iterations: int, mechanisms: dict) -> dict:
    """Medians over ``iterations`` rounds, each timing plain, then every mechanism, then the rerun
    forward alone (one region's method with grad), back to back: plain seconds, and per mechanism
    the paired difference against plain; "rerun": the lone forward."""
    import torch

    import runtime.execute.recompute as rc
    from runtime.execute import randomness

    randomness.set_context(seed=1, step=0, first_sample=0, microbatch=0)
    with torch.no_grad():
        out = plain(*inputs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(out.shape, requires_grad=True)  # stage 0 ends with a block: a block's input shape
    rows: dict[str, list[float]] = {"plain": [], "rerun": [], **{k: [] for k in mechanisms}}
    for i in range(iterations + 5):
        base, _ = _forward_backward_s(plain, inputs, grad, i)
        times = {}
        for kind, mechanism in mechanisms.items():
            rc.checkpoint = mechanism
            times[kind], _ = _forward_backward_s(recompute, inputs, grad, i)
        randomness.set_context(seed=1, step=0, first_sample=0, microbatch=i)
        start = time.thread_time()
        getattr(recompute, method)(hidden)
        rerun = time.thread_time() - start
        if i >= 5:
            rows["plain"].append(base)
            rows["rerun"].append(rerun)
            for kind in mechanisms:
                rows[kind].append(times[kind] - base)
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    import torch
    from torch.utils.checkpoint import checkpoint

    import partitioner
    import runtime.execute.recompute as rc
    from benchmarks.recompute import configs
    from partitioner.frontend.analysis import analyze
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.config.cluster import DEVICE_PRESETS, ClusterSpec
    from partitioner.solver.problem import region_times_s

    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="recompute_overhead_"))
    runtime_checkpoint = rc.checkpoint

    def before(fn, *a, **_):  # the runtime until now: non-reentrant, RNG state saved and restored
        return checkpoint(fn, *a, use_reentrant=False, preserve_rng_state=True)

    print(f"{'config':30} {'b':>2} {'regions':>7} | {'plain':>7} | extra per region: {'before':>7} {'runtime':>7} | "
          f"{'fwd priced':>10} {'rerun fwd':>9} | beyond priced: {'before':>7} {'runtime':>7} | beyond rerun: "
          f"{'before':>7} {'runtime':>7}   (ms)")
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
        from runtime.execute.stage import build_stage

        modules = {k: build_stage(str(f), 0).train() for k, f in folders.items()}
        got = _paired(modules["plain"], modules["recompute"], "recompute_" + blocks[0].replace(".", "_"),
                      tuple(tokens), args.iterations, {"before": before, "runtime": runtime_checkpoint})
        rc.checkpoint = runtime_checkpoint
        rerun = got["rerun"]
        n = len(blocks)
        extra = {k: got[k] / n for k in ("before", "runtime")}
        ms = 1e3
        print(f"{name:30} {b:>2} {n:>7} | {got['plain'] * ms:7.3f} | {'':17} {extra['before'] * ms:7.3f} "
              f"{extra['runtime'] * ms:7.3f} | {priced * ms:10.3f} {rerun * ms:9.3f} | "
              f"{'':14} {(extra['before'] - priced) * ms:7.3f} {(extra['runtime'] - priced) * ms:7.3f} | {'':13} "
              f"{(extra['before'] - rerun) * ms:7.3f} {(extra['runtime'] - rerun) * ms:7.3f}")
    print(f"cpu preset recompute_fixed_s: {DEVICE_PRESETS['cpu'].recompute_fixed_s * 1e3:.3f} ms; CPU time of one "
          f"thread, medians of {args.iterations} paired rounds; the machine may be shared")


if __name__ == "__main__":
    main()
