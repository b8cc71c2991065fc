"""`make demo`: the main job end to end on the built-in GPT, as a user would type it.

    partitioner compile gpt:... -o out/demo --devices 4 --stages 2 --global-batch 16 --checkpoint-every 5
    partitioner inspect out/demo                       (the per-stage table)
    partitioner inspect out/demo --html out/demo-report.html
    partitioner run out/demo --steps 30 --max-restarts 1 --fail-at 1:12:kill
    partitioner verify out/demo --steps 3
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

MODEL = "gpt:layers=4,width=128,heads=4,vocab=512,seq=64"
OUT = Path("out")
STEPS = 30
FAIL_AT = "1:12:kill"


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def cli(*argv: str) -> int:
    # local name: the module's own main is another
    from partitioner.cli import main

    print("$ partitioner " + " ".join(argv), flush=True)
    code = main(list(argv))
    if code:
        raise SystemExit(f"demo: `partitioner {' '.join(argv)}` exited {code}")
    return code


def main() -> int:
    started = time.perf_counter()
    folder = OUT / "demo"
    if folder.exists():
        shutil.rmtree(folder)
    banner(f"compile the built-in GPT ({MODEL}) for 4 CPU devices")
    # Two stages so the demo shows a pipeline; the solver picks data parallelism and microbatches,
    # and on a machine with fewer cores than 4 ranks it may use fewer (Note [core sharing]).
    cli("compile", MODEL, "-o", str(folder), "--devices", "4", "--stages", "2", "--global-batch", "16",
        "--checkpoint-every", "5", "-q")
    banner("inspect the plan")
    cli("inspect", str(folder))
    report = OUT / "demo-report.html"
    cli("inspect", str(folder), "--html", str(report))
    print(f"open {report.resolve()} in a browser: stage graph, pipeline timeline, memory bars")
    banner(f"train {STEPS} steps; rank {FAIL_AT.split(':')[0]} is killed at step {FAIL_AT.split(':')[1]} "
           "and the job recovers from the last checkpoint")
    cli("run", str(folder), "--steps", str(STEPS), "--max-restarts", "1", "--fail-at", FAIL_AT)
    banner("verify: the partitioned program against the unpartitioned model trained in one process")
    cli("verify", str(folder), "--steps", "3")
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
