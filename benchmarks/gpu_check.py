"""The one-GPU check: every CUDA path the project has that one GPU can exercise, in one command of
under 8 minutes on one H100 or H200, written to one JSON report (issue 40 item 5; the design is
../shared/gpu-audit.md §3).

    # on a CPU machine (OR-Tools): compile the program folders on the meta device (no weights)
    python benchmarks/gpu_check.py prepare --out build/gpu_check        # = make gpu-check-folders
    # on the GPU machine (torch only; no OR-Tools, no compiler)
    python benchmarks/gpu_check.py run --folders build/gpu_check --out $OUT/gpu_check.json
    # the same on CPU under gloo, tiny sizes (tests/e2e/test_gpu_check.py runs it)
    python benchmarks/gpu_check.py prepare --out F --dry-run && python benchmarks/gpu_check.py run --folders F --out r.json --dry-run

Phases (``PHASES`` in benchmarks/_gpu_check_phases.py): P0 environment and versions against the
pins; P1 probes (a CPU tensor on an NCCL group, which gloo collectives take CUDA tensors between two
processes on cuda:0, fused AdamW with a CPU step, SDPA backward bitwise with and without
deterministic mode, a keyed draw's sha256, perf_counter against CUDA events); P2 a ~170M-parameter
GPT in bf16 under torchrun (eval, checkpoints, then killed at an unannounced step and resumed,
losses against the uninterrupted run; generate on the device); P3 fp16 with clipping; P4 held to
the one-process oracle (CPU, and the device where the runtime offers it); P5 the memory tier and
lossless checkpoints through a kill, and export; P7 two data-parallel ranks on the one GPU through
gloo (Note [every rank on one GPU] in runtime/launch/world.py); P6 compiled stages, last.
Every run reports predicted against measured step time and peak memory (allocated, and reserved and
device-wide where measured).

Note [a report that survives]: each phase runs in its own process under its own time limit (and
never past the whole check's budget), writes what it learns to WORK/<phase>.json after every item,
and the report is rewritten after every phase. A phase that fails, hangs or crashes the CUDA
context records its first error line and the check goes on; a `run` command stopped at its
limit still leaves the phases it finished in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the project's packages import
    sys.path.insert(0, str(REPO))

from benchmarks._gpu_check_folders import DEFAULT_CORPUS_AT, MANIFEST, ensure_corpus, prepare  # noqa: E402
from benchmarks._gpu_check_runs import Answers  # noqa: E402
from runtime.launch.torchrun import stop_tree  # noqa: E402

FORMAT = "partitioner.gpu-check/1"
# seconds per phase on the GPU (H100: P2's 170M GPT trains in ~40 ms a step; most of each run is
# start-up, CUDA init and checkpoint writes) and in the dry run on two loaded CPU cores
# (generous: only a hang should meet them there)
LIMITS = {"P0": (40, 120), "P1": (100, 200), "P2": (170, 300), "P3": (60, 150), "P4": (80, 200), "P5": (90, 200),
          "P6": (170, 150), "P7": (60, 200)}
BUDGET_S = 470  # 8 minutes less a margin for the start and the report
NOT_ON_ONE_GPU = [
    "NCCL collectives between ranks (dp all-reduce, ZeRO's reduce_scatter, PipelineStage P2P, DTensor)",
    "cuda:LOCAL_RANK mapping with several GPUs per host; elastic re-plan before set_device (B3)",
    "the canary exchange under NCCL at dp 2 (B4)", "NCCL watchdog and teardown on a killed peer (F2)",
    "NCCL buffer memory per communicator (D3)", "predicted against measured communication time (NVLink/IB)"]


def _summary_lines(phases: dict) -> list[str]:
    """One line per run: predicted against measured step time and peak memory."""
    lines = []
    for key, phase in phases.items():
        for run in (phase.get("result") or {}).get("runs", []):
            def mib(v):
                return f"{v / 2**20:.0f} MiB" if isinstance(v, (int, float)) else "-"

            def ms(v):
                return f"{v * 1e3:.1f} ms" if isinstance(v, (int, float)) else "-"
            # the runtime's own reserved peak, under whatever name memory_rank_0.json gives it
            reserved = next((v for k, v in (run.get("memory") or {}).items() if "reserved" in k
                             and isinstance(v, (int, float))), None)
            lines.append(f"{run['name']}: {'ok' if run.get('ok') else 'FAILED: ' + str(run.get('error'))[:160]}; "
                         f"step {ms(run.get('predicted_step_time_s'))} predicted, {ms(run.get('measured_step_time_s'))} "
                         f"measured; peak {mib(run.get('predicted_peak_bytes'))} predicted, "
                         f"{mib(run.get('measured_peak_bytes'))} allocated"
                         + (f", {mib(reserved)} reserved" if reserved is not None else "")
                         + f", {mib(run.get('device_used_bytes_peak'))} device-wide")
    return lines


def _write(path: Path, report: dict) -> None:
    report["summary"] = _summary_lines(report["phases"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_check(folders: Path, out: Path, *, dry_run: bool, work: Path | None = None, only: list[str] | None = None,
              budget_s: float = BUDGET_S) -> dict:
    """Every phase in order, each in its own process (Note [a report that survives])."""
    manifest = json.loads((folders / MANIFEST).read_text())
    ensure_corpus(folders, manifest)
    work = Path(work or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = {"format": FORMAT, "dry_run": dry_run, "started_unix": time.time(), "budget_s": budget_s,
              "folders": {"kind": manifest.get("kind"), "prepared_dry_run": manifest.get("dry_run"),
                          "compiled": {k: {f: v[f] for f in ("ok", "error", "fallback") if f in v}
                                       for k, v in manifest["folders"].items()}},
              "work": str(work), "phases": {}, "not_covered_on_one_gpu": NOT_ON_ONE_GPU}
    from benchmarks._gpu_check_phases import PHASES  # noqa: PLC0415 - stdlib and runtime only: no torch here

    for key, (title, _) in PHASES.items():
        if only and key not in only:
            continue
        limit = LIMITS[key][1 if dry_run else 0]
        left = budget_s - (time.monotonic() - started)
        entry = report["phases"][key] = {"name": title, "limit_s": limit}
        if left < 5:
            entry.update(status="skipped", error="the check's time budget is spent")
            _write(out, report)
            continue
        entry.update(_phase(key, folders, work, dry_run, min(limit, left)))
        _write(out, report)
        print(f"[gpu-check] {key} {title}: {entry['status']} in {entry['seconds']:.0f} s"
              + (f": {entry['error']}" if entry.get("error") else ""), file=sys.stderr, flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    _write(out, report)
    return report


def _phase(key: str, folders: Path, work: Path, dry_run: bool, limit_s: float) -> dict:
    path = work / f"{key}.json"
    path.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "_phase", key, "--folders", str(folders), "--work",
               str(work), "--limit", str(limit_s), *(["--dry-run"] if dry_run else [])]
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=limit_s)
        status = None
    except subprocess.TimeoutExpired:
        stop_tree(proc, grace_s=10)  # the phase, its torchrun and every worker below it
        text, status = proc.communicate()[0] or "", "timeout"
    result = dict(Answers.load(path))
    error = result.get("error")
    if status == "timeout":
        error = f"timed out after {limit_s:.0f} s" + (f" (first error: {error})" if error else "")
    elif proc.returncode != 0:
        status = "error"
        tail = [line for line in (text or "").strip().splitlines() if line.strip()][-1:]
        error = error or f"the phase exited {proc.returncode}: {tail[0][:300] if tail else 'no output'}"
    else:
        status = "skipped" if result.get("skipped") else ("error" if error else "ok")
    return {"status": status, "seconds": round(time.monotonic() - started, 1), "error": error, "result": result,
            "output_tail": (text or "").strip().splitlines()[-8:] if status in ("error", "timeout") else None}


def _phase_main(args) -> int:
    from benchmarks._gpu_check_phases import PHASES, Context  # noqa: PLC0415 - the phase's own process

    out = Answers(Path(args.work) / f"{args.name}.json")
    out.save()
    manifest = json.loads((Path(args.folders) / MANIFEST).read_text())
    ctx = Context(Path(args.folders).resolve(), Path(args.work).resolve(), "cpu" if args.dry_run else "cuda",
                  args.dry_run, manifest, time.monotonic() + args.limit)
    try:
        PHASES[args.name][1](ctx, out)
    except Exception as exc:  # noqa: BLE001 - recorded; the parent reads the file
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        raise
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="compile the program folders (on a CPU machine with OR-Tools)")
    p.add_argument("--out", required=True, help="folder to write (replaced)")
    p.add_argument("--kind", default="h100", choices=("h100", "h200"), help="GPU kind to compile for (default h100)")
    p.add_argument("--corpus-at", default=DEFAULT_CORPUS_AT, help="absolute path of the token corpus on both "
                   f"machines (default {DEFAULT_CORPUS_AT})")
    p.add_argument("--dry-run", action="store_true", help="tiny folders for the CPU dry run")
    r = sub.add_parser("run", help="run every phase and write the JSON report")
    r.add_argument("--folders", required=True, help="what `prepare --out` wrote")
    r.add_argument("--out", required=True, help="the JSON report to write (rewritten after every phase)")
    r.add_argument("--work", help="where runs write (default: a new temporary folder)")
    r.add_argument("--only", help="comma-separated phases, e.g. P2,P6 (default: all)")
    r.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole check (default {BUDGET_S})")
    r.add_argument("--dry-run", action="store_true", help="on CPU under gloo, with folders prepared --dry-run")
    f = sub.add_parser("_phase")
    f.add_argument("name")
    f.add_argument("--folders", required=True)
    f.add_argument("--work", required=True)
    f.add_argument("--limit", type=float, required=True)
    f.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        try:
            manifest = prepare(Path(args.out), dry_run=args.dry_run, kind=args.kind, corpus_at=args.corpus_at)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        bad = [name for name, entry in manifest["folders"].items() if not entry["ok"] and entry["args"]]
        print(f"[prepare] {len(manifest['folders']) - len(bad)} of {len(manifest['folders'])} folders in {args.out}"
              + (f"; not compiled: {', '.join(bad)} (the run records why)" if bad else ""), file=sys.stderr)
        return 0
    if args.command == "_phase":
        return _phase_main(args)
    folders = Path(args.folders).resolve()
    if not (folders / MANIFEST).is_file():
        print(f"error: --folders {args.folders}: no {MANIFEST} there: run `python benchmarks/gpu_check.py prepare "
              f"--out {args.folders}` (make gpu-check-folders) on a machine with OR-Tools first", file=sys.stderr)
        return 2
    manifest = json.loads((folders / MANIFEST).read_text())
    if manifest.get("dry_run") != args.dry_run:
        print(f"error: --folders {args.folders} were prepared {'with' if manifest.get('dry_run') else 'without'} "
              f"--dry-run; run {'with' if manifest.get('dry_run') else 'without'} it, or prepare them again",
              file=sys.stderr)
        return 2
    only = [k.strip().upper() for k in args.only.split(",")] if args.only else None
    unknown = sorted(set(only or ()) - set(LIMITS))
    if unknown:
        print(f"error: --only {args.only}: no phase {', '.join(unknown)}; the phases are {', '.join(LIMITS)}",
              file=sys.stderr)
        return 2
    report = run_check(folders, Path(args.out), dry_run=args.dry_run, work=Path(args.work) if args.work else None,
                       only=only, budget_s=args.budget)
    for line in report["summary"]:
        print(line)
    bad = [k for k, v in report["phases"].items() if v["status"] not in ("ok", "skipped")]
    print(f"[gpu-check] {len(report['phases']) - len(bad)} of {len(report['phases'])} phases ok or skipped"
          + (f"; not: {', '.join(bad)}" if bad else "") + f"; report: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
