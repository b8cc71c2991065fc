"""Tensor parallelism measured: the bytes each rank's collectives carry per step under tp 2 against
the cost model's figure, and the step time of tp 2 beside pp 2 and dp 2 for one model, predicted
and measured, in one run.

    .venv/bin/python benchmarks/tensor_parallel.py [--steps 10] [--calibrate-repeats 5] [--json out.json]

1. Compile hf-llama (2 layers, width 128, 4 heads, vocab 512, seq 64; global batch 8, 2
   microbatches) three ways on 2 CPU ranks: tp 2 (one stage), pp 2 (two stages), dp 2; once with
   the cpu presets and once with a profile calibrated here just before (regions and ops, and
   tensor parallelism's overheads: DTensor's seconds per op, gloo's per collective;
   partitioner/calibrate/tp_overheads.py).
2. Bytes, on three models (hf-llama; the repo's GPT, whose fused qkv stays replicated; hf-bert,
   whose vocab head has a bias): train each tp 2 folder under torchrun with every step inside a
   dispatch mode that adds up the tensors handed to torch's functional collectives, the ones
   DTensor issues (runtime/parallel/collective_bytes.py, benchmarks/_tp_bytes_worker.py), by kind. What a
   rank sends under ring algorithms (an all-reduce of n bytes 2 (tp-1)/tp n, an all-gather of c
   bytes per member (tp-1) c) beside the cost model's ``sent_bytes`` (Note [tensor-parallel
   pricing] in partitioner/solver/tensor_groups.py) over the regions: forward and backward per
   sample x the step's samples, plus the per-step gathers (Note [tensor-parallel traffic] in
   passes/tp_roles.py); and the payloads as counted beside the model's.
3. Step time: the three preset folders trained in one torchrun launch (tests/drivers/run_many.py, one
   thread per rank, no checkpoints), each run's median step after the first (RUN_DIR/summary.json),
   beside both predictions. The machine is 2 CPU cores shared with other jobs: the load average
   is printed beside the times, and a CPU run says nothing about GPU speed (tiny matmuls, gloo
   over loopback). The calibrated pp 2 plan may split the layers elsewhere than the preset one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _torchrun import DRIVER, torchrun  # noqa: E402

SPEC = dict(layers=2, width=128, heads=4, vocab=512, seq=64, batch=2)
GLOBAL_BATCH, MICROBATCHES = 8, 2
# The bytes are counted on three models: the step-time model, the repo's GPT (a fused qkv stays
# replicated, its MLP is split), and a BERT (its vocab head has a bias: a per-step all-gather).
BYTES_MODELS = {"hf-llama": "hf_llama", "gpt": "gpt", "hf-bert": "hf_bert"}
BYTES_STEPS = 3
PLANS = {"tp 2": dict(num_stages=1, tensor_parallel=2), "pp 2": dict(num_stages=2), "dp 2": dict(num_stages=1, dp=2)}


def compile_plans(root: Path, calibrate_repeats: int) -> tuple[dict, dict, dict]:
    """The three plans compiled with the presets (datasheet FLOP/s, Note [tensor-parallel overheads]'s
    cpu figures) and with a profile calibrated here just before (regions, ops, DTensor's per-op
    cost and gloo's per-collective cost, partitioner/calibrate/tp_overheads.py): (preset plans,
    calibrated plans, the profile's tensor-parallel figures)."""
    import partitioner
    from partitioner.frontend.analysis import annotate, trace_keyed
    from partitioner.calibrate import calibrate
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import hf_llama

    workload = hf_llama(**SPEC)
    traced, _ = trace_keyed(workload, workload.example_args, batch_size=workload.example_batch_size)
    gm = annotate(traced, granularity="block", loss_outside_graph=True)
    profile = calibrate(workload, gm, repeats=calibrate_repeats, threads=1, tp_overheads=True)
    out = ({}, {})
    for name, options in PLANS.items():
        for which, profiles in ((0, ()), (1, (profile,))):
            compiled = partitioner.compile(hf_llama(**SPEC), cluster=ClusterSpec.homogeneous(2, "cpu"),
                                           global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES // options.get("dp", 1),
                                           profiles=profiles, machine_profile="preset", **options)  # preset vs calibrated
            folder = root / (name.replace(" ", "") + ("-calibrated" if which else ""))
            if which == 0:
                compiled.save(folder)
            out[which][name] = (compiled, folder)
    return out[0], out[1], {"dtensor_op_s": profile.dtensor_op_s, "tp_collective_s": profile.tp_collective_s,
                            "tp_skew": profile.tp_skew}


def modelled_bytes(compiled, tp: int = 2) -> dict:
    """The cost model's bytes per rank per step: ``sent_bytes`` (Note [tensor-parallel pricing])
    over the regions, forward and backward per sample x the step's samples, plus the per-step
    gathers; and the payloads they come from (all-reduce inputs, all-gather inputs = each member's
    1/tp of the whole), as the dispatch mode counts them."""
    from partitioner.solver.tensor_groups import sent_bytes

    plan, regions = compiled.plan, compiled.problem.regions
    samples = plan.microbatch_size * plan.num_microbatches
    sent = [sent_bytes(r, tp) for r in regions]
    payload = (sum(r.tp.comm_bytes + r.tp.comm_bwd_bytes + r.tp.gather_bytes / tp for r in regions) * samples
               + sum(r.tp.step_gather_bytes / tp for r in regions))
    return {"sent_bytes": sum(f + b for f, b, _ in sent) * samples + sum(s for _, _, s in sent),
            "payload_bytes": payload,
            "per_sample": {"forward_all_reduce": sum(r.tp.comm_bytes for r in regions),
                           "forward_all_gather": sum(r.tp.gather_bytes for r in regions),
                           "backward_all_reduce": sum(r.tp.comm_bwd_bytes for r in regions)},
            "per_step_all_gather": sum(r.tp.step_gather_bytes for r in regions)}


def measure_bytes(folder: Path, steps: int, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    torchrun(2, [str(ROOT / "benchmarks" / "_tp_bytes_worker.py"), str(folder), str(out), str(steps)])
    rows = []
    for rank in range(2):
        per_step = json.loads((out / f"bytes_rank_{rank}.json").read_text())[1:] or \
            json.loads((out / f"bytes_rank_{rank}.json").read_text())
        kinds = sorted({k for s in per_step for k in s["bytes"]})
        mean = {k: sum(s["bytes"].get(k, 0) for s in per_step) / len(per_step) for k in kinds}
        calls = {k: sum(s["calls"].get(k, 0) for s in per_step) / len(per_step) for k in kinds}
        rows.append({"rank": rank, "bytes": mean, "calls": calls, "total": sum(mean.values())})
    return rows


def ring_sent(kinds: dict, tp: int = 2) -> float:
    """Bytes a rank sends for these payloads (the collectives' input tensors) under ring algorithms."""
    from runtime.parallel.collective_bytes import ring_factor

    return sum(ring_factor(kind, tp) * nbytes for kind, nbytes in kinds.items())


def step_times(folders: dict, steps: int) -> dict:
    args = []
    for name, folder in folders.items():
        args += ["--", str(folder), "--steps", str(steps), "--no-checkpoint", "--quiet",
                 "--run-dir", str(folder / "run")]
    torchrun(2, [DRIVER, *args[1:]])
    return {name: json.loads((folder / "run" / "summary.json").read_text())["measured_step_time_s"]
            for name, folder in folders.items()}


def compile_tp(name: str, root: Path):
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models import builtin as models

    compiled = partitioner.compile(getattr(models, BYTES_MODELS[name])(**SPEC), cluster=ClusterSpec.homogeneous(2, "cpu"),
                                   global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES, **PLANS["tp 2"])
    folder = root / f"bytes-{name}"
    compiled.save(folder)
    return compiled, folder


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--calibrate-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    bytes_rows = {}
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        root = Path(tmp)
        load_calibrate = os.getloadavg()[0]
        plans, calibrated, tp_figures = compile_plans(root, args.calibrate_repeats)
        for name in BYTES_MODELS:
            compiled, folder = plans["tp 2"] if name == "hf-llama" else compile_tp(name, root)
            bytes_rows[name] = (modelled_bytes(compiled), measure_bytes(folder, BYTES_STEPS, root / f"bytes-{name}-out"))
        load_before = os.getloadavg()[0]
        times = step_times({name: folder for name, (_, folder) in plans.items()}, args.steps)
        load_after = os.getloadavg()[0]
    print(f"{SPEC}, global batch {GLOBAL_BATCH}, {MICROBATCHES} microbatches, 2 CPU ranks (gloo)")
    print(f"\nbytes each rank sends per step under tp 2 (ring algorithms; collective payloads as counted; "
          f"{BYTES_STEPS} steps, first left out)")
    result_bytes = {}
    for name, (model, measured) in bytes_rows.items():
        print(f"  {name}:")
        for row in measured:
            kinds = ", ".join(f"{k} {v / 1e6:.3f} MB ({row['calls'][k]:.0f} calls)" for k, v in row["bytes"].items())
            print(f"    rank {row['rank']}: sends {ring_sent(row['bytes']) / 1e6:.4f} MB; payloads {kinds}")
        sent = ring_sent(measured[0]["bytes"])
        print(f"    cost model: sends {model['sent_bytes'] / 1e6:.4f} MB (payloads {model['payload_bytes'] / 1e6:.4f} MB; "
              f"per sample forward all-reduce {model['per_sample']['forward_all_reduce']} B, all-gather "
              f"{model['per_sample']['forward_all_gather']} B, backward all-reduce "
              f"{model['per_sample']['backward_all_reduce']} B; per step all-gather {model['per_step_all_gather']} B)")
        print(f"    measured / model: sent {sent / model['sent_bytes']:.3f}, payloads "
              f"{measured[0]['total'] / model['payload_bytes']:.3f}")
        result_bytes[name] = {"measured": measured, "model": model, "ratio": sent / model["sent_bytes"]}
    print(f"\nstep time, hf-llama, median after the first of {args.steps} steps (load average {load_before:.1f} -> "
          f"{load_after:.1f} on 2 shared cores; calibrated at load {load_calibrate:.1f}: DTensor "
          f"{tp_figures['dtensor_op_s'] * 1e6:.0f} us/op, {tp_figures['tp_collective_s'] * 1e3:.2f} ms/collective, "
          f"skew {tp_figures['tp_skew']:.2f} s/s)")
    print(f"  {'plan':5} {'measured ms':>11} {'x dp 2':>7} {'preset ms':>10} {'meas/pred':>9} {'calibrated ms':>13} "
          f"{'meas/pred':>9}")
    predicted = {}
    for name, seconds in times.items():
        preset = plans[name][0].plan.predicted["step_time_s"]
        fitted = calibrated[name][0].plan.predicted["step_time_s"]
        predicted[name] = {"preset": preset, "calibrated": fitted}
        print(f"  {name:5} {seconds * 1e3:11.1f} {seconds / times['dp 2']:7.2f} {preset * 1e3:10.1f} "
              f"{seconds / preset:9.2f} {fitted * 1e3:13.1f} {seconds / fitted:9.2f}")
    result = {"bytes": result_bytes, "step_time_s": times, "load": [load_before, load_after],
              "predicted_step_time_s": predicted, "calibrated_tp_overheads": tp_figures}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
