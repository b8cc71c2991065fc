"""`make demo`: the main job end to end on the built-in GPT.

compile for 4 CPU ranks → print the plan → write the program folder → train it with torchrun →
compare against the one-process run of the same model.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

MODEL = "gpt:layers=4,width=128,heads=4,vocab=512,seq=64"


def region_table_text(rows) -> str:
    lines = [f"{'region':<14} {'nodes':>6} {'fwd MFLOP':>10} {'bwd MFLOP':>10} {'params KiB':>11} {'saved KiB':>10}"]
    for r in rows:
        lines.append(f"{r.name:<14} {len(r.node_names):>6} {r.fwd_flops / 1e6:>10.2f} {r.bwd_flops / 1e6:>10.2f} "
                     f"{r.param_bytes / 1024:>11.1f} {r.saved_activation_bytes / 1024:>10.1f}")
    total_f = sum(r.fwd_flops for r in rows)
    total_b = sum(r.bwd_flops for r in rows)
    lines.append(f"{'total':<14} {sum(len(r.node_names) for r in rows):>6} {total_f / 1e6:>10.2f} {total_b / 1e6:>10.2f} "
                 f"{sum(r.param_bytes for r in rows) / 1024:>11.1f} {sum(r.saved_activation_bytes for r in rows) / 1024:>10.1f}")
    return "\n".join(lines)


def main() -> int:
    import partitioner
    from partitioner.models import load_workload

    workload = load_workload(MODEL)
    print(f"== analyze {MODEL}")
    started = time.perf_counter()
    _gm, rows = partitioner.analyze(workload)
    print(region_table_text(rows))
    print(f"(traced and annotated in {time.perf_counter() - started:.2f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
