"""`make demo`: the main job end to end, as a user would type it, on a corpus every machine with
Python already has: the standard library's own sources, byte-level.

    partitioner data prepare $STDLIB/*.py -o out/stdlib-corpus --tokenizer bytes
    partitioner compile gpt:... -o out/demo --data tokens:out/stdlib-corpus --devices 4 --stages 2 ...
    partitioner inspect out/demo                       (the per-stage table)
    partitioner inspect out/demo --html out/demo-report.html
    partitioner run out/demo --steps 150 --eval-every 50 --max-restarts 1 --fail-at 1:60:kill
    partitioner generate out/demo --prompt "def "
    partitioner verify out/demo --steps 3
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

MODEL = "gpt:layers=4,width=128,heads=4,seq=64"  # the vocabulary is the corpus's (256 bytes)
OUT = Path("out")
STEPS = 150
EVAL_EVERY = 50
FAIL_AT = "1:60:kill"
PROMPT = "def "


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def cli(*argv: str) -> int:
    # local name: the module's own main is another
    from partitioner.cli import main

    shown = [a for a in argv if not a.endswith(".py")]
    more = len(argv) - len(shown)
    print("$ partitioner " + " ".join(shown) + (f" ... ({more} .py files)" if more else ""), flush=True)
    code = main(list(argv))
    if code:
        raise SystemExit(f"demo: `partitioner {' '.join(shown)}` exited {code}")
    return code


def stdlib_sources() -> list[str]:
    """The standard library's top-level modules: about 4.6 MB of real Python on every machine."""
    return [str(p) for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]


def val_losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]


def main() -> int:
    started = time.perf_counter()
    corpus, folder = OUT / "stdlib-corpus", OUT / "demo"
    for old in (corpus, folder):
        if old.exists():
            shutil.rmtree(old)
    banner("prepare a corpus: the Python standard library's own sources, byte-level")
    cli("data", "prepare", *stdlib_sources(), "-o", str(corpus), "--tokenizer", "bytes")
    banner(f"compile a small GPT ({MODEL}) to train on it, for 4 CPU devices")
    # Two stages so the demo shows a pipeline; the solver picks data parallelism and microbatches,
    # and on a machine with fewer cores than 4 ranks it may use fewer (Note [core sharing]).
    cli("compile", MODEL, "-o", str(folder), "--data", f"tokens:{corpus}", "--devices", "4", "--stages", "2",
        "--global-batch", "16", "--lr", "3e-3", "--warmup-steps", "20", "--steps", str(STEPS),
        "--checkpoint-every", "25", "-q")
    banner("inspect the plan")
    cli("inspect", str(folder))
    report = OUT / "demo-report.html"
    cli("inspect", str(folder), "--html", str(report))
    print(f"open {report.resolve()} in a browser: stage graph, pipeline timeline, memory bars")
    banner(f"train {STEPS} steps, the validation loss every {EVAL_EVERY}; rank {FAIL_AT.split(':')[0]} is "
           f"killed at step {FAIL_AT.split(':')[1]} and the job recovers from the last checkpoint")
    cli("run", str(folder), "--steps", str(STEPS), "--eval-every", str(EVAL_EVERY), "--max-restarts", "1",
        "--fail-at", FAIL_AT, "--quiet", "--log-every", "25")
    curve = val_losses(folder / "run")
    print(f"validation loss (uniform guessing over 256 bytes: ln 256 = {math.log(256):.2f}): "
          + ", ".join(f"step {step + 1}: {loss:.2f}" for step, loss in curve))
    banner("sample from the trained model (the newest verified checkpoint)")
    cli("generate", str(folder), "--prompt", PROMPT, "--max-new-tokens", "160", "--temperature", "0.8",
        "--top-k", "20", "--seed", "0")
    banner("verify: the partitioned program against the unpartitioned model trained in one process")
    cli("verify", str(folder), "--steps", "3")
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
