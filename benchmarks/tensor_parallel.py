"""Tensor parallelism measured: the bytes each rank's collectives carry per step under tp 2 against
the cost model's figure, and the step time of tp 2 beside pp 2 and dp 2 for one model, in one run.

    .venv/bin/python benchmarks/tensor_parallel.py [--steps 10] [--json out.json]

1. Compile hf-llama (2 layers, width 128, 4 heads, vocab 512, seq 64; global batch 8, 2
   microbatches) three ways on 2 CPU ranks: tp 2 (one stage), pp 2 (two stages), dp 2.
2. Bytes: train the tp 2 folder under torchrun with every step inside a dispatch mode that adds
   up the tensors handed to torch's functional collectives, the ones DTensor issues
   (benchmarks/_tp_bytes_worker.py): the payload each collective moves, per rank per step,
   by kind (all_reduce, all_gather_into_tensor, ...). The cost model's figure is the pass's
   ``tp_comm_bytes`` (Note [tensor-parallel roles] in passes/tensor_parallel.py: per sample, the
   forward's collective payloads: each row-parallel linear's and vocab lookup's output
   all-reduced, the vocab-split head's logits all-gathered) x microbatch size x microbatches x 2
   (backward assumed to move the same again). A ring all-reduce of n bytes sends 2 (tp-1)/tp n
   from each rank, an all-gather (tp-1)/tp n: printed beside the payloads. What the program
   moves per microbatch (Megatron's points, runtime/tensor_parallel.py): forward, the vocab
   lookup's and every row linear's output all-reduced, each rank's half of the logits
   all-gathered; backward, the input gradient of every column group and of the head all-reduced,
   and nothing for the logits (their gradient is sliced) or the lookup. So the model's "x 2"
   over-counts a vocab-split head's logits in backward and misses its input's all-reduce.
3. Step time: the three folders trained in one torchrun launch (runtime/run_many.py, one thread
   per rank, no checkpoints), each run's median step after the first (RUN_DIR/summary.json).
   The machine is 2 CPU cores shared with other jobs: the load average is printed beside the
   times, and a CPU run says nothing about GPU speed (tiny matmuls, gloo over loopback).
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
PLANS = {"tp 2": dict(num_stages=1, tensor_parallel=2), "pp 2": dict(num_stages=2), "dp 2": dict(num_stages=1, dp=2)}


def compile_plans(root: Path) -> dict:
    import partitioner
    from partitioner.cluster import ClusterSpec
    from partitioner.models import hf_llama

    out = {}
    for name, options in PLANS.items():
        compiled = partitioner.compile(hf_llama(**SPEC), cluster=ClusterSpec.homogeneous(2, "cpu"),
                                       global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES // options.get("dp", 1),
                                       **options)
        folder = root / name.replace(" ", "")
        compiled.save(folder)
        out[name] = (compiled, folder)
    return out


def modelled_bytes(compiled) -> dict:
    plan = compiled.plan
    per_sample = sum(r.tp_comm_bytes for r in compiled.problem.regions)
    forward = per_sample * plan.microbatch_size * plan.num_microbatches
    return {"per_sample_bytes": per_sample, "forward_bytes": forward, "step_bytes": 2 * forward}


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
    """Bytes a rank sends for these payloads under ring algorithms."""
    sent = 0.0
    for kind, nbytes in kinds.items():
        factor = 2 * (tp - 1) / tp if kind.startswith("all_reduce") else (tp - 1) / tp
        sent += factor * nbytes
    return sent


def step_times(folders: dict, steps: int) -> dict:
    args = []
    for name, folder in folders.items():
        args += ["--", str(folder), "--steps", str(steps), "--no-checkpoint", "--quiet",
                 "--run-dir", str(folder / "run")]
    torchrun(2, [DRIVER, *args[1:]])
    return {name: json.loads((folder / "run" / "summary.json").read_text())["measured_step_time_s"]
            for name, folder in folders.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        root = Path(tmp)
        plans = compile_plans(root)
        compiled_tp, folder_tp = plans["tp 2"]
        model = modelled_bytes(compiled_tp)
        measured = measure_bytes(folder_tp, args.steps, root / "bytes")
        load_before = os.getloadavg()[0]
        times = step_times({name: folder for name, (_, folder) in plans.items()}, args.steps)
        load_after = os.getloadavg()[0]
    print(f"hf-llama {SPEC}, global batch {GLOBAL_BATCH}, {MICROBATCHES} microbatches, 2 CPU ranks (gloo)")
    print(f"\nbytes per rank per step under tp 2 (collective payloads; {args.steps} steps, first left out)")
    for row in measured:
        kinds = ", ".join(f"{k} {v / 1e6:.3f} MB ({row['calls'][k]:.0f} calls)" for k, v in row["bytes"].items())
        print(f"  rank {row['rank']}: {row['total'] / 1e6:.3f} MB = {kinds}; ring sends {ring_sent(row['bytes']) / 1e6:.3f} MB")
    print(f"  cost model (tp_comm_bytes {model['per_sample_bytes']} B/sample x {compiled_tp.plan.microbatch_size} x "
          f"{compiled_tp.plan.num_microbatches} x 2): {model['step_bytes'] / 1e6:.3f} MB; "
          f"measured / model {measured[0]['total'] / model['step_bytes']:.2f}")
    print(f"\nstep time, median after the first of {args.steps} steps (load average {load_before:.1f} -> "
          f"{load_after:.1f} on 2 shared cores)")
    for name, seconds in times.items():
        print(f"  {name}: {seconds * 1e3:8.1f} ms/step   ({seconds / times['dp 2']:.2f} x dp 2, "
              f"predicted {plans[name][0].plan.predicted['step_time_s'] * 1e3:.1f} ms)")
    result = {"bytes": measured, "model": model, "step_time_s": times, "load": [load_before, load_after]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
