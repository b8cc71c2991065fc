"""Tensor parallelism under mixed precision, measured: the bytes each rank's tensor-parallel
collectives carry per step under tp 2 in fp32 and in bf16-mixed, side by side with the cost
model's figure for each (Note [tensor parallelism under autocast] in runtime/parallel/tensor_parallel.py).

    .venv/bin/python benchmarks/tp_precision_bytes.py [--steps 3]

The same model and counting as benchmarks/tensor_parallel.py (hf-llama 2 layers, width 128, 4
heads, vocab 512, seq 64; global batch 8, 2 microbatches; 2 CPU ranks, gloo): each step runs
inside benchmarks/_tp_bytes_worker.py's dispatch mode, which adds up the payloads of the
functional collectives DTensor issues (the first step is left out). The model's figure is the
payload ``modelled_bytes`` prices there (forward all-reduces and all-gathers, backward
all-reduces per sample x the step's samples, plus the per-step gathers: Note [tensor-parallel
traffic]); under bf16-mixed ``precision_problem`` prices them at 2 bytes an element, except the
vocab lookup's all-reduce (``RegionCost.tp.lookup_bytes``), which stays fp32 in the program (an embedding is
not autocast), and the per-step gradient gathers (fp32 gradients).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tensor_parallel import GLOBAL_BATCH, MICROBATCHES, SPEC, measure_bytes, modelled_bytes  # noqa: E402


def main(argv=None) -> dict:
    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import hf_llama

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory(prefix="tp-precision-") as tmp:
        for precision in ("fp32", "bf16-mixed"):
            compiled = partitioner.compile(hf_llama(**SPEC), cluster=ClusterSpec.homogeneous(2, "cpu"),
                                           global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES, num_stages=1,
                                           tensor_parallel=2, precision=precision)
            folder = Path(tmp) / precision
            compiled.save(folder)
            rows = measure_bytes(folder, args.steps, Path(tmp) / f"bytes_{precision}")
            out[precision] = {"measured": rows[0]["total"], "model": modelled_bytes(compiled)["payload_bytes"],
                              "calls": rows[0]["calls"]}
    print(f"hf-llama {SPEC}, tp 2 on 2 CPU ranks (gloo), global batch {GLOBAL_BATCH}, {MICROBATCHES} microbatches; "
          f"tensor-parallel collective payload bytes per rank per step ({args.steps} steps, first left out)")
    for precision, row in out.items():
        print(f"  {precision:>10}: measured {row['measured'] / 1e6:.3f} MB, cost model {row['model'] / 1e6:.3f} MB "
              f"(measured / model {row['measured'] / row['model']:.2f})")
    ratio_measured = out["bf16-mixed"]["measured"] / out["fp32"]["measured"]
    ratio_model = out["bf16-mixed"]["model"] / out["fp32"]["model"]
    print(f"  bf16-mixed / fp32: measured {ratio_measured:.2f}, cost model {ratio_model:.2f}")
    return out


if __name__ == "__main__":
    main()
