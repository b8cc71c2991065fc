"""Predicted vs measured per-stage time and per-rank peak memory, datasheet vs calibrated model.

    .venv/bin/python benchmarks/cost_model_accuracy.py [--repeats 15] [--json results.json]

For the built-in GPT, Hugging Face GPT-2 and Hugging Face Llama (sizes that train in well under a
second per step here), each at 2 and 4 pipeline stages (dp 1, 4 microbatches of the example batch,
1F1B):

1. calibrate on this machine (partitioner/calibrate.py: every region and every distinct op run
   alone, median of repeats, weighted NNLS fit), one profile per model;
2. compile with that profile and write the program folder;
3. measure every stage module (runtime.stage.build_stage on the folder) alone: forward + backward
   of one microbatch on real inputs (stage k's inputs are what stages < k produced for the same
   batch), backward from fixed random output gradients, one torch thread (what `partitioner run`
   gives each rank), median of --repeats after warm-up;
4. predict the same stages (the same assignment) with the cost model
   (partitioner.solver.check.evaluate, compute time of a stage) three ways: the datasheet model
   (FLOPs / the cpu preset's 50 GFLOP/s), the model's own calibrated profile, and - to show how
   a profile transfers - the profile fitted on the built-in GPT;
5. peak memory of a rank: parameters + gradients + AdamW state (bytes of the real tensors after an
   optimizer step) + the peak of live tensor bytes (calibrate.LiveBytes, a TorchDispatchMode that
   tracks every storage an op creates until it is freed) while the stage runs its 1F1B worst
   case: the input buffers and forwards of its in-flight microbatches (min(p - s, m)), then their
   backwards. Predicted: the plan's peak_memory_bytes (params, grads, optimizer, in-flight saved
   activations, send/receive buffers).

Relative error = |predicted - measured| / measured. The machine is 2 shared CPU cores: medians
over repeats, and times vary by ~10% between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MODELS = [
    ("gpt", "gpt:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2"),
    ("hf-gpt2", "hf-gpt2:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2"),
    ("hf-llama", "hf-llama:layers=4,width=256,heads=4,vocab=2048,seq=128,batch=2"),
]
STAGES = (2, 4)
MICROBATCHES = 4


def _rel(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def _clone_inputs(values):
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            c = v.detach().clone()
            out.append(c.requires_grad_(True) if c.dtype.is_floating_point else c)
        else:
            out.append(v)
    return out


def _flat_outputs(out):
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def stage_inputs(folder: str, modules, batch_args) -> list[list]:
    """Real inputs of every stage: run the stages in order on one batch."""
    inputs, current = [], list(batch_args)
    with torch.no_grad():
        for module in modules:
            inputs.append([c.detach() if isinstance(c, torch.Tensor) else c for c in current])
            out = module(*current)
            current = list(out) if isinstance(out, (tuple, list)) else [out]
    return inputs


def time_stage(module, inputs, *, warmup: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    grads = None
    times = []
    for i in range(warmup + repeats):
        xs = _clone_inputs(inputs)
        start = time.perf_counter()
        outs = _flat_outputs(module(*xs))
        if grads is None:
            grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        for p in module.parameters():
            p.grad = None
    return statistics.median(times)


def peak_memory(module, inputs, in_flight: int) -> dict:
    from partitioner.calibrate import LiveBytes

    params = [p for p in module.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params) + sum(
        b.numel() * b.element_size() for b in module.buffers())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    # One step first, so gradients and AdamW state exist as they do in steady-state training.
    outs = _flat_outputs(module(*_clone_inputs(inputs)))
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    optimizer.step()
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state_bytes = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
    mode = LiveBytes()
    with mode:
        pending = []
        for _ in range(in_flight):
            xs = [x.clone().requires_grad_(x.dtype.is_floating_point) if isinstance(x, torch.Tensor) else x
                  for x in inputs]
            pending.append(_flat_outputs(module(*xs)))
        after_forwards = mode.current
        for outs in pending:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        del pending, outs
    return {"static_bytes": param_bytes + grad_bytes + state_bytes, "activation_peak_bytes": mode.peak,
            "after_forwards_bytes": after_forwards,
            "peak_bytes": param_bytes + grad_bytes + state_bytes + mode.peak}


def run(repeats: int, warmup: int, calib_repeats: int, models, stages_list) -> dict:
    import partitioner
    from partitioner.calibrate import calibrate
    from partitioner.cluster import ClusterSpec
    from partitioner.compiler import analyze, build_problem
    from partitioner.models import load_workload
    from partitioner.solver.check import evaluate
    from partitioner.solver.problem import Assignment, in_flight_microbatches, place_stages
    from runtime.stage import build_stage

    torch.set_num_threads(1)
    results = {"configs": [], "profiles": {}}
    gpt_profile = None
    with tempfile.TemporaryDirectory() as tmp:
        for label, spec in models:
            workload = load_workload(spec)
            gm, _table = analyze(workload)
            started = time.perf_counter()
            profile = calibrate(workload, gm, repeats=calib_repeats, threads=1)
            calib_s = time.perf_counter() - started
            if label == "gpt":
                gpt_profile = profile
            results["profiles"][label] = {"calibrate_s": calib_s, "forward": profile.forward.rates(),
                                          "backward": profile.backward.rates(),
                                          **{k: v for k, v in profile.meta.items() if "error" in k}}
            b = workload.example_batch_size
            args, _target = workload.make_batch(0, b)
            problems = {"datasheet": build_problem(gm, b), "calibrated": build_problem(gm, b, profiles=[profile])}
            if gpt_profile is not None and label != "gpt":
                problems["calibrated_on_gpt"] = build_problem(gm, b, profiles=[gpt_profile])
            for num_stages in stages_list:
                cluster = ClusterSpec.homogeneous(num_stages, "cpu")
                plan = partitioner.compile(workload, cluster=cluster, global_batch=b * MICROBATCHES,
                                           num_stages=num_stages, dp=1, microbatches=MICROBATCHES,
                                           profiles=[profile])
                folder = os.path.join(tmp, f"{label}_{num_stages}")
                plan.save(folder)
                assignment = Assignment(
                    stage_of_region=tuple(r.stage for r in plan.regions),
                    recompute=tuple(r.recompute for r in plan.regions),
                    device_of_stage_replica=place_stages(cluster, num_stages, 1), num_stages=num_stages, dp=1,
                    num_microbatches=plan.num_microbatches, microbatch_size=plan.microbatch_size,
                    schedule=plan.schedule)
                predicted = {name: [st.compute_s for st in evaluate(problem, cluster, assignment).stages]
                             for name, problem in problems.items()}
                modules = [build_stage(folder, s) for s in range(num_stages)]
                inputs = stage_inputs(folder, modules, args)
                for s, module in enumerate(modules):
                    measured_s = time_stage(module, inputs[s], warmup=warmup, repeats=repeats)
                    k = in_flight_microbatches(plan.schedule, s, num_stages, plan.num_microbatches)
                    memory = peak_memory(module, inputs[s], k)
                    row = {"model": label, "spec": spec, "stages": num_stages, "stage": s,
                           "regions": list(plan.stages[s].region_names), "measured_s": measured_s,
                           "predicted_s": {name: p[s] for name, p in predicted.items()},
                           "measured_peak_bytes": memory["peak_bytes"],
                           "measured_static_bytes": memory["static_bytes"],
                           "measured_activation_peak_bytes": memory["activation_peak_bytes"],
                           "measured_after_forwards_bytes": memory["after_forwards_bytes"],
                           "predicted_static_bytes": plan.stages[s].memory.params_bytes
                           + plan.stages[s].memory.grads_bytes + plan.stages[s].memory.optimizer_bytes,
                           "predicted_peak_bytes": plan.stages[s].peak_memory_bytes}
                    results["configs"].append(row)
                    print(f"  {label:9} p={num_stages} stage {s}: measured {measured_s * 1e3:7.2f} ms  "
                          + "  ".join(f"{n} {v[s] * 1e3:7.2f}" for n, v in predicted.items())
                          + f"   peak {memory['peak_bytes'] / 2**20:6.2f} MiB measured, "
                          f"{plan.stages[s].peak_memory_bytes / 2**20:6.2f} predicted", flush=True)
    return results


def summarize(results: dict) -> dict:
    rows = results["configs"]
    summary = {}
    for model in sorted({r["model"] for r in rows}) + ["all"]:
        mine = [r for r in rows if model in ("all", r["model"])]
        entry = {}
        for name in ("datasheet", "calibrated", "calibrated_on_gpt"):
            errs = [_rel(r["predicted_s"][name], r["measured_s"]) for r in mine if name in r["predicted_s"]]
            if errs:
                entry[f"time_{name}"] = {"median": statistics.median(errs), "worst": max(errs), "n": len(errs)}
        errs = [_rel(r["predicted_peak_bytes"], r["measured_peak_bytes"]) for r in mine]
        entry["peak_memory"] = {"median": statistics.median(errs), "worst": max(errs), "n": len(errs)}
        summary[model] = entry
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calibrate-repeats", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=[m for m, _ in MODELS])
    parser.add_argument("--stages", type=int, nargs="*", default=list(STAGES))
    parser.add_argument("--json", help="write every row and the summary here")
    args = parser.parse_args()
    models = [(m, s) for m, s in MODELS if m in args.models]
    print(f"per-stage forward+backward of one microbatch (median of {args.repeats}, 1 thread) and per-rank "
          "peak memory; predicted: datasheet / calibrated / calibrated on gpt")
    results = run(args.repeats, args.warmup, args.calibrate_repeats, models, args.stages)
    summary = summarize(results)
    results["summary"] = summary
    print(f"\n{'model':10} {'n':>3}  {'time err: datasheet':>21} {'calibrated':>15} {'calib. on gpt':>15}  "
          f"{'peak mem err':>15}")
    for model, entry in summary.items():
        def cell(key):
            e = entry.get(key)
            return f"{e['median']:6.1%} / {e['worst']:6.1%}" if e else f"{'-':>15}"
        print(f"{model:10} {entry['peak_memory']['n']:>3}  {cell('time_datasheet'):>21} {cell('time_calibrated'):>15} "
              f"{cell('time_calibrated_on_gpt'):>15}  {cell('peak_memory'):>15}")
    print("errors: median / worst relative error over stages; targets: stage time <= 10% median, peak memory "
          "<= 10%")
    for label, info in results["profiles"].items():
        f, b = info["forward"], info["backward"]
        print(f"profile {label}: calibrated in {info['calibrate_s']:.1f} s; forward matmul "
              f"{f['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, memory {f['memory_bytes_per_s'] / 1e9:.1f} GB/s, "
              f"{f['op_overhead_s'] * 1e6:.1f} us/op; backward matmul {b['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, "
              f"{b['op_overhead_s'] * 1e6:.1f} us/op")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
    all_ = summary["all"]
    improved = all_["time_calibrated"]["median"] < all_["time_datasheet"]["median"]
    print(f"calibration {'improves' if improved else 'does NOT improve'} the median stage-time error: "
          f"{all_['time_datasheet']['median']:.1%} -> {all_['time_calibrated']['median']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
